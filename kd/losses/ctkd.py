"""Li et al. 2023, "Curriculum Temperature for Knowledge Distillation" (AAAI),
https://arxiv.org/abs/2211.16231: a learned temperature that maximises the distillation loss."""

from __future__ import annotations

import math
from typing import Any, Dict, Tuple

import torch
from torch import nn

from kd.losses.base import DistillInputs, DistillLoss, kd_divergence
from kd.losses.logits import dkd_parts, standardise_switch, standardised

# The temperature's range and curriculum, with the official defaults (zhengli97/CTKD@7d52522:
# --t_start 1 --t_end 20, --decay_max 0 --decay_min -1 --decay_loops 5 of its ImageNet script).
CURRICULUM: Dict[str, Any] = {
    "min_temperature": 1.0,
    "max_temperature": 21.0,
    "reversal_weight": 1.0,
    "reversal_epochs": 5.0,
    "standardise": 0,
}


def reverse_gradient(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` in the forward pass; in the backward pass its gradient times ``scale`` (a gradient
    reversal layer, Ganin & Lempitsky 2015, where ``scale`` is negative)."""
    return x.detach() + scale * (x - x.detach())


def reversal_scale(epoch: int, epochs: float, weight: float) -> float:
    """CTKD's lambda at ``epoch`` (counted from 1, as the official trainer passes it): a cosine from 0
    at epoch 0 to ``-weight`` at ``epochs`` and after (official ``CosineDecay(0, -weight, epochs)``);
    ``epochs`` 0: ``-weight`` from the start."""
    if epochs <= 0:
        return -weight
    i = min(max(epoch, 0), epochs)
    return (math.cos(i * math.pi / epochs) + 1.0) * 0.5 * weight - weight


class CurriculumTemperature(DistillLoss):
    """Base of ``ctkd`` and ``ctdkd``: the learned global temperature and its curriculum.

    ``T = min_temperature + (max_temperature - min_temperature) * sigmoid(theta)``, with ``theta`` a
    parameter of the loss (initial value 1, as the official ``Global_T``; T 15.62 with the defaults)
    trained with the student. Its gradient passes a reversal layer whose factor lambda follows
    :func:`reversal_scale` over ``reversal_epochs`` (fixed within an epoch): the temperature
    ascends the distillation loss while the student descends it. The official ``--t_start`` /
    ``--t_end`` are ``min_temperature`` / ``max_temperature - min_temperature``; ``--decay_min -w
    --decay_max 0 --decay_loops n`` are ``reversal_weight`` w and ``reversal_epochs`` n.
    ``standardise`` 1 z-scores both logit vectors first (see ``kd``). The temperature and lambda
    are logged as ``temperature`` and ``lambda``.
    """

    def __init__(self, num_classes: int, **hparams: Any):
        super().__init__(num_classes, **hparams)
        self.standardise = standardise_switch(self.name, self.hparams["standardise"])
        self.theta = nn.Parameter(torch.ones(1))

    def temperature(self, progress: float) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """(T as a 0-dim tensor, the logged ``temperature`` and ``lambda``) at ``progress`` (epochs)."""
        h = self.hparams
        scale = reversal_scale(math.floor(progress) + 1, h["reversal_epochs"], h["reversal_weight"])
        low, high = h["min_temperature"], h["max_temperature"]
        t = low + (high - low) * torch.sigmoid(reverse_gradient(self.theta.reshape(()), scale))
        return t, {"temperature": t.detach(), "lambda": torch.full((), scale, device=t.device)}

    def logits(self, x: DistillInputs) -> Tuple[torch.Tensor, torch.Tensor]:
        """The student's and the teacher's logits, z-scored where ``standardise``."""
        assert x.teacher_logits is not None  # a method that needs_teacher always gets its logits
        return standardised(x.student_logits, x.teacher_logits, self.standardise)


class CurriculumKD(CurriculumTemperature):
    """CTKD on KD: ``ce_weight * CE + kd_weight * T^2 * KL(p_t || p_s)`` at the learned T.

    Defaults are the official ImageNet script's (zhengli97/CTKD ``scripts/run_imagenet_distill.sh``:
    ``-r 1 -a 1 -b 0``; ``--kd_T`` is unused once the temperature is learned). With ``standardise`` 1
    it is the logit-standardisation authors' CTKD (their ``CTKD/`` copy runs ``DistillKL_logit_stand``
    at the learned T, ``-a 2`` on ImageNet).
    """

    defaults = {"ce_weight": 1.0, "kd_weight": 1.0, **CURRICULUM}

    def distill(self, x: DistillInputs):
        t, terms = self.temperature(x.progress)
        kd = kd_divergence(*self.logits(x), t)
        return self.hparams["kd_weight"] * kd, {"kd": kd, **terms}


class CurriculumDKD(CurriculumTemperature):
    """CTKD on DKD: ``ce_weight * CE + tckd_weight * TCKD + nckd_weight * NCKD`` at the learned T.

    As the official code runs DKD (``-a 0 -b 1 --dkd_alpha A --dkd_beta B``: no KD term, no warm-up);
    ``nckd_weight`` 1 is its ImageNet script's DKD line (``--dkd_beta 1``; 2 on CIFAR). TCKD and NCKD
    are ``dkd``'s, whose teacher side is in log space: the temperature's gradient is finite where the
    official code's is NaN on current torch (the teacher's non-target distribution is exactly 0 at the
    target class, and torch's kl_div now differentiates its target through 0 * log 0; the torch 1.11 it
    was written for set that gradient to 0, as kd does).
    """

    defaults = {"ce_weight": 1.0, "tckd_weight": 1.0, "nckd_weight": 1.0, **CURRICULUM}

    def distill(self, x: DistillInputs):
        h = self.hparams
        t, terms = self.temperature(x.progress)
        student, teacher = self.logits(x)
        tckd, nckd = dkd_parts(student, teacher, x.labels, t)
        kd = h["tckd_weight"] * tckd + h["nckd_weight"] * nckd
        return kd, {"kd": kd, "tckd": tckd, "nckd": nckd, **terms}
