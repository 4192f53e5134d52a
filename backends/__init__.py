"""Parallel backends, one module each, registered by name (``--backend NAME``).

Every backend is listed here by name and imported when first used, so that the command line knows
the names without importing torch (``kd train --help``). A new backend is one line below (a
third-party one registers itself: :func:`backends.base.register`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kd.registry import Registry

if TYPE_CHECKING:
    from backends.base import Backend, register

#: ``--backend NAME``: each backend's :class:`backends.base.Backend` subclass
BACKENDS: Registry = Registry("backend", entry_point_group="kd.backends")
BACKENDS.register_lazy("apex_ddp", "backends.apex_ddp:ApexDDP")
BACKENDS.register_lazy("dp", "backends.dp:DataParallelBackend")
BACKENDS.register_lazy("single", "backends.single:Single")
BACKENDS.register_lazy("torch_ddp", "backends.torch_ddp:TorchDDP")


def __getattr__(name: str) -> Any:
    if name in ("Backend", "register"):  # from the module that imports torch, when first asked for
        import importlib

        return getattr(importlib.import_module("backends.base"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: kd's own ``backends`` (kd.siblings.own checks it: another package of this name has none)
KD_SIBLING = True


def get(name: str):
    """The backend class registered as ``name`` (KDError listing the valid names on a miss)."""
    return BACKENDS.get(name)


def report():
    """``[(name, can_run, note)]`` for every registered backend: why not, or which implementation."""
    rows = []
    for name in BACKENDS.names():
        cls = BACKENDS.get(name)
        reason = cls.unavailable()
        note = reason or cls.description
        implementation = getattr(cls, "implementation", None)
        if reason is None and callable(implementation):
            import torch

            impl = implementation("cuda" if torch.cuda.is_available() else "cpu")
            note = (
                "uses real apex.parallel"
                if impl == "apex"
                else f"uses kd's native implementation ({impl[len('native: ') :]})"
            )
        rows.append((name, reason is None, note))
    return rows


__all__ = ["BACKENDS", "Backend", "register", "get", "report"]
