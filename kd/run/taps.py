"""Feature taps: intermediate outputs through forward hooks, without changing model code.

Hooks are registered for the duration of one forward call on the module that runs it.
DataParallel replicas copy each module's ``__dict__`` shallowly, so they share its hook dict: a
replica's hook fires for every replica's module, and keeps the output of its own module only.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List

import torch
from torch import nn

from kd.errors import KDError


def layer_names(model: nn.Module) -> List[str]:
    return [name for name, _ in model.named_modules() if name]


def check_layers(model: nn.Module, layers: List[str], role: str) -> None:
    names = set(layer_names(model))
    missing = [layer for layer in layers if layer not in names]
    if missing:
        tops = [n for n in layer_names(model) if "." not in n]
        raise KDError(f"{role} has no module {missing[0]!r} for --feature-layers; top-level modules: {', '.join(tops)}")


@contextlib.contextmanager
def tap(model: nn.Module, layers: List[str], store: Dict[str, torch.Tensor]):
    """Within the block, the outputs of ``model``'s submodules ``layers`` land in ``store``."""
    if not layers:
        yield store
        return
    modules = dict(model.named_modules())
    handles = []
    for layer in layers:

        def hook(module, _inputs, output, layer=layer, mine=modules[layer]):
            if module is mine:
                store[layer] = output

        handles.append(modules[layer].register_forward_hook(hook))
    try:
        yield store
    finally:
        for handle in handles:
            handle.remove()
