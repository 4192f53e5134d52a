"""The protocol every KD method implements.

A method is a pure function on tensors (easy to test against the paper's formula)
plus a thin :class:`DistillLoss` module registered by name with :func:`register`.
Loss modules see tensors only: logits, features, labels; never models or backends.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional

import torch
from torch import nn

from kd.errors import KDError
from kd.registry import Registry

LOSSES: Registry = Registry("KD loss")
register = LOSSES.register


@dataclass
class DistillInputs:
    """What a loss sees for one batch.

    ``teacher_logits`` is float32 (or None with ``--no-teacher``): the teacher may run in
    reduced precision, but its logits are cast up before the softmax of the KD term.
    ``student_feats`` / ``teacher_feats`` map a layer name to that module's output, for the
    methods with ``uses_features``. ``progress`` is the training progress in epochs
    (fractional), for warm-ups such as DKD's.
    """

    student_logits: torch.Tensor
    labels: torch.Tensor
    teacher_logits: Optional[torch.Tensor] = None
    student_feats: Dict[str, torch.Tensor] = field(default_factory=dict)
    teacher_feats: Dict[str, torch.Tensor] = field(default_factory=dict)
    progress: float = 0.0


class DistillLoss(nn.Module):
    """Base class of the registered KD methods.

    Subclasses set ``defaults`` (their hyper-parameters and default values; the config's
    ``loss_args`` override them, unknown keys are an error) and implement :meth:`forward`,
    returning a dict whose ``"loss"`` entry is the weighted total that is back-propagated;
    the other entries (``"ce"``, ``"kd"``, ...) are logged as they are.

    Methods on intermediate features set ``uses_features = True``; the engine then taps the
    modules named by ``--feature-layers`` (or :meth:`default_layers`) with forward hooks and
    calls :meth:`setup_features` once with the feature shapes, before the optimizer is
    built, so connectors created there are trained, checkpointed and all-reduced with the
    student. Their parameters belong to the student side and are dropped on export.
    """

    defaults: ClassVar[Dict[str, Any]] = {}
    uses_features: ClassVar[bool] = False
    needs_teacher: ClassVar[bool] = True
    name: ClassVar[str] = ""

    def __init__(self, num_classes: int, **hparams: Any):
        super().__init__()
        self.num_classes = num_classes
        unknown = sorted(set(hparams) - set(self.defaults))
        if unknown:
            valid = ", ".join(sorted(self.defaults)) or "none"
            raise KDError(
                f"KD loss {self.name!r} has no hyper-parameter {', '.join(unknown)}; valid: {valid}"
            )
        self.hparams: Dict[str, Any] = {**self.defaults, **hparams}

    @classmethod
    def default_layers(cls, student_layers: List[str], teacher_layers: List[str]) -> List[str]:
        """Layer names to tap when the user names none (feature methods override this)."""
        return []

    def setup_features(self, student_shapes: Dict[str, torch.Size], teacher_shapes: Dict[str, torch.Size]) -> None:
        """Create connectors once the feature shapes are known (feature methods override this)."""

    def forward(self, x: DistillInputs) -> Dict[str, torch.Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError


def build_loss(name: str, num_classes: int, loss_args: Dict[str, Any]) -> DistillLoss:
    """The registered loss ``name`` with hyper-parameters ``loss_args``."""
    import kd.losses  # noqa: F401  (registers the built-in methods)

    cls = LOSSES.get(name)
    return cls(num_classes, **loss_args)
