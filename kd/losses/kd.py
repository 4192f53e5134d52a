"""Hinton et al. 2015, "Distilling the Knowledge in a Neural Network", and plain cross-entropy."""

from __future__ import annotations

from typing import Any, Dict, Optional

from kd.errors import KDError
from kd.losses.base import DistillInputs, DistillLoss, kd_divergence, register


@register("kd")
class HintonKD(DistillLoss):
    """Soft-target KD: ``ce_weight * CE + kd_weight * T^2 * KL(p_t || p_s)`` at ``temperature``.

    The defaults 0.5 / 0.5 are Hinton's even split (``alpha`` 0.5 in the usual
    ``alpha * CE + (1 - alpha) * KD``). The former ``alpha`` is accepted as
    ``ce_weight = alpha, kd_weight = 1 - alpha``.
    """

    defaults = {"ce_weight": 0.5, "kd_weight": 0.5, "temperature": 4.0}

    @classmethod
    def translate_old(cls, old: str, value: Any) -> Optional[Dict[str, Any]]:
        if old != "alpha":
            return super().translate_old(old, value)
        if not 0.0 <= float(value) <= 1.0:  # the weight of the label term, the KD term got the rest
            raise KDError(f"--alpha must be between 0 and 1, got {value}")
        return {"ce_weight": float(value), "kd_weight": 1.0 - float(value)}

    def distill(self, x: DistillInputs):
        assert x.teacher_logits is not None  # a method that needs_teacher always gets its logits
        kd = kd_divergence(x.student_logits, x.teacher_logits, self.hparams["temperature"])
        return self.hparams["kd_weight"] * kd, {"kd": kd}


@register("ce")
class CrossEntropy(DistillLoss):
    """The student alone on the labels (``--no-teacher``): baselines and teacher training."""

    needs_teacher = False

    def distill(self, x: DistillInputs):
        return None, {}
