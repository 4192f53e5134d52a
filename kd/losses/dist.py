"""Huang et al. 2022, "Knowledge Distillation from A Stronger Teacher" (DIST, NeurIPS),
https://arxiv.org/abs/2205.10536."""

from __future__ import annotations

from typing import Tuple

import torch

from kd.losses.base import DistillInputs, DistillLoss

EPS = 1e-8  # added to the product of the norms, as in the official code


def pearson_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mean over rows of 1 - Pearson correlation between the rows of ``a`` and ``b``."""
    a = a - a.mean(dim=1, keepdim=True)
    b = b - b.mean(dim=1, keepdim=True)
    corr = (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1) + EPS)
    return 1.0 - corr.mean()


def dist_parts(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inter, intra), each T^2-scaled, on softmax(logits / T) in float32 (T: the paper's tau).

    Inter-class: correlation of each sample's class probabilities (rows); intra-class: of
    each class's probabilities across the batch (columns).
    """
    p_s = (student_logits.float() / temperature).softmax(dim=1)
    p_t = (teacher_logits.detach().float() / temperature).softmax(dim=1)
    scale = temperature * temperature
    return scale * pearson_distance(p_s, p_t), scale * pearson_distance(p_s.t(), p_t.t())


class DIST(DistillLoss):
    """DIST: ``ce_weight * CE + kd_weight * (inter_weight * inter + intra_weight * intra)``.

    Defaults are the official ImageNet recipe (hunto/image_classification_sota,
    ``configs/strategies/distill/resnet_dist.yaml``: ``DIST(beta=1, gamma=1, tau=1)``,
    ``ori_loss_weight`` 1, ``kd_loss_weight`` 2); its ``beta`` / ``gamma`` / ``tau`` are
    ``inter_weight`` / ``intra_weight`` / ``temperature`` here. The intra-class term correlates columns
    over the batch, so it depends on the per-process batch size (the official code also
    computes it per GPU).
    """

    defaults = {"ce_weight": 1.0, "kd_weight": 2.0, "inter_weight": 1.0, "intra_weight": 1.0, "temperature": 1.0}
    renamed = {"beta": "inter_weight", "gamma": "intra_weight", "tau": "temperature"}

    def distill(self, x: DistillInputs):
        h = self.hparams
        assert x.teacher_logits is not None  # a method that needs_teacher always gets its logits
        inter, intra = dist_parts(x.student_logits, x.teacher_logits, h["temperature"])
        kd = h["inter_weight"] * inter + h["intra_weight"] * intra
        return h["kd_weight"] * kd, {"kd": kd, "inter": inter, "intra": intra}
