"""Jin et al. 2023, "Multi-Level Logit Distillation" (CVPR): instance-, class- and batch-level terms
on two augmented views of each sample, the teacher's confidence on the weak view masking them."""

from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.nn.functional as F

from kd.losses.base import DistillInputs, TwoViewLoss, kd_divergence
from kd.losses.logits import float32_or_wider, standardise_switch, standardised

#: the temperatures the official code sums at after ``temperature`` (KD_ours.forward_train); at the
#: last two its strong-view sum takes the weak view's logits
EXTRA_TEMPERATURES = (3.0, 5.0, 2.0, 6.0)


def correlation_gap(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float, over: str
) -> torch.Tensor:
    """The squared Frobenius distance between the teacher's and the student's Gram matrices of their
    probabilities at ``temperature``, divided by the side of the matrix: ``over="classes"`` is the
    class-level term (P^T P, C x C, divided by C), ``over="samples"`` the batch-level term (P P^T,
    B x B, divided by B). In float32 (float64 stays); no gradient to the teacher."""
    p_s = F.softmax(float32_or_wider(student_logits) / temperature, dim=1)
    p_t = F.softmax(float32_or_wider(teacher_logits.detach()) / temperature, dim=1)
    if over == "classes":
        g_s, g_t = p_s.t() @ p_s, p_t.t() @ p_t
    else:
        g_s, g_t = p_s @ p_s.t(), p_t @ p_t.t()
    return ((g_t - g_s) ** 2).sum() / g_s.shape[0]


def confidence_shares(teacher_weak_logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the share of samples, the share of classes) at or under the median confidence of the
    teacher's weak-view predictions: a sample's confidence is its top probability, a class's the sum
    of its probability over the batch; the median is linearly interpolated (numpy's percentile 50,
    as the official code takes it). On the device: no host sync."""
    p = F.softmax(float32_or_wider(teacher_weak_logits.detach()), dim=1)
    confidence = p.max(dim=1).values
    classes = p.sum(dim=0)
    samples = (confidence <= torch.quantile(confidence, 0.5)).to(p.dtype).mean()
    return samples, (classes <= torch.quantile(classes, 0.5)).to(p.dtype).mean()


def mlkd_parts(
    student_weak: torch.Tensor,
    teacher_weak: torch.Tensor,
    student_strong: torch.Tensor,
    teacher_strong: torch.Tensor,
    temperature: float,
    standardise: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(instance-level, class-level, batch-level) terms, unweighted, as the official code sums them.

    At each temperature of ``temperature`` and :data:`EXTRA_TEMPERATURES`: the instance level is
    T^2 KL on the weak view times the share of low-confidence samples, plus T^2 KL on the strong
    view (at T 2 and 6 on the weak view's logits instead, as the official code does); the class level
    is the class correlation gap on the weak view times the share of low-confidence classes; the
    batch level the batch correlation gap on the weak view times the share of low-confidence
    samples (:func:`confidence_shares`, :func:`correlation_gap`). ``standardise`` z-scores the
    logits of the instance level only (the logit-standardisation code's MLKD).
    """
    samples, classes = confidence_shares(teacher_weak)
    sw, tw = standardised(student_weak, teacher_weak, standardise)
    ss, ts = standardised(student_strong, teacher_strong, standardise)
    temperatures = (temperature, *EXTRA_TEMPERATURES)
    weak = torch.stack([kd_divergence(sw, tw, t) for t in temperatures]).sum()
    strong = torch.stack(
        [kd_divergence(ss, ts, t) for t in temperatures[:-2]] + [kd_divergence(sw, tw, t) for t in temperatures[-2:]]
    ).sum()
    class_level = torch.stack([correlation_gap(student_weak, teacher_weak, t, "classes") for t in temperatures]).sum()
    batch_level = torch.stack([correlation_gap(student_weak, teacher_weak, t, "samples") for t in temperatures]).sum()
    return weak * samples + strong, class_level * classes, batch_level * samples


class MultiLevelKD(TwoViewLoss):
    """MLKD: ``ce_weight * (CE(weak) + CE(strong)) + kd_weight * (instance + class + batch levels)``
    (:func:`mlkd_parts`) on a weak and a strong view of each sample (``views = 2``: the loaders make the
    strong view, the student and the teacher forward both).

    Defaults are the official ImageNet setting (Jin-Ying/Multi-Level-Logit-Distillation
    ``configs/imagenet/r34_r18/kd_ours.yaml``: ``KD.TEMPERATURE`` 1, ``CE_WEIGHT`` 0.5, ``KD_WEIGHT``
    0.5). The official code's odd parts are kept: the confidence masks scale the batch-mean terms by
    the share of masked samples (or classes) instead of selecting samples; the strong-view sum takes
    the weak view's logits at T 2 and 6; the official code's strong-view class- and batch-level terms
    are computed and never used, so they are left out. ``standardise`` 1 z-scores the instance level's
    logits alone (sunshangquan/logit-standardization-KD ``mdistiller/distillers/MLKD.py``). The
    logged ``kd``, ``cc`` and ``bc`` are the weighted terms, as the official trainer logs them.
    """

    defaults = {"ce_weight": 0.5, "kd_weight": 0.5, "temperature": 1.0, "standardise": 0}

    def __init__(self, num_classes: int, **hparams: Any):
        super().__init__(num_classes, **hparams)
        self.standardise = standardise_switch(self.name, self.hparams["standardise"])

    def distill(self, x: DistillInputs):
        h = self.hparams
        assert x.teacher_logits is not None and x.second_teacher_logits is not None
        assert x.second_student_logits is not None
        instance, class_level, batch_level = mlkd_parts(
            x.student_logits,
            x.teacher_logits,
            x.second_student_logits,
            x.second_teacher_logits,
            h["temperature"],
            self.standardise,
        )
        w = h["kd_weight"]
        kd, cc, bc = w * instance, w * class_level, w * batch_level
        return kd + cc + bc, {"kd": kd, "cc": cc, "bc": bc}
