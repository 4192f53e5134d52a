"""Yang et al. 2023, "From Knowledge Distillation to Self-Knowledge Distillation: A Unified Approach
with Normalized Loss and Customized Soft Labels" (ICCV), https://arxiv.org/abs/2303.13005."""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from kd.errors import KDError
from kd.losses.base import DistillInputs, DistillLoss
from kd.losses.logits import float32_or_wider, without_target


def nkd_parts(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, temperature: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(target term, non-target term), each averaged over the batch, in float32 (float64 stays float64).

    The target term is ``-p_t[y] * log p_s[y]`` at temperature 1: the teacher's target probability
    weighs the student's log target probability. The non-target term is T^2 times the cross-entropy
    between the teacher's and the student's distributions over the non-target classes alone (the
    target logit removed, the rest renormalised), at ``temperature``. Both logarithms come from
    ``log_softmax``, never from the log of a probability, so a probability that rounds to 0 or 1
    leaves them finite. No gradient to the teacher.
    """
    if labels.dim() != 1:
        raise KDError("KD loss 'nkd' needs class-index labels; soft labels (mixup, cutmix) have no target class")
    t = temperature
    s = float32_or_wider(student_logits)
    z = float32_or_wider(teacher_logits.detach())
    label = labels.reshape(-1, 1)

    target = -(z.softmax(dim=1).gather(1, label) * F.log_softmax(s, dim=1).gather(1, label)).mean()

    s_others = without_target(s, labels) / t
    z_others = without_target(z, labels) / t
    non_target = -(z_others.softmax(dim=1) * F.log_softmax(s_others, dim=1)).sum(dim=1).mean() * (t * t)
    return target, non_target


class NormalizedKD(DistillLoss):
    """NKD: ``ce_weight * CE + target term + non_target_weight * non-target term`` (:func:`nkd_parts`).

    Defaults are the official ImageNet ResNet setting (yzd-v/cls_KD
    ``configs/distillers/imagenet/res34_distill_res18_img.py`` and ``res50_distill_mv1_img.py``:
    ``NKDLoss`` temp 1, gamma 1.5; the student's own cross-entropy at loss weight 1, no label
    smoothing); the official ``gamma`` is ``non_target_weight`` here. The official DeiT students
    (``deit-s3_distill_deit-t_img.py``) use ``non_target_weight`` 1.0. The non-target term is a
    cross-entropy, as the official code computes it, not a KL divergence: same gradient, but its
    logged value keeps the teacher's non-target entropy and is not 0 when the student matches.
    Under mixup and cutmix (labels that are mixed targets, (N, C)) a sample's target class is the
    larger part of its mixed target, their argmax (of two equal parts, the lower class index), as the
    official code takes it (``NKDLoss.forward``: ``torch.max(gt_label, dim=1)``); smoothing the targets
    does not move it.
    """

    defaults = {"ce_weight": 1.0, "non_target_weight": 1.5, "temperature": 1.0}

    def distill(self, x: DistillInputs):
        h = self.hparams
        assert x.teacher_logits is not None  # a method that needs_teacher always gets its logits
        labels = x.labels if x.labels.dim() == 1 else x.labels.argmax(dim=1)  # a mixed sample: its larger part
        target, non_target = nkd_parts(x.student_logits, x.teacher_logits, labels, h["temperature"])
        kd = target + h["non_target_weight"] * non_target
        return kd, {"kd": kd, "target": target, "non_target": non_target}
