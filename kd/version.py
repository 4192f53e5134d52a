"""kd's version, in one place (the package, checkpoints and the CLI read it), and the oldest torch
it runs on."""

from __future__ import annotations

import re
from typing import Optional

__version__ = "0.1.0"

#: The oldest torch kd runs on (setup.cfg says the same; a test holds them equal):
#: ``torch.amp.GradScaler(device)`` needs 2.3, ``torch.get_autocast_dtype(device)`` 2.4.
MIN_TORCH = (2, 4)


def torch_too_old(version: str) -> Optional[str]:
    """Why torch ``version`` is too old for kd, or None."""
    found = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if found >= MIN_TORCH:
        return None
    need = ".".join(map(str, MIN_TORCH))
    return f"kd needs torch {need} or newer, this is torch {version}: pip install 'torch>={need}'"
