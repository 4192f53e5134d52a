"""Stops asked for by signals: SIGTERM / SIGINT set a flag that the run checks where it can stop
cleanly (step boundaries, validation batches, the ends of set-up), so a stop keeps the step reached.

Where a stop can come from, and what kd makes of it:

* a terminal's Ctrl-C reaches every process of the foreground group: kd's launcher (torch's
  elastic agent), its workers, their loader workers. The agent then sends each worker a second
  SIGINT and kills it 30 s later. So in a launched worker a repeated signal only confirms the
  stop; the worker never dies mid-save on it. A process nobody launched takes a second Ctrl-C as
  "stop now" (KeyboardInterrupt), deferred while a checkpoint is written (:meth:`StopFlag.critical`).
* kd's launcher starts its workers with the two signals blocked (:func:`held_for_children`); each
  worker takes them once kd's handler is in place (:func:`install_early`), so a Ctrl-C during a
  worker's start-up stops it quietly instead of in Python's import machinery with a traceback.
* the loader's forkserver is started with SIGINT ignored (:func:`ignoring_sigint`), for the same reason.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional

from kd.runfolder import RunFolder

SIGNALS = (signal.SIGTERM, signal.SIGINT)

#: The first stop signal this process received before any StopFlag existed (:func:`install_early`).
_early: Dict[str, str] = {}


class Interrupted(BaseException):
    """A stop asked for by a signal, after the checkpoint of that exact step was written (or, in
    set-up, before anything was). A BaseException, as KeyboardInterrupt: no ``except Exception``
    of set-up code takes it for an error of its own."""

    def __init__(self, signame: str, step: int = 0, out: Optional[Path] = None, message: Optional[str] = None):
        self.signame = signame
        if not message:
            assert out is not None, "Interrupted needs the run folder or a message"
            message = (
                f"stopped by {signame} at step {step}; checkpoint written to "
                f"{RunFolder(out).last}; continue with: kd train --out {out} --resume"
            )
        super().__init__(message)


def in_setup(signame: str) -> Interrupted:
    """The stop of a run that had not taken its first step: nothing of it is kept. ``signame`` is
    empty in a process that did not receive the signal itself (another process did)."""
    signame = signame or "a signal"
    return Interrupted(signame, message=f"stopped by {signame} during set-up; nothing was written")


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def install_early(launched: bool) -> Callable[[], None]:
    """At the start of a run's process, until a :class:`StopFlag` takes over (the run has set up,
    written nothing yet): a stop signal ends the process's set-up at once (:func:`in_setup`); a
    repeated one is ignored where ``launched`` and stops a process nobody launched at once. Then
    the signals held while the process started (:func:`held_for_children`) arrive."""

    def stop_setup(signum, frame):
        if "signame" in _early:  # already stopping
            if signum == signal.SIGINT and not launched:
                raise KeyboardInterrupt
            return
        _early["signame"] = signal.Signals(signum).name
        raise in_setup(_early["signame"])

    _early.clear()
    if not _main_thread():
        return lambda: None
    previous = {sig: signal.signal(sig, stop_setup) for sig in SIGNALS}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)

    def restore() -> None:
        """The handlers as they were before (a run in a longer-lived process, as in tests)."""
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    return restore


@contextlib.contextmanager
def held_for_children() -> Iterator[None]:
    """SIGINT and SIGTERM blocked in this (the main) thread while it starts processes, which begin
    with them blocked (a signal mask survives fork and exec). A helper thread, started before the
    block, still takes them for this process, and Python runs their handlers in the main thread."""
    if not _main_thread():
        yield
        return
    from multiprocessing import resource_tracker

    # started now: when multiprocessing starts it later, it unblocks both signals in this thread.
    # Quiet about leaks: it cleans up the semaphores of a rank that was killed (which kd reports in
    # one line, kd.run.launch.RankFailed), and would warn of them after that line.
    quiet = "ignore:resource_tracker:UserWarning"
    previous_warnings = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = f"{previous_warnings},{quiet}" if previous_warnings else quiet
    try:
        resource_tracker.ensure_running()
    finally:
        if previous_warnings is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = previous_warnings
    done = threading.Event()
    helper = threading.Thread(target=done.wait, name="kd-signals", daemon=True)
    helper.start()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        done.set()
        helper.join()


@contextlib.contextmanager
def ignoring_sigint() -> Iterator[None]:
    """SIGINT ignored while a helper process is started: it inherits the disposition through exec and
    never prints a KeyboardInterrupt traceback (its parent stops it)."""
    if not _main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class StopFlag:
    """SIGTERM / SIGINT set a flag; the run stops at the next point it checks.

    ``launched``: the process is one of several a launcher started (kd's, torchrun, srun), where a
    repeated signal is the launcher forwarding the first one: it changes nothing. Otherwise a
    second SIGINT stops the process at once (KeyboardInterrupt), though not inside :meth:`critical`.
    """

    def __init__(self, launched: bool = False):
        self.signame = ""
        self.requested = False
        self.launched = launched
        self._forced = False
        self._critical = 0
        self._previous: Dict[int, object] = {}
        if _main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT and not self.launched:  # a second Ctrl-C: stop now
            if self._critical:
                self._forced = True  # after the checkpoint being written
                return
            raise KeyboardInterrupt
        if not self.requested:
            self.requested = True
            self.signame = signal.Signals(signum).name
            # the process is stopping: should the set-up handler be back (after restore(), while the
            # process ends), a late copy of the signal is a repeat to it, not a new stop
            _early.setdefault("signame", self.signame)

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        """A block a forced stop waits for (a checkpoint's write)."""
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1
            if not self._critical and self._forced:
                self._forced = False
                raise KeyboardInterrupt

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous = {}
