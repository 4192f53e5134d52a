"""kd's tensor files (checkpoints, exported weights): written atomically, read with weights_only=True.

Every file :func:`save_atomic` and :func:`copy_atomic` write has its SHA-256 beside it, in
``NAME.sha256`` as ``sha256sum`` writes it (``HEX  NAME``), so ``sha256sum -c last.pt.sha256``
checks it without kd; kd checks it wherever it reads its own files (:func:`verify`: resume,
``--teacher-weights``/``--student-weights``, ``kd eval``, ``kd export``, ``kd verify``). A file with
no sums file beside it (one from elsewhere) is read as it is.

A kill may come between any two steps, and must never leave a sound file refused. So the sums
file lists every version of the file that may be in place, and only those:

1. the new version is written, flushed and synced to a temporary file, and its sum read back
   from the disk;
2. the sums file is replaced (atomically) by one listing the new sum *and* the sum of the file in
   place (the one it listed, or, where it listed none or several, the file's own, computed);
3. the temporary file is renamed over the file;
4. the sums file is replaced by one listing the new sum alone.

Killed after 2 or 3, the file in place (old or new) is listed; after 4, only the new one. A file
whose bytes match none of its listed sums is damaged, and refused in one line.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import torch

from kd.checksum import file_sha256, unreadable
from kd.errors import KDError

#: a line of ``sha256sum --tag`` (BSD's form)
BSD_LINE = re.compile(r"^SHA256 \(.*\) = ([0-9a-fA-F]{64})$")
#: the suffix of a file's sums file: ``last.pt`` has ``last.pt.sha256``
SUMS = ".sha256"
#: files verified in this process, by path and identity (a run reads its checkpoint more than once)
_verified: Set[Tuple[str, int, int, int]] = set()


def sums_file(path: Union[str, Path]) -> Path:
    """Where the SHA-256 of ``path`` is kept: ``NAME.sha256`` beside it."""
    path = Path(path)
    return path.with_name(path.name + SUMS)


def listed_sums(path: Union[str, Path]) -> Optional[List[str]]:
    """The sums listed for ``path`` (the first is the newest); None where it has no sums file."""
    sums = sums_file(path)
    try:
        text = sums.read_text(encoding="ascii")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise KDError(f"cannot read {sums} ({exc}); delete it to read {Path(path).name} unchecked") from None
    listed = []
    for line in text.splitlines():  # sha256sum's "HEX  NAME" (kd's), or its BSD form "SHA256 (NAME) = HEX"
        tag = BSD_LINE.match(line.strip())
        words = line.split()
        if tag or words:
            listed.append((tag.group(1) if tag else words[0]).lower())
    if not listed or any(len(h) != 64 or any(c not in "0123456789abcdef" for c in h) for h in listed):
        raise KDError(f"{sums} is not a list of SHA-256 sums; delete it to read {Path(path).name} unchecked")
    return listed


def _write_sums(path: Path, sums: List[str]) -> None:
    """Replace ``path``'s sums file, atomically, by one listing ``sums``."""
    target = sums_file(path)
    tmp = target.with_name(f".{target.name}.tmp")
    with open(tmp, "w", encoding="ascii") as fh:
        fh.write("".join(f"{h}  {path.name}\n" for h in sums))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, target)
    _sync_folder(target.parent)  # on the disk before the next rename in the folder


def _sync_folder(folder: Path) -> None:
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _commit(tmp: str, path: Path, digest: str) -> None:
    """Rename the written and synced ``tmp`` (whose sum is ``digest``) over ``path``, its sums file
    listing the file in place at every moment (steps 2 to 4 of the module's docstring)."""
    in_place: List[str] = []
    if path.is_file():
        listed = listed_sums(path) if sums_file(path).is_file() else None
        # one listed sum is the file's (or the file is damaged, and is replaced now); none or
        # several (a file from an older kd, or a kill between steps 2 and 4): the file says
        in_place = listed if listed is not None and len(listed) == 1 else [file_sha256(path)]
    _write_sums(path, [digest] + [h for h in in_place if h != digest])
    os.replace(tmp, path)
    _sync_folder(path.parent)
    _write_sums(path, [digest])


