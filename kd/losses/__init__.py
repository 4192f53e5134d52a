"""KD methods, one file each, registered by name (``--kd-loss NAME``)."""
from kd.losses.base import LOSSES, DistillInputs, DistillLoss, build_loss, register
from kd.losses.features import split_layers
from kd.losses import at as _at  # noqa: F401
from kd.losses import dist as _dist  # noqa: F401
from kd.losses import dkd as _dkd  # noqa: F401
from kd.losses import fitnet as _fitnet  # noqa: F401
from kd.losses import kd as _kd  # noqa: F401
from kd.losses import lskd as _lskd  # noqa: F401

__all__ = ["LOSSES", "DistillInputs", "DistillLoss", "build_loss", "register", "split_layers"]
