"""Process deaths: every helper process kd starts dies with the one that started it, even after a kill -9.

Without help, a killed run leaves its helpers running: the loader's forkserver waits for the end
of its "alive" pipe, whose write end each DataLoader worker it forked also holds (multiprocessing
hands it to every child); each worker watches only its own parent, the forkserver; and the
resource tracker waits for the end of a pipe that all of them hold. So none of them ever ends.

Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``) breaks the cycle: the kernel kills the
process when the thread that started it ends. kd arms it

* in the forkserver (started from the main thread, :func:`forkserver_guarded`), when its
  preload imports this module (:func:`_arm_forkserver`), and in each process the forkserver forks
  (DataLoader and process-pool workers), whose parent is the forkserver's only thread;
* in each rank kd's launcher starts (:func:`die_with_parent`, from :func:`kd.run.launch.worker`).

The resource tracker then ends on its own: the last process holding its pipe is gone. Elsewhere
than Linux this is a no-op.

A DataLoader worker hands each batch's shared memory to its process through multiprocessing's
resource sharer, a thread that prints any error to stderr. Where the receiving process is killed in
the hand-over, that thread's dropped connection is not news (the launcher names the killed process);
:func:`quiet_resource_sharer` keeps it off the user's screen.

A rank whose collective fails because a peer died waits to be stopped (:func:`ended_in_failure`
tells it the peer has failed), so that the launcher names the dead peer, not it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import traceback
from multiprocessing import resource_sharer
from pathlib import Path
from types import TracebackType
from typing import Iterator, Optional, Type

#: prctl's option number (linux/prctl.h)
PR_SET_PDEATHSIG = 1

#: Set while kd starts a forkserver: the pid of the process starting it (its parent).
FORKSERVER_PARENT_ENV = "KD_FORKSERVER_PARENT"

_libc: Optional[ctypes.CDLL] = None


def _prctl_pdeathsig(sig: int) -> bool:
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        return _libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when ``parent`` (the process, or precisely the
    thread of it, that started this one) ends; where it has ended already, now."""
    if _prctl_pdeathsig(sig) and os.getppid() != parent:  # it died before the request
        os.kill(os.getpid(), sig)


def ended_in_failure(pid: int) -> bool:
    """Whether the child ``pid`` of this process's parent has ended with a signal or a non-zero
    exit code and waits to be reaped (Linux: its /proc entry; elsewhere always False)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text(encoding="ascii").rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    # field 3, the state; field 52, the exit status as waitpid reports it (Linux 3.5 on)
    return fields[0] == "Z" and len(fields) >= 50 and fields[49] != "0"


def _arm_forkserver() -> None:
    """In a forkserver kd started (its parent named in FORKSERVER_PARENT_ENV): die with that
    parent, and have each process it forks die with it."""
    parent = os.environ.get(FORKSERVER_PARENT_ENV)
    if parent is None or parent != str(os.getppid()):
        return
    del os.environ[FORKSERVER_PARENT_ENV]  # not for the processes it starts
    server = os.getpid()
    die_with_parent(int(parent))
    os.register_at_fork(after_in_child=lambda: die_with_parent(server))


@contextlib.contextmanager
def forkserver_guarded() -> Iterator[None]:
    """Around the start of a forkserver whose preload imports this module: it dies with this
    process. Only from the main thread, which lives as long as the process (the signal comes
    when the starting thread ends)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    os.environ[FORKSERVER_PARENT_ENV] = str(os.getpid())
    try:
        yield
    finally:
        os.environ.pop(FORKSERVER_PARENT_ENV, None)


def _receiver_gone(kind: Type[BaseException], trace: Optional[TracebackType]) -> bool:
    """The error is the resource sharer's thread losing the process it was handing a descriptor to."""
    frames = traceback.extract_tb(trace, limit=1)
    in_sharer = bool(frames) and frames[0].filename == resource_sharer.__file__
    return in_sharer and issubclass(kind, (ConnectionError, EOFError))


def quiet_resource_sharer() -> None:
    """In this process, the resource sharer's thread says nothing when its receiver dies (it
    reports errors through ``sys.excepthook``); every other error is reported as before."""
    shown = sys.excepthook
    if getattr(shown, "kd_quiet_sharer", False):
        return

    def hook(kind: Type[BaseException], error: BaseException, trace: Optional[TracebackType]) -> None:
        if not _receiver_gone(kind, trace):
            shown(kind, error, trace)

    hook.kd_quiet_sharer = True  # type: ignore[attr-defined]
    sys.excepthook = hook


_arm_forkserver()
