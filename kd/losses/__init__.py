"""KD methods, one file each, registered by name (``--kd-loss NAME``).

Every method is listed here by name and imported when first used, so configuration and the
command line know the names without importing torch; its module registers it with
:func:`kd.losses.base.register` as well. A new method is one line below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

from kd.registry import Registry

if TYPE_CHECKING:
    from kd.losses.base import DistillInputs, DistillLoss, register
    from kd.losses.features import split_layers

#: ``--kd-loss NAME``: each method's :class:`kd.losses.base.DistillLoss` subclass
LOSSES: Registry = Registry("KD loss")
LOSSES.register_lazy("at", "kd.losses.at:AttentionTransfer")
LOSSES.register_lazy("ce", "kd.losses.kd:CrossEntropy")
LOSSES.register_lazy("crd", "kd.losses.crd:CRD")
LOSSES.register_lazy("crld", "kd.losses.crld:CrossViewKD")
LOSSES.register_lazy("ctdkd", "kd.losses.ctkd:CurriculumDKD")
LOSSES.register_lazy("ctkd", "kd.losses.ctkd:CurriculumKD")
LOSSES.register_lazy("deit", "kd.losses.deit:DeiTDistillation")
LOSSES.register_lazy("dist", "kd.losses.dist:DIST")
LOSSES.register_lazy("dkd", "kd.losses.dkd:DecoupledKD")
LOSSES.register_lazy("fitnet", "kd.losses.fitnet:FitNet")
LOSSES.register_lazy("kd", "kd.losses.kd:HintonKD")
LOSSES.register_lazy("lskd", "kd.losses.lskd:LogitStandardizationKD")
LOSSES.register_lazy("luminet", "kd.losses.luminet:LumiNet")
LOSSES.register_lazy("mlkd", "kd.losses.mlkd:MultiLevelKD")
LOSSES.register_lazy("nkd", "kd.losses.nkd:NormalizedKD")
LOSSES.register_lazy("ofd", "kd.losses.ofd:OverhaulDistillation")
LOSSES.register_lazy("reviewkd", "kd.losses.reviewkd:ReviewKD")
LOSSES.register_lazy("ttm", "kd.losses.ttm:TransformedTeacherMatching")
LOSSES.register_lazy("wttm", "kd.losses.ttm:WeightedTTM")
LOSSES.register_lazy("sddkd", "kd.losses.sdd:ScaleDecoupledDKD")
LOSSES.register_lazy("sdkd", "kd.losses.sdd:ScaleDecoupledKD")
LOSSES.register_lazy("sdnkd", "kd.losses.sdd:ScaleDecoupledNKD")

__all__ = ["LOSSES", "DistillInputs", "DistillLoss", "build_loss", "register", "split_layers"]

#: what this package gives from its modules that import torch, imported when first asked for
_FROM_MODULES = {
    "DistillInputs": "kd.losses.base",
    "DistillLoss": "kd.losses.base",
    "register": "kd.losses.base",
    "split_layers": "kd.losses.features",
}


def __getattr__(name: str) -> Any:
    if name in _FROM_MODULES:
        import importlib

        return getattr(importlib.import_module(_FROM_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_method(name: str) -> str:
    """``name`` where it is a KD method, else a KDError naming the near names and every method."""
    return LOSSES.check(name)


def build_loss(name: str, num_classes: int, loss_args: Dict[str, Any]) -> DistillLoss:
    """The registered loss ``name`` with hyper-parameters ``loss_args``."""
    return LOSSES.get(name)(num_classes, **loss_args)
