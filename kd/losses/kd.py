"""Hinton et al. 2015, "Distilling the Knowledge in a Neural Network", and plain cross-entropy."""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F

from kd.losses.base import DistillInputs, DistillLoss, register


def kd_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * KL(softmax(t/T) || softmax(s/T)), averaged over the batch, in float32; no gradient to t."""
    t = temperature
    log_p_s = F.log_softmax(student_logits.float() / t, dim=1)
    log_p_t = F.log_softmax(teacher_logits.detach().float() / t, dim=1)
    return F.kl_div(log_p_s, log_p_t, reduction="batchmean", log_target=True) * (t * t)


def hinton_loss(student_logits, teacher_logits, labels, alpha: float, temperature: float):
    """alpha * CE(s, y) + (1 - alpha) * T^2 * KL(p_t || p_s); returns (total, ce, kd)."""
    ce = F.cross_entropy(student_logits.float(), labels)
    kd = kd_divergence(student_logits, teacher_logits, temperature)
    return alpha * ce + (1.0 - alpha) * kd, ce, kd


@register("kd")
class HintonKD(DistillLoss):
    """Soft-target KD: ``alpha`` weighs the label term, ``temperature`` softens both sides."""

    defaults = {"alpha": 0.5, "temperature": 4.0}

    def forward(self, x: DistillInputs) -> Dict[str, torch.Tensor]:
        total, ce, kd = hinton_loss(
            x.student_logits, x.teacher_logits, x.labels, self.hparams["alpha"], self.hparams["temperature"]
        )
        return {"loss": total, "ce": ce, "kd": kd}


@register("ce")
class CrossEntropy(DistillLoss):
    """The student alone on the labels (``--no-teacher``): baselines and teacher training."""

    needs_teacher = False
    defaults = {"label_smoothing": 0.0}

    def forward(self, x: DistillInputs) -> Dict[str, torch.Tensor]:
        ce = F.cross_entropy(x.student_logits.float(), x.labels, label_smoothing=self.hparams["label_smoothing"])
        return {"loss": ce, "ce": ce}
