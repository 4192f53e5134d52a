"""KD methods, one file each, registered by name (``--kd-loss NAME``)."""
from kd.losses.base import LOSSES, DistillInputs, DistillLoss, build_loss, register
from kd.losses import kd as _kd  # noqa: F401

__all__ = ["LOSSES", "DistillInputs", "DistillLoss", "build_loss", "register"]
