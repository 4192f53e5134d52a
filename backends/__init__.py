"""Parallel backends, one module each, registered by name (``--backend NAME``)."""
from backends.base import BACKENDS, Backend, register
from backends import single as _single  # noqa: F401


def get(name: str):
    """The backend class registered as ``name`` (KDError listing the valid names on a miss)."""
    return BACKENDS.get(name)


def available():
    """``[(name, reason_or_None)]`` for every registered backend."""
    return [(n, BACKENDS.get(n).unavailable()) for n in BACKENDS.names()]


__all__ = ["BACKENDS", "Backend", "register", "get", "available"]
