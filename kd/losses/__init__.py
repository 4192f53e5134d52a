"""KD methods, one file each, registered by name (``--kd-loss NAME``)."""

from typing import Any, Dict

from kd.losses import at as _at  # noqa: F401  (each method registers itself)
from kd.losses import crd as _crd  # noqa: F401
from kd.losses import ctkd as _ctkd  # noqa: F401
from kd.losses import dist as _dist  # noqa: F401
from kd.losses import dkd as _dkd  # noqa: F401
from kd.losses import fitnet as _fitnet  # noqa: F401
from kd.losses import kd as _kd  # noqa: F401
from kd.losses import lskd as _lskd  # noqa: F401
from kd.losses import mlkd as _mlkd  # noqa: F401
from kd.losses import nkd as _nkd  # noqa: F401
from kd.losses import ofd as _ofd  # noqa: F401
from kd.losses import reviewkd as _reviewkd  # noqa: F401
from kd.losses.base import LOSSES, DistillInputs, DistillLoss, register
from kd.losses.features import split_layers

__all__ = ["LOSSES", "DistillInputs", "DistillLoss", "build_loss", "register", "split_layers"]


def build_loss(name: str, num_classes: int, loss_args: Dict[str, Any]) -> DistillLoss:
    """The registered loss ``name`` with hyper-parameters ``loss_args``."""
    return LOSSES.get(name)(num_classes, **loss_args)
