"""The one error type for user mistakes (the CLI prints its message on one line and exits 2),
the near names a refusal suggests, and the one line of a failed write."""

import contextlib
import difflib
import errno
import os
from typing import Iterable, Iterator, Union


def suggest(name: str, choices: Iterable[str], n: int = 3) -> str:
    """' (did you mean a, b?)' for close matches of ``name`` in ``choices``, else ''."""
    close = difflib.get_close_matches(name, list(choices), n=n, cutoff=0.6)
    return f" (did you mean {', '.join(close)}?)" if close else ""


class KDError(Exception):
    """A problem with the user's input (options, recipe, data, weights, environment).

    Raise it with a message that says what is wrong and, where possible, what to do.
    Anything else that escapes is a bug in kd and keeps its traceback.
    """

    def __init__(self, *args):
        # raised in a DataLoader worker (a prepared copy's damaged image), it is made again in the run's
        # process from the worker's whole traceback (torch's ExceptionWrapper): its own line is kept
        if len(args) == 1 and isinstance(args[0], str) and args[0].startswith("Caught "):
            head, _, traceback = args[0].partition("\nOriginal Traceback")
            if traceback and " in DataLoader worker process " in head:
                args = (traceback.rstrip().rsplit("\n", 1)[-1].split(": ", 1)[-1],)
        super().__init__(*args)


class NonFinite(KDError):
    """A run's loss stayed NaN/inf (``--max-nonfinite-steps``), decided alike on every process: with
    several students in one run it stops that student only."""


#: what to do where a write failed with this errno (the reason is the system's own words)
WRITE_FIXES = {
    errno.ENOSPC: "free space",
    errno.EDQUOT: "free space or raise the disk quota",
    errno.EFBIG: "raise the file-size limit (ulimit -f) or write to a filesystem that takes larger files",
    errno.EROFS: "write to a filesystem that is not read-only",
    errno.EACCES: "make it writable, or write somewhere else",
    errno.EPERM: "make it writable, or write somewhere else",
    errno.ENOTDIR: "a part of the path is a file, not a folder: write somewhere else",
    errno.EISDIR: "a folder stands where the file goes: move it, or write somewhere else",
    errno.EEXIST: "a file stands where a folder goes: move it, or write somewhere else",
    errno.ENOENT: "no file can be made there: write somewhere else",
    errno.ENAMETOOLONG: "write to a shorter path",
    errno.EIO: "check the disk",
}

#: errnos that only a write meets: wherever one comes from, kd says it in one line
WRITE_ONLY_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def write_reason(exc: OSError) -> str:
    """Why a write failed, in words ("no space left on the device", "file too large")."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on the device" + (" (disk quota exceeded)" if exc.errno == errno.EDQUOT else "")
    text = exc.strerror or (os.strerror(exc.errno) if exc.errno else "") or str(exc).splitlines()[0]
    return text[:1].lower() + text[1:]


def write_fix(exc: OSError) -> str:
    """What to do where a write failed with ``exc`` ("free space", "raise the file-size limit ...")."""
    return WRITE_FIXES.get(exc.errno or 0, "fix that")


def cannot_write(exc: OSError, path: Union[str, os.PathLike, None] = None, then: str = "run again") -> KDError:
    """A failed write as one line: ``cannot write FILE: reason; what to do, then THEN`` (``path`` is
    what was being written; where it is None, the file the error names: a rename's target, else its file)."""
    where = path if path is not None else (exc.filename2 or exc.filename)
    return KDError(f"cannot write{f' {where}' if where else ''}: {write_reason(exc)}; {write_fix(exc)}, then {then}")


@contextlib.contextmanager
def writing(path: Union[str, os.PathLike, None], then: str = "run again") -> Iterator[None]:
    """Any OSError inside is :func:`cannot_write`'s one line about ``path``."""
    try:
        yield
    except OSError as exc:
        raise cannot_write(exc, path, then) from None
