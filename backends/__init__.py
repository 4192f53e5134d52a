"""Parallel backends, one module each, registered by name (``--backend NAME``)."""

# isort: off
# Registration order is the order ``--backend`` choices and ``kd backends`` list them in.
from backends.base import BACKENDS, Backend, register
from backends import single as _single  # noqa: F401
from backends import dp as _dp  # noqa: F401
from backends import torch_ddp as _torch_ddp  # noqa: F401
from backends import apex_ddp as _apex_ddp  # noqa: F401
# isort: on


def get(name: str):
    """The backend class registered as ``name`` (KDError listing the valid names on a miss)."""
    return BACKENDS.get(name)


def available():
    """``[(name, reason_or_None)]`` for every registered backend."""
    return [(n, BACKENDS.get(n).unavailable()) for n in BACKENDS.names()]


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


__all__ = ["BACKENDS", "Backend", "register", "get", "available", "report"]
