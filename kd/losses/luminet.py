"""Hossain et al., "LumiNet: Perception-Driven Knowledge Distillation via Statistical Logit Calibration"
(TMLR 2025; arXiv 2310.03669, 2023), https://openreview.net/forum?id=3rU1lp9w2l: KD on logits
standardised per class over the batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kd.losses.base import DistillInputs, DistillLoss
from kd.losses.logits import float32_or_wider, warmup_ramp


def per_class_standardise(logits: torch.Tensor, eps: float) -> torch.Tensor:
    """Each class's logits z-scored over the batch (LumiNet's "perception"): (z - mean) / sqrt(var + eps)
    with the mean and the biased variance of each column, in float32 (float64 stays)."""
    z = float32_or_wider(logits)
    return (z - z.mean(dim=0, keepdim=True)) / torch.sqrt(z.var(dim=0, unbiased=False, keepdim=True) + eps)


def luminet_divergence(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float, eps: float
) -> torch.Tensor:
    """KL(softmax(P(t)/T) || softmax(P(s)/T)), averaged over the batch, with P
    :func:`per_class_standardise` over this batch; no T^2, no gradient to the teacher."""
    log_p_s = F.log_softmax(per_class_standardise(student_logits, eps) / temperature, dim=1)
    log_p_t = F.log_softmax(per_class_standardise(teacher_logits.detach(), eps) / temperature, dim=1)
    return F.kl_div(log_p_s, log_p_t, reduction="batchmean", log_target=True)


class LumiNet(DistillLoss):
    """LumiNet: ``ce_weight * CE + min(epoch / warmup, 1) * kd_weight * KL`` on per-class standardised
    logits (:func:`luminet_divergence`).

    Defaults are the official ImageNet setting (ismail31416/LumiNet ``configs/imagenet/r34_r18/luminet.yaml``
    and ``r50_mv1/luminet.yaml``: ``CE_WEIGHT`` 1, ``ALPHA`` 2, ``T`` 0.7, ``WARMUP`` 1; ``eps`` 1e-5 of
    ``perception``). The official loss is scaled by ``ALPHA ** 2``: ``kd_weight`` 4 here. The statistics are
    over the batch each process sees, as each official DataParallel replica takes them over its share.
    """

    defaults = {"ce_weight": 1.0, "kd_weight": 4.0, "temperature": 0.7, "eps": 1e-5, "warmup": 1.0}

    def distill(self, x: DistillInputs):
        h = self.hparams
        assert x.teacher_logits is not None  # a method that needs_teacher always gets its logits
        kd = luminet_divergence(x.student_logits, x.teacher_logits, h["temperature"], h["eps"])
        return warmup_ramp(x.progress, h["warmup"]) * h["kd_weight"] * kd, {"kd": kd}
