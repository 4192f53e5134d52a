"""Parallel backends, one module each, registered by name (``--backend NAME``)."""

from backends import apex_ddp as _apex_ddp  # noqa: F401  (each backend registers itself)
from backends import dp as _dp  # noqa: F401
from backends import single as _single  # noqa: F401
from backends import torch_ddp as _torch_ddp  # noqa: F401
from backends.base import BACKENDS, Backend, register

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
