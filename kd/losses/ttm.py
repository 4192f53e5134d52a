"""Zheng & Yang 2024, "Knowledge Distillation Based on Transformed Teacher Matching" (ICLR),
https://arxiv.org/abs/2402.11148: the student, at temperature 1, matches the teacher's power-transformed
distribution; WTTM weights each sample by how flat that distribution is."""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from kd.losses.base import DistillInputs, DistillLoss
from kd.losses.logits import float32_or_wider


def ttm_parts(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, gamma: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(each sample's KL(q_t || p_s), each sample's weight sum_i p_t[i]^gamma), in float32 (float64 stays).

    ``q_t`` is the teacher's distribution raised to ``gamma`` and renormalised (softmax of gamma times
    the teacher's log-probabilities: its softmax at temperature 1 / gamma); ``p_s`` the student's softmax
    at temperature 1. Both in log space, so a teacher probability that rounds to 0 gives no NaN. No
    gradient to the teacher.
    """
    log_p_s = F.log_softmax(float32_or_wider(student_logits), dim=1)
    powered = gamma * F.log_softmax(float32_or_wider(teacher_logits.detach()), dim=1)
    log_q_t = F.log_softmax(powered, dim=1)
    per_sample = F.kl_div(log_p_s, log_q_t, reduction="none", log_target=True).sum(dim=1)
    return per_sample, powered.logsumexp(dim=1).exp()


class TransformedTeacherMatching(DistillLoss):
    """TTM: ``ce_weight * CE + kd_weight * mean KL(q_t || p_s)`` (:func:`ttm_parts`), no T^2.

    ``gamma`` is the official ``--ttm_l`` (the paper's gamma, 1 / T), ``kd_weight`` its ``-b`` and
    ``ce_weight`` its ``-r`` (zkxufo/TTM ``distiller_zoo/ttm.py``, ``train_student.py``). The official
    repository gives CIFAR-100 values only; the defaults are its README's example (vgg13 -> vgg8:
    ``--ttm_l 0.1 -r 1 -b 45``).
    """

    defaults = {"ce_weight": 1.0, "kd_weight": 45.0, "gamma": 0.1}

    def distill(self, x: DistillInputs):
        assert x.teacher_logits is not None  # a method that needs_teacher always gets its logits
        per_sample, _ = ttm_parts(x.student_logits, x.teacher_logits, self.hparams["gamma"])
        kd = per_sample.mean()
        return self.hparams["kd_weight"] * kd, {"kd": kd}


class WeightedTTM(DistillLoss):
    """WTTM: ``ce_weight * CE + kd_weight * mean(w * KL(q_t || p_s))`` with each sample's weight ``w``
    the unnormalised sum of the teacher's powered probabilities (:func:`ttm_parts`; larger where the
    teacher is less sure), as the official ``distiller_zoo/wttm.py``. Its ImageNet values are not in the
    official repository; the defaults are its README's WTTM line (``--ttm_l 0.2``, weight 4, there beside
    CRD on CIFAR-100).
    """

    defaults = {"ce_weight": 1.0, "kd_weight": 4.0, "gamma": 0.2}

    def distill(self, x: DistillInputs):
        assert x.teacher_logits is not None  # a method that needs_teacher always gets its logits
        per_sample, weight = ttm_parts(x.student_logits, x.teacher_logits, self.hparams["gamma"])
        kd = (weight * per_sample).mean()
        return self.hparams["kd_weight"] * kd, {"kd": kd}
