"""Weights read from files: state dicts, loaded strictly, and kd's own run checkpoints read as weights.

A state dict comes from a plain or wrapped file (or a kd checkpoint's student); a kd run's
checkpoint also says what its run was (its model, sizes, data config, classes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from kd.errors import KDError
from kd.utils import checkpoint_io
from kd.utils.model_names import from_file


def classifier_outputs(state: Dict[str, torch.Tensor]) -> Optional[int]:
    """Number of classes of the last 2-D weight in a state dict (the classifier head)."""
    last = None
    for key, value in state.items():
        if key.endswith("weight") and getattr(value, "ndim", 0) == 2:
            last = value
    return None if last is None else int(last.shape[0])


def load_state_file(path: str) -> Dict[str, torch.Tensor]:
    """A state dict from a file: plain, wrapped (``state_dict``/``model``/...), or a kd checkpoint.

    Loaded with ``weights_only=True``: a file that needs arbitrary code to unpickle is refused; a
    file kd wrote is checked against the SHA-256 beside it first (:func:`kd.utils.checkpoint_io.verify`).
    """
    return extract_state(read_weights(path), path)


def read_weights(path: str, mmap: bool = False) -> Any:
    """What a weights file holds (memory-mapped where ``mmap`` and the file allows it), read as kd reads
    a tensor file; a KDError of one line where it does not exist, fails its SHA-256 or cannot be read."""
    p = Path(path)
    if not p.is_file():
        raise KDError(f"weights file {path} does not exist (expected pretrained, none or a file path)")
    checkpoint_io.verify(p)  # a file kd wrote: against the sum beside it
    if mmap:
        try:
            return checkpoint_io.read(p, "cannot read weights file", mmap=True)
        except KDError:  # torch's legacy (non-zip) format cannot be memory-mapped: read it whole
            pass
    return checkpoint_io.read(p, "cannot read weights file")


def extract_state(obj: Any, path: str) -> Dict[str, torch.Tensor]:
    if isinstance(obj, dict) and "kd_version" in obj and isinstance(obj.get("student"), dict):
        obj = obj["student"]
    for key in ("state_dict_ema", "state_dict", "model_ema", "model", "student", "net"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict) and _is_state(obj[key]):
            obj = obj[key]
            break
    if not (isinstance(obj, dict) and _is_state(obj)):
        raise KDError(f"{path} holds no state dict (a mapping of parameter names to tensors)")
    prefixes = ("module.", "_orig_mod.", "model.")
    out = {}
    for key, value in obj.items():
        for prefix in prefixes:
            while key.startswith(prefix):
                key = key[len(prefix) :]
        out[key] = value
    return out


def _is_state(d: dict) -> bool:
    return bool(d) and all(isinstance(k, str) for k in d) and any(isinstance(v, torch.Tensor) for v in d.values())


def load_into(model: nn.Module, state: Dict[str, torch.Tensor], name: str, source: str) -> None:
    """Load ``state`` strictly into ``model``; a mismatch is one clear KDError."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shape = [k for k in own if k in state and tuple(own[k].shape) != tuple(state[k].shape)]
    if missing or unexpected or shape:
        parts = []
        if shape:
            k = shape[0]
            parts.append(
                f"{len(shape)} shape mismatches (e.g. {k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)})"
            )
        if missing:
            parts.append(f"{len(missing)} missing keys (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys (e.g. {unexpected[0]})")
        raise KDError(f"weights {source} do not fit {name}: {'; '.join(parts)}")
    model.load_state_dict(state, strict=True)


# ----------------------------------------------------------------------------- a kd run's checkpoint as weights
def kd_checkpoint(weights: str) -> Optional[Dict[str, Any]]:
    """A kd checkpoint's contents (memory-mapped), or None for named weights and other files."""
    if not weights or not from_file(weights) or not Path(weights).is_file():
        return None
    checkpoint_io.verify(weights)  # damaged: said here, not taken for a file of another kind
    try:
        obj = checkpoint_io.read(weights, "cannot read weights file", mmap=True)
    except KDError:  # not a file kd can read: building the model says why
        return None
    return obj if isinstance(obj, dict) and "kd_version" in obj else None


def kd_run_model(weights: str) -> Optional[str]:
    """The model a kd checkpoint holds (its run's student), or None for any other weights."""
    obj = kd_checkpoint(weights)
    return obj.get("student_name") if obj else None


def named_teacher(weights: str) -> Optional[str]:
    """The model ``--teacher-weights`` name where ``--teacher`` is left out: a kd checkpoint's, or None where
    ``weights`` is no file (pretrained, a tag); a KDError saying what is wrong with a file that names none
    (missing, unreadable, damaged, or weights of another kind)."""
    if not from_file(weights):
        return None
    obj = read_weights(weights, mmap=True)
    name = obj.get("student_name") if isinstance(obj, dict) and "kd_version" in obj else None
    if not name:
        raise KDError(
            f"--teacher is required: {weights} is not a kd checkpoint, so it names no model; "
            "give the model as --teacher NAME"
        )
    return name


def kd_run_sizes(weights: str) -> Tuple[Optional[int], Optional[int]]:
    """The ``--image-size`` a kd checkpoint's run trained at and its ``--val-resize`` where given;
    None for any other weights."""
    obj = kd_checkpoint(weights)
    config = obj.get("config") if obj else None
    if not isinstance(config, dict):
        return None, None
    return _size(config.get("image_size")), _size(config.get("val_resize"))


def kd_run_data(weights: str) -> Optional[Dict[str, Any]]:
    """The student's data config saved in a kd checkpoint's config, or None for any other weights."""
    obj = kd_checkpoint(weights)
    config = obj.get("config") if obj else None
    data = config.get("student_data") if isinstance(config, dict) else None
    return data if isinstance(data, dict) else None


def run_settings(weights: str) -> Dict[str, Any]:
    """``model``, ``num_classes`` and ``config`` (the run's RunConfig as a dict) of a kd checkpoint;
    an empty dict for any other weights. Reading problems are left to :func:`kd.models.build`."""
    obj = kd_checkpoint(weights)
    if obj is None or not isinstance(obj.get("student"), dict):
        return {}
    stored = obj.get("config")
    config: Dict[str, Any] = stored if isinstance(stored, dict) else {}
    return {
        "model": obj.get("student_name") or config.get("student"),
        "num_classes": obj.get("num_classes") or config.get("num_classes"),
        "config": config,
    }


def run_classes(weights: Optional[str]) -> Optional[List[str]]:
    """The class names a kd checkpoint's run trained on (its folders' names, in label order), or
    None for any other weights."""
    obj = kd_checkpoint(weights) if weights else None
    classes = obj.get("classes") if obj else None
    return [str(c) for c in classes] if isinstance(classes, (list, tuple)) and classes else None


def check_classes(kept: Optional[Sequence[str]], found: Sequence[str], what: str, data: Any) -> None:
    """The class names ``found`` in ``data`` must be those ``what`` (a kd checkpoint) was trained on,
    in the same order: other classes would score every label against another class's output."""
    if not kept or list(kept) == list(found):
        return
    missing = [c for c in kept if c not in set(found)]
    extra = [c for c in found if c not in set(kept)]
    parts = [f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''} {how}" for names, how in
             ((missing, "missing"), (extra, "not trained on")) if names]  # fmt: skip
    differ = "; ".join(parts) or "the same names in another order"
    raise KDError(
        f"{data} has other classes than {what} was trained on: {differ} ({len(kept)} trained, {len(found)} here); "
        "give the data it was trained on"
    )


def _size(value: Any) -> Optional[int]:
    return int(value) if value else None
