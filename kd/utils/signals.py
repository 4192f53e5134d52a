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
* before any of that, from the start of ``kd train`` / ``kd teach`` (:func:`install_first`), a stop
  ends the command in one line (nothing was written yet); once the run's handlers are gone again
  (the run ended), a stop lets the command end as it would and its exit code says it was stopped.
* a launched process whose run has ended, while its launcher collects the results, leaves at once
  on a stop signal (:func:`exit_when_stopped`).
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

#: The first stop signal this process received before any StopFlag existed (:func:`install_early`),
#: or during the run (a StopFlag's), and "ended" once the run's StopFlag was restored.
_early: Dict[str, str] = {}

#: The kd command's own handler (:func:`install_first`): "phase" (before the run, or after it) and
#: the stop signal it took ("signame").
_command: Dict[str, str] = {}

#: The handlers torch's elastic agent installs in kd's launcher (and leaves in place).
LAUNCHER_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, n))


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


def install_first() -> Callable[[], str]:
    """At the start of a command that runs a run (kd train, kd teach), before torch and the rest are
    imported: a stop signal ends the command at once (:class:`Interrupted`, before the run started,
    nothing written). The run's own handlers replace it while they are in place (:func:`install_early`,
    :class:`StopFlag`, the launcher's: :func:`launcher_handlers`); once they are gone (:func:`run_ended`)
    a stop is only noted, the command ends as it would (its files are complete), and the function
    returned (which puts the previous handlers back) gives the noted signal's name."""

    def stop(signum, frame):
        if "signame" in _command:  # already stopping
            return
        _command["signame"] = signal.Signals(signum).name
        if _command.get("phase") == "before":
            raise Interrupted(
                _command["signame"],
                message=f"stopped by {_command['signame']} before the run started; nothing was written",
            )

    _command.clear()
    if not _main_thread():
        return lambda: ""
    _command["phase"] = "before"
    previous = {sig: signal.signal(sig, stop) for sig in SIGNALS}

    def restore() -> str:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        noted = _command.get("signame", "") if _command.get("phase") == "after" else ""
        _command.clear()
        return noted

    return restore


def run_ended() -> None:
    """The run's handlers are gone (the run ended): a stop from now on is noted by :func:`install_first`'s
    handler, with one the run took after its last check (a StopFlag set as it ended)."""
    if not _command:
        return
    _command["phase"] = "after"
    if "signame" in _early and "signame" not in _command:
        _command["signame"] = _early["signame"]


def exit_when_stopped() -> None:
    """In a launched process whose run has ended (its result on the way to the launcher): a stop
    signal ends it at once, with the code of a stop (143 for SIGTERM, 130 for SIGINT); the launcher,
    stopping, waits for it (and kills it after 30 s otherwise)."""
    if not _main_thread():
        return

    def leave(signum, frame):
        raise SystemExit(128 + signum)

    for sig in SIGNALS:
        signal.signal(sig, leave)


def stopped_in_run() -> str:
    """The name of a stop signal this process took during its run that the run did not act on (it
    came after the run's last check), else empty."""
    return _early.get("signame", "")


@contextlib.contextmanager
def launcher_handlers() -> Iterator[None]:
    """Around torch's elastic launch: the handlers it installs (and leaves) replaced by those before
    it, and :func:`run_ended` once the launch is over."""
    previous = {sig: signal.getsignal(sig) for sig in LAUNCHER_SIGNALS} if _main_thread() else {}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)
        run_ended()


def before_next_run() -> None:
    """In a command of several runs (``kd demo``), before the next one: a stop from now on ends the
    command as before its first run, and one noted since the last run ended ends it now."""
    if not _command:
        return
    _command["phase"] = "before"
    if "signame" in _command:
        signame = _command["signame"]
        raise Interrupted(signame, message=f"stopped by {signame} between runs; the finished runs are kept")


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
        if "ended" in _early:  # after the run's StopFlag: the run ended, its files are complete
            return
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
        run_ended()

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
        """The handlers as before; the run has ended (a later stop in set-up's handler is no set-up's)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous = {}
        _early["ended"] = "1"
