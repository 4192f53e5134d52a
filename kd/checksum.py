"""SHA-256 of files: kd's one way to checksum what it writes (checkpoints, prepared copies)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Union

#: bytes read at a time, into one reused buffer
BLOCK = 1 << 22


def file_sha256(path: Union[str, Path]) -> str:
    """The SHA-256 of a file's bytes, as hex (read in blocks into one buffer: no allocation per block)."""
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