def save_atomic(obj: Dict[str, Any], path: Path) -> str:
    """Write to a temporary file in the same folder, fsync, rename: never a truncated file; its
    SHA-256 (returned) in ``NAME.sha256`` beside it.

    A failed write (disk full) leaves the previous file as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        digest = file_sha256(tmp)  # what is on the disk, read back
        _commit(tmp, path, digest)
    except BaseException as exc:
        # torch.save's writer reports a failed write as a RuntimeError: the OSError it met, where
        # Python saw one (a file-size limit), or a full disk, seen before the partial file goes
        behind = exc.__context__ if isinstance(exc, RuntimeError) else None
        full = isinstance(exc, RuntimeError) and disk_full(path.parent)
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(behind, OSError):
            raise behind from None
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from exc
        raise
    return digest


def disk_full(folder: Path) -> bool:
    """Less than a MiB left where ``folder`` is."""
    try:
        return shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False


def copy_atomic(src: Path, dst: Path) -> str:
    """Copy ``src`` to ``dst`` through a temporary file and a rename, its SHA-256 (returned) beside
    it as :func:`save_atomic` writes it. Where ``src`` has sums, a copy that matches none of them
    is not put in place."""
    dst = Path(dst)
    listed = listed_sums(src)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    try:
        copied = hashlib.sha256()
        with open(src, "rb") as fin, os.fdopen(fd, "wb") as fout:
            for block in iter(lambda: fin.read(1 << 22), b""):
                copied.update(block)
                fout.write(block)
            fout.flush()
            os.fsync(fout.fileno())
        if listed is not None and copied.hexdigest() not in listed:
            raise KDError(f"{damaged(src)} (found copying it to {dst}, which is intact)")
        _commit(tmp, dst, copied.hexdigest())
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return copied.hexdigest()


def remove(path: Path) -> None:
    """Delete ``path``, then its sums file (a kill between leaves a sums file of nothing, never a
    file without its sums)."""
    path.unlink()
    sums_file(path).unlink(missing_ok=True)


def verify(path: Union[str, Path]) -> Optional[bool]:
    """Check ``path`` against the sums kd wrote beside it: True where it matches one, None where
    it has no sums file (a file from elsewhere: nothing to check); a KDError of one line where it
    matches none (damaged). A file verified once in this process is not read again while its
    size, time and inode stay."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        return None  # reading it says what is wrong
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if key in _verified:
        return True
    sound = matches_sums(path)
    if sound is None:
        return None
    if not sound:
        raise KDError(damaged(path))
    _verified.add(key)
    return True


def matches_sums(path: Path) -> Optional[bool]:
    """Whether ``path``'s bytes match a sum its sums file lists (None: it has none). A file that a
    run replaced while it was read (its sums file or its inode changed meanwhile) is read again,
    so a reader beside a run's checkpoint writes never calls a sound file damaged."""
    for _ in range(5):
        listed = listed_sums(path)
        if listed is None:
            return None
        before = path.stat()
        try:
            digest = file_sha256(path)
        except OSError as exc:  # a bad sector, say: one line, not a traceback
            raise KDError(unreadable(path, exc)) from None
        if digest in listed:
            return True
        after = path.stat()
        if (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns) and listed_sums(path) == listed:
            return False
    return False


def damaged(path: Union[str, Path]) -> str:
    """The one line that says ``path`` does not match its sums, and what to do."""
    path = Path(path)
    if path.parent.name == "checkpoints" and path.name.endswith(".pt"):  # one of a run's
        run = path.parent.parent
        what = (
            f"resume from a sound one of its run's checkpoints (--resume {path.parent}/best.pt or a step_*.pt "
            f"copy; kd verify {run} lists them)"
        )
    else:
        what = "copy it again from where it came from"
    return (
        f"{path} is damaged: its bytes do not match the SHA-256 kd wrote beside it in {sums_file(path).name} "
        f"(a disk or copy error changed them); {what}"
    )


def read(path: Union[str, Path], cannot: str, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU: kd's one way to read a tensor file.

    A file that needs arbitrary code to unpickle is refused; any failure is a KDError of one
    line that starts with ``cannot`` ("cannot load checkpoint", "cannot read weights file").
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:
        raise KDError(f"{cannot} {path}: {why_unreadable(path, exc)}") from None


def why_unreadable(path: Union[str, Path], exc: Exception) -> str:
    """What a file torch.load could not read is, in one complete sentence (torch's own messages run
    to paragraphs, and blame unpickling for files that are no pickle at all)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
    except OSError as err:
        return f"it cannot be opened ({err.strerror or err})"
    if head.startswith(b"PK\x03\x04"):  # torch.save's zip archive
        if isinstance(exc, pickle.UnpicklingError) and "weights only" in str(exc).lower():
            return (
                "it holds Python objects other than tensors, which would need code to be unpickled, and kd "
                "refuses that (weights_only=True); save the model's state_dict() with torch.save instead"
            )
        return f"the PyTorch archive is damaged or truncated ({type(exc).__name__}); copy or save it again"
    if head[:1] == b"\x80":  # a pickle (protocol 2 or later): torch's legacy format, or plain pickle
        if isinstance(exc, pickle.UnpicklingError) and "weights only" in str(exc).lower():
            return (
                "it is a pickle of Python objects other than tensors, which would need code to be unpickled, "
                "and kd refuses that (weights_only=True); save the model's state_dict() with torch.save instead"
            )
        return f"the pickle is damaged or truncated ({type(exc).__name__}); copy or save it again"
    return "it is not a PyTorch file (torch.save writes a zip archive or a pickle, and this file is neither)"
