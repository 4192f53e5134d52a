"""Models by name (torchvision, or ``timm:NAME``) and weight loading from local files."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from kd import checkpoint
from kd.errors import KDError
from kd.registry import suggest

TIMM_PREFIX = "timm:"


@functools.lru_cache(maxsize=1)
def torchvision_names() -> List[str]:
    import torchvision.models as tvm

    return sorted(tvm.list_models(module=tvm))


def timm_names() -> List[str]:
    import timm

    return timm.list_models()


def check_name(name: str) -> None:
    """Raise a KDError with close matches if ``name`` is no known model."""
    if name.startswith(TIMM_PREFIX):
        arch = name[len(TIMM_PREFIX) :]
        names = timm_names()
        if arch not in names:
            raise KDError(f"unknown timm model {arch!r}{suggest(arch, names)}")
        return
    names = torchvision_names()
    if name not in names:
        hint = suggest(name, names)
        if not hint and name in timm_names():
            hint = f" (timm has it: use timm:{name})"
        raise KDError(f"unknown torchvision model {name!r}{hint}; use a torchvision classification model or timm:NAME")


def _pretrained_state(name: str) -> Dict[str, torch.Tensor]:
    """The library's own pretrained weights, from the local cache or downloaded."""
    try:
        if name.startswith(TIMM_PREFIX):
            import timm

            return timm.create_model(name[len(TIMM_PREFIX) :], pretrained=True).state_dict()
        import torchvision.models as tvm

        weights = tvm.get_model_weights(name).DEFAULT
        return weights.get_state_dict(progress=False)
    except KDError:
        raise
    except Exception as exc:  # network errors come in many types (URLError, HF hub errors, ...)
        raise KDError(
            f"cannot get pretrained weights for {name} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else 'no detail'}); "
            f"offline? pass a local file with --teacher-weights PATH (or --student-weights PATH)"
        ) from None


def build(name: str, num_classes: int, weights: str = "none") -> nn.Module:
    """Model ``name`` with ``num_classes`` outputs and ``weights`` = none | pretrained | PATH."""
    check_name(name)
    state = None
    if weights == "pretrained":
        state = _pretrained_state(name)
        head = classifier_outputs(state)
        if head is not None and head != num_classes:
            raise KDError(
                f"pretrained {name} has {head} classes but the data has {num_classes}; "
                f"train or fine-tune a teacher for this data and pass it with --teacher-weights PATH"
            )
    elif weights not in ("none", None):
        state = load_state_file(weights)
    if name.startswith(TIMM_PREFIX):
        import timm

        model = timm.create_model(name[len(TIMM_PREFIX) :], pretrained=False, num_classes=num_classes)
    else:
        import torchvision.models as tvm

        kwargs: Dict[str, Any] = {"num_classes": num_classes}
        if name.startswith(("inception", "googlenet")):
            kwargs["aux_logits"] = False
            kwargs["init_weights"] = False
        model = tvm.get_model(name, weights=None, **kwargs)
    if state is not None:
        load_into(model, state, name, weights)
    return model


def classifier_outputs(state: Dict[str, torch.Tensor]) -> Optional[int]:
    """Number of classes of the last 2-D weight in a state dict (the classifier head)."""
    last = None
    for key, value in state.items():
        if key.endswith("weight") and getattr(value, "ndim", 0) == 2:
            last = value
    return None if last is None else int(last.shape[0])


def load_state_file(path: str) -> Dict[str, torch.Tensor]:
    """A state dict from a file: plain, wrapped (``state_dict``/``model``/...), or a kd checkpoint.

    Loaded with ``weights_only=True``: a file that needs arbitrary code to unpickle is refused.
    """
    p = Path(path)
    if not p.is_file():
        raise KDError(f"weights file {path} does not exist (expected pretrained, none or a file path)")
    return extract_state(checkpoint.read(p, "cannot read weights file"), path)


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


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode and no gradients: the teacher is never trained."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
