"""SHA-256 of files: kd's one way to checksum what it writes (checkpoints, prepared copies)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Union

#: bytes read at a time, into one reused buffer
BLOCK = 1 << 22


def file_sha256(path: Union[str, Path]) -> str:
    """The SHA-256 of a file's bytes, as hex (read in blocks into one buffer: no allocation per block);
    :func:`unreadable` words the OSError of a file that cannot be read."""
    digest = hashlib.sha256()
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while True:
            n = fh.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
    return digest.hexdigest()


def unreadable(path: Union[str, Path], exc: OSError) -> str:
    """One line for a file that could not be read to check it (a bad sector, a file gone)."""
    return f"cannot read {path} to check it: {exc.strerror or exc}"
