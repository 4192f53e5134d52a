"""Zhao et al. 2022, "Decoupled Knowledge Distillation" (CVPR), https://arxiv.org/abs/2203.08679."""

from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn.functional as F

from kd.errors import KDError
from kd.losses.base import DistillInputs, DistillLoss, register

# Subtracted from the target-class logit so that it drops out of the non-target softmax
# (the value of the official implementation).
NON_TARGET_MASK = 1000.0


def dkd_parts(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, temperature: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(TCKD, NCKD), each T^2-scaled and averaged over the batch, in float32.

    TCKD is the KL divergence between the binary (target, all non-targets) distributions
    of teacher and student; NCKD the KL divergence between their distributions over the
    non-target classes only.
    """
    t = temperature
    s = student_logits.float() / t
    z = teacher_logits.detach().float() / t
    batch = s.shape[0]
    if labels.dim() != 1:
        raise KDError("KD loss 'dkd' needs class-index labels; soft labels (mixup, cutmix) have no target class")
    gt = torch.zeros_like(s, dtype=torch.bool).scatter_(1, labels.reshape(-1, 1), True)

    p_t = z.softmax(dim=1)
    p_t_bin = torch.stack([(p_t * gt).sum(1), (p_t * ~gt).sum(1)], dim=1)
    # log of the student's binary probabilities through logsumexp: log(1 - p) would lose
    # every digit once the target probability rounds to 1
    log_p_s = F.log_softmax(s, dim=1)
    log_p_s_bin = torch.stack(
        [log_p_s.masked_fill(~gt, float("-inf")).logsumexp(1), log_p_s.masked_fill(gt, float("-inf")).logsumexp(1)],
        dim=1,
    )
    tckd = F.kl_div(log_p_s_bin, p_t_bin, reduction="sum") * (t * t) / batch

    offset = NON_TARGET_MASK * gt.float()
    nckd = F.kl_div(F.log_softmax(s - offset, dim=1), F.softmax(z - offset, dim=1), reduction="sum") * (t * t) / batch
    return tckd, nckd


@register("dkd")
class DecoupledKD(DistillLoss):
    """DKD: ``ce_weight * CE + min(epoch / warmup, 1) * (tckd_weight * TCKD + nckd_weight * NCKD)``.

    Defaults are the official ImageNet setting (mdistiller ``configs/imagenet/r34_r18/dkd.yaml``:
    CE_WEIGHT 1, BETA 0.5, T 1, WARMUP 1; ALPHA 1 from its defaults); the paper's and
    mdistiller's ``alpha`` / ``beta`` are ``tckd_weight`` / ``nckd_weight`` here. The warm-up is
    mdistiller's (``distillers/DKD.py``): a factor stepped once per epoch, ``epoch`` counted from
    1, so ``warmup`` 1 (ImageNet's) means no ramp at all and ``warmup`` 20 (CIFAR's) gives 1/20 in
    the first epoch; 0 disables it.
    """

    defaults = {"ce_weight": 1.0, "tckd_weight": 1.0, "nckd_weight": 0.5, "temperature": 1.0, "warmup": 1.0}
    renamed = {"alpha": "tckd_weight", "beta": "nckd_weight"}

    def distill(self, x: DistillInputs):
        h = self.hparams
        assert x.teacher_logits is not None  # a method that needs_teacher always gets its logits
        tckd, nckd = dkd_parts(x.student_logits, x.teacher_logits, x.labels, h["temperature"])
        kd = h["tckd_weight"] * tckd + h["nckd_weight"] * nckd
        epoch = math.floor(x.progress) + 1  # 1-based, as mdistiller's trainer passes it
        ramp = min(epoch / h["warmup"], 1.0) if h["warmup"] > 0 else 1.0
        return ramp * kd, {"kd": kd, "tckd": tckd, "nckd": nckd}
