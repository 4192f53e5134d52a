"""SHA-256 of files: kd's one way to checksum what it writes (checkpoints, prepared copies)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Union

from kd.errors import KDError

#: bytes read at a time, into one reused buffer
BLOCK = 1 << 22


def file_sha256(path: Union[str, Path]) -> str:
    """The SHA-256 of a file's bytes, as hex (read in blocks into one buffer: no allocation per block);
    a KDError of one line where the file cannot be read."""
    digest = hashlib.sha256()
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    try:
        with open(path, "rb", buffering=0) as fh:
            while True:
                n = fh.readinto(buffer)
                if not n:
                    break
                digest.update(view[:n])
    except OSError as exc:  # a bad sector (EIO), a file gone: one line, not a traceback
        raise KDError(f"cannot read {path} to check it: {exc.strerror or exc}") from None
    return digest.hexdigest()
