"""One writer per folder: the lock a run holds on each folder it writes (``FOLDER/.kd-lock``)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

from kd.errors import KDError
from kd.runfolder import LOCK_FILE, why_unwritable

#: lockf's errors on a filesystem without POSIX locks (NFSv3 without lockd, some FUSE filesystems)
NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)


class FolderLock:
    """One writer per folder: an advisory POSIX record lock (``fcntl.lockf``) on ``FOLDER/.kd-lock``,
    held by the process that launches a run for the run's whole life, the file naming its holder.

    POSIX locks rather than ``flock``: they work over NFS (NFSv4 locks, NFSv3's lock manager),
    where ``flock`` may lock only on the client that took it; and a child process does not inherit
    them, so a helper process left behind by a killed run cannot keep its folder locked. The kernel
    (or the NFS server, once the client's lease ends) releases the lock when its holder dies, kill
    -9 included: the file left behind names a holder that is gone, and the next run takes it over.

    Taken before any work on the folder: a folder (and its parents) missing at that moment is made
    for the lock file, and :meth:`release` removes the file and the folders it made, if nothing else
    was written to them, so a run refused or stopped in set-up leaves the disk as it was.
    """

    def __init__(self, root: Union[str, Path], option: str = "--out"):
        self.root = Path(root)
        self.path = self.root / LOCK_FILE
        self.option = option
        #: The record of a holder that ended without releasing the lock (killed), when one was taken over.
        self.taken_over: Optional[Dict[str, Any]] = None
        self._fd: Optional[int] = None
        self._made: List[Path] = []

    def acquire(self) -> FolderLock:
        """Take the lock, or raise a KDError naming the process that holds it."""
        if self.root.exists() and not self.root.is_dir():
            raise KDError(f"{self.option} {self.root} exists and is not a folder")
        why = why_unwritable(self.root)
        if why:
            raise KDError(f"{self.option} {self.root} cannot be written: {why}")
        missing = [p for p in (self.root.absolute(), *self.root.absolute().parents) if not p.exists()]
        for _ in range(50):  # a holder's release may remove the file (or folder) between two steps here
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise KDError(f"{self.option} {self.root}: cannot make its lock file: {exc.strerror}") from None
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in NO_LOCKS:  # a filesystem without POSIX locks: the run goes on, unguarded
                    print(
                        f"kd: warning: {self.root}'s filesystem takes no locks ({exc.strerror}): a second kd run "
                        f"writing it at the same time cannot be detected",
                        file=sys.stderr,
                    )
                    return self._hold(fd, missing)
                holder = _read_record(fd)
                os.close(fd)
                if exc.errno not in (errno.EACCES, errno.EAGAIN):
                    raise KDError(f"{self.option} {self.root}: cannot lock {self.path}: {exc.strerror}") from None
                raise KDError(
                    f"{self.option} {self.root} is being written by another kd run ({describe_holder(holder)}); "
                    f"wait for it to end, or give another {self.option}"
                ) from None
            if not _same_file(fd, self.path):  # released and removed after we opened it: open the new one
                os.close(fd)
                continue
            previous = _read_record(fd)
            if previous:  # its holder was killed: what it was writing then is half-written
                self.taken_over = previous
                remove_stale_temporaries(self.root)
            return self._hold(fd, missing)
        raise KDError(f"{self.option} {self.root}: its lock file {self.path} keeps being replaced; try again")

    def _hold(self, fd: int, missing: List[Path]) -> FolderLock:
        """The lock file ``fd`` (locked) names this process; the folders made for it are noted."""
        self._fd = fd
        self._made = [p for p in missing if p.is_dir()]
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
        except OSError as exc:  # a full disk: the run could not have written anything either
            self.release()
            raise KDError(f"{self.option} {self.root}: cannot write its lock file: {exc.strerror}") from None
        return self

    def release(self) -> None:
        """Give the lock up: remove its file, and the folders :meth:`acquire` made if they are empty."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # while still held: a process waiting on this file then sees it replaced
        os.close(self._fd)
        self._fd = None
        for folder in self._made:  # deepest first
            try:
                folder.rmdir()
            except OSError:
                break


def remove_stale_temporaries(root: Path) -> None:
    """Remove the temporary files (``.NAME.tmp``, ``.NAME.XXXX.tmp``, ``NAME.json.tmp``) that kd's
    atomic writers leave in ``root`` and its ``checkpoints`` when killed mid-write; called once its
    killed writer's lock is taken over, so no writer of them is alive. The files they were to
    replace are untouched."""
    for folder in (root, root / "checkpoints"):
        for path in [*folder.glob(".*.tmp"), *folder.glob("*.json.tmp")] if folder.is_dir() else ():
            with contextlib.suppress(OSError):
                path.unlink()


def describe_holder(record: Optional[Dict[str, Any]]) -> str:
    """``pid N on host H, started at T`` from a lock file's record."""
    if not record:
        return "its pid and host not yet written"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record.get("started", 0))))
    return f"pid {record.get('pid')} on host {record.get('host')}, started {started}"


@contextlib.contextmanager
def locked(folders: Sequence[Path], option: str = "--out") -> Iterator[List[FolderLock]]:
    """Hold the lock of every folder in ``folders`` (in that order) until the block ends; a folder
    already held by another process releases those taken and raises its KDError."""
    locks: List[FolderLock] = []
    seen = set()
    try:
        for folder in folders:
            key = os.path.abspath(folder)
            if key in seen:  # a process's POSIX locks are one per file: the same folder twice is once
                continue
            seen.add(key)
            locks.append(FolderLock(folder, option).acquire())
        yield locks
    finally:
        for lock in reversed(locks):
            lock.release()


def _read_record(fd: int) -> Optional[Dict[str, Any]]:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)
