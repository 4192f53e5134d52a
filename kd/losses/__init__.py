"""KD methods, one file each, registered by name (``--kd-loss NAME``) with what each is (its card).

Every method is one line below: its name, its class (imported when first used) and its
:class:`~kd.losses.card.MethodCard`, so configuration, the command line and the papers' tables know
the methods without importing torch. The lines are in the order of the rows of the papers' tables:
a new method's line goes where its row goes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

from kd.losses.card import MethodCard, Methods

if TYPE_CHECKING:
    from kd.losses.base import DistillInputs, DistillLoss
    from kd.losses.features import split_layers

#: ``--kd-loss NAME``: each method's :class:`kd.losses.base.DistillLoss` subclass and its card
LOSSES: Methods = Methods()
LOSSES.add("ce", "kd.losses.kd:CrossEntropy", MethodCard("CE", needs_teacher=False))
LOSSES.add("kd", "kd.losses.kd:HintonKD", MethodCard("KD"))
LOSSES.add("at", "kd.losses.at:AttentionTransfer", MethodCard("AT", uses_features=True))
LOSSES.add("fitnet", "kd.losses.fitnet:FitNet", MethodCard("FitNet", uses_features=True))
LOSSES.add(
    "ofd",
    "kd.losses.ofd:OverhaulDistillation",
    MethodCard("OFD", uses_features=True, tap_point="pre_relu", reads_teacher_norms=True),
)
LOSSES.add(
    "crd",
    "kd.losses.crd:CRD",
    MethodCard("CRD", uses_features=True, uses_pooled=True, uses_samples=True, reads_step=True),
)
LOSSES.add(
    "reviewkd",
    "kd.losses.reviewkd:ReviewKD",
    MethodCard("ReviewKD", uses_features=True, tap_point="pre_relu", uses_pooled=True, reads_progress=True),
)
LOSSES.add("dkd", "kd.losses.dkd:DecoupledKD", MethodCard("DKD", class_labels=True, reads_progress=True))
LOSSES.add("dist", "kd.losses.dist:DIST", MethodCard("DIST"))
LOSSES.add("nkd", "kd.losses.nkd:NormalizedKD", MethodCard("NKD", class_labels=True, class_of_mixed=True))
LOSSES.add("ctkd", "kd.losses.ctkd:CurriculumKD", MethodCard("KD + CTKD", reads_progress=True))
LOSSES.add("ctdkd", "kd.losses.ctkd:CurriculumDKD", MethodCard("DKD + CTKD", class_labels=True, reads_progress=True))
LOSSES.add("mlkd", "kd.losses.mlkd:MultiLevelKD", MethodCard("MLKD", views=2))
LOSSES.add("lskd", "kd.losses.lskd:LogitStandardizationKD", MethodCard("KD + LS"))
LOSSES.add("ttm", "kd.losses.ttm:TransformedTeacherMatching", MethodCard("TTM"))
LOSSES.add("wttm", "kd.losses.ttm:WeightedTTM", MethodCard("WTTM"))
LOSSES.add("luminet", "kd.losses.luminet:LumiNet", MethodCard("LumiNet", reads_progress=True))
LOSSES.add("crld", "kd.losses.crld:CrossViewKD", MethodCard("CRLD", views=2))
LOSSES.add(
    "sdkd",
    "kd.losses.sdd:ScaleDecoupledKD",
    MethodCard("SD-KD", uses_features=True, uses_classifier=True, class_labels=True),
)
LOSSES.add(
    "sddkd",
    "kd.losses.sdd:ScaleDecoupledDKD",
    MethodCard("SD-DKD", uses_features=True, uses_classifier=True, class_labels=True, reads_progress=True),
)
LOSSES.add(
    "sdnkd",
    "kd.losses.sdd:ScaleDecoupledNKD",
    MethodCard("SD-NKD", uses_features=True, uses_classifier=True, class_labels=True),
)
LOSSES.add("deit", "kd.losses.deit:DeiTDistillation", MethodCard("DeiT", reads_distill_head=True))

__all__ = ["LOSSES", "DistillInputs", "DistillLoss", "MethodCard", "build_loss", "card", "split_layers"]

#: what this package gives from its modules that import torch, imported when first asked for
_FROM_MODULES = {
    "DistillInputs": "kd.losses.base",
    "DistillLoss": "kd.losses.base",
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


def card(name: str) -> MethodCard:
    """What the method ``name`` is (:class:`MethodCard`), without importing it; a KDError naming the near
    names where there is none."""
    return LOSSES.card(name)


def build_loss(name: str, num_classes: int, loss_args: Dict[str, Any]) -> DistillLoss:
    """The registered loss ``name`` with hyper-parameters ``loss_args``."""
    return LOSSES.get(name)(num_classes, **loss_args)
