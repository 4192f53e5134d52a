"""Tensors inside the nested containers that models and losses return: dicts, lists, tuples,
named tuples (torchvision's GoogLeNet and Inception in training) and dataclass instances."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], obj):
    """``obj`` with ``fn`` applied to every tensor in it, the containers rebuilt (``obj`` is left as
    it was); anything else is kept as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple takes its fields as arguments
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        )
    return obj


def tensors(obj) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``, in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors(getattr(obj, f.name))
