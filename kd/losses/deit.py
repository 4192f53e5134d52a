"""Touvron et al. 2021, "Training data-efficient image transformers & distillation through attention"
(ICML), https://arxiv.org/abs/2012.12877: the distillation token of DeiT."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from kd.errors import KDError
from kd.losses.base import DistillInputs, DistillLoss
from kd.losses.logits import float32_or_wider


def deit_distillation(
    distill_logits: torch.Tensor, teacher_logits: torch.Tensor, hard: bool, temperature: float
) -> torch.Tensor:
    """DeiT's distillation term on the distillation head's logits, in float32 (float64 stays); no gradient
    to the teacher. ``hard``: cross-entropy on the teacher's top class. Soft: T^2 * KL(p_t || p_s) summed
    and divided by the number of logits (batch x classes), not by the batch, as the official code does
    (``/ outputs_kd.numel()``, "the legacy PyTorch behavior"): 1 / classes of the batch-mean KL of
    :func:`kd.losses.base.kd_divergence`."""
    s = float32_or_wider(distill_logits)
    z = float32_or_wider(teacher_logits.detach())
    if hard:
        return F.cross_entropy(s, z.argmax(dim=1))
    t = temperature
    log_p_s = F.log_softmax(s / t, dim=1)
    log_p_t = F.log_softmax(z / t, dim=1)
    return F.kl_div(log_p_s, log_p_t, reduction="sum", log_target=True) * (t * t) / s.numel()


class DeiTDistillation(DistillLoss):
    """DeiT: ``ce_weight * CE(class head) + kd_weight * distillation term(distillation head)``
    (:func:`deit_distillation`), on a student with a distillation token (timm's ``deit_*_distilled_*``),
    whose train-mode forward kd switches to both heads' logits (:attr:`DistillInputs.distill_logits`);
    evaluated and exported as timm has it, the heads' average.

    facebookresearch/deit ``losses.py`` ``DistillationLoss``: ``(1 - alpha) * base + alpha * distillation``,
    so its ``alpha`` is ``kd_weight`` and ``1 - alpha`` is ``ce_weight``, its ``tau`` is ``temperature``
    (both names accepted); ``hard`` 1 is its ``--distillation-type hard`` (the paper's best), 0 is
    ``soft``. Defaults are its command line's (alpha 0.5, tau 1.0). Its base criterion is mixup's soft
    target cross-entropy or label smoothing; kd's label term is cross-entropy with ``label_smoothing``.
    """

    defaults = {"ce_weight": 0.5, "kd_weight": 0.5, "temperature": 1.0, "hard": 1}
    renamed = {"tau": "temperature"}

    def __init__(self, num_classes: int, **hparams: Any):
        super().__init__(num_classes, **hparams)
        if self.hparams["hard"] not in (0, 1):
            raise KDError(f"KD loss 'deit': hard must be 1 (hard) or 0 (soft), got {self.hparams['hard']!r}")

    @classmethod
    def translate_old(cls, old: str, value: Any) -> Optional[Dict[str, Any]]:
        if old != "alpha":
            return super().translate_old(old, value)
        if not 0.0 <= float(value) <= 1.0:  # DeiT's weight of the distillation term, the label term got the rest
            raise KDError(f"KD loss 'deit': alpha must be between 0 and 1, got {value}")
        return {"ce_weight": 1.0 - float(value), "kd_weight": float(value)}

    def distill(self, x: DistillInputs):
        assert x.teacher_logits is not None  # a method that needs_teacher always gets its logits
        assert x.distill_logits is not None  # the run switched the student to both heads (reads_distill_head)
        h = self.hparams
        kd = deit_distillation(x.distill_logits, x.teacher_logits, bool(h["hard"]), h["temperature"])
        return h["kd_weight"] * kd, {"kd": kd}
