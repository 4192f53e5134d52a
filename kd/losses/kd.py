"""Hinton et al. 2015, "Distilling the Knowledge in a Neural Network", and plain cross-entropy."""

from __future__ import annotations

from typing import Any, Dict, Optional

from kd.errors import KDError
from kd.losses.base import DistillInputs, DistillLoss, kd_divergence
from kd.losses.logits import standardise_switch, standardised


class HintonKD(DistillLoss):
    """Soft-target KD: ``ce_weight * CE + kd_weight * T^2 * KL(p_t || p_s)`` at ``temperature``.

    The defaults 0.5 / 0.5 are Hinton's even split (``alpha`` 0.5 in the usual
    ``alpha * CE + (1 - alpha) * KD``). The former ``alpha`` is accepted as
    ``ce_weight = alpha, kd_weight = 1 - alpha``. ``standardise`` 1 z-scores both logit vectors
    first (:func:`kd.losses.logits.standardise`): the official logit-standardisation KD (sunshangquan/
    logit-standardization-KD ``mdistiller/distillers/KD.py``), which its authors run at
    ``temperature`` 2 and ``kd_weight`` 9 (``--base-temp 2 --kd-weight 9``); ``lskd`` is that method
    with those defaults.
    """

    defaults = {"ce_weight": 0.5, "kd_weight": 0.5, "temperature": 4.0, "standardise": 0}

    def __init__(self, num_classes: int, **hparams: Any):
        super().__init__(num_classes, **hparams)
        self.standardise = standardise_switch(self.name, self.hparams["standardise"])

    @classmethod
    def translate_old(cls, old: str, value: Any) -> Optional[Dict[str, Any]]:
        if old != "alpha":
            return super().translate_old(old, value)
        if not 0.0 <= float(value) <= 1.0:  # the weight of the label term, the KD term got the rest
            raise KDError(f"--alpha must be between 0 and 1, got {value}")
        return {"ce_weight": float(value), "kd_weight": 1.0 - float(value)}

    def distill(self, x: DistillInputs):
        assert x.teacher_logits is not None  # a method that needs_teacher always gets its logits
        student, teacher = standardised(x.student_logits, x.teacher_logits, self.standardise)
        kd = kd_divergence(student, teacher, self.hparams["temperature"])
        return self.hparams["kd_weight"] * kd, {"kd": kd}


class CrossEntropy(DistillLoss):
    """The student alone on the labels (``--no-teacher``): baselines and teacher training."""

    def distill(self, x: DistillInputs):
        return None, {}
