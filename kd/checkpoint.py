"""Checkpoints: full state, written atomically by the main process, loaded with weights_only=True."""
from __future__ import annotations

import os
import pickle
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Union

import numpy as np
import torch

from kd.errors import KDError

FORMAT_VERSION = 1


def rng_state() -> Dict[str, Any]:
    """This process's generators: torch's, Python's, NumPy's and its own current GPU's (not every visible GPU's)."""
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
             "python_pos": random.getstate()[2],
             "numpy": torch.from_numpy(np.random.get_state()[1].astype(np.int64)),
             "numpy_pos": int(np.random.get_state()[2])}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore :func:`rng_state`; the GPU state goes to the current GPU. An older checkpoint's list of
    every GPU's state gives the entry of the current GPU, where it has one."""
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    cuda = state.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return
    if isinstance(cuda, (list, tuple)):
        index = torch.cuda.current_device()
        cuda = cuda[index] if index < len(cuda) else None
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def save_atomic(obj: Dict[str, Any], path: Path) -> None:
    """Write to a temporary file in the same folder, fsync, rename: never a truncated file.

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
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def copy_atomic(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` through a temporary file and a rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{Path(dst).name}.", suffix=".tmp", dir=Path(dst).parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read(path: Union[str, Path], cannot: str, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU: kd's one way to read a tensor file.

    A file that needs arbitrary code to unpickle is refused; any failure is a KDError of one
    line that starts with ``cannot`` ("cannot load checkpoint", "cannot read weights file").
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        if isinstance(exc, pickle.UnpicklingError) and "weights only" in str(exc).lower():
            raise KDError(f"{cannot} {path}: it needs code to be unpickled, which kd refuses "
                          f"(weights_only=True). {first}") from None
        raise KDError(f"{cannot} {path}: {type(exc).__name__}: {first}") from None


def load(path: Path) -> Dict[str, Any]:
    """A kd checkpoint, refusing anything that needs arbitrary code to unpickle."""
    path = Path(path)
    if not path.is_file():
        raise KDError(f"nothing to resume: {path} does not exist")
    obj = read(path, "cannot load checkpoint")
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_VERSION or "student" not in obj:
        raise KDError(f"{path} is not a kd checkpoint")
    return obj
