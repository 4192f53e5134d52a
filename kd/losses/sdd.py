"""Wei et al. 2024, "Scale Decoupled Distillation" (CVPR), https://arxiv.org/abs/2403.13512.

Each side's classifier scores the cells of its final feature map pooled over a multi-scale grid;
the logit loss (KD, DKD or NKD) compares every cell's scores, each cell weighted by whether the
teacher's verdict on it agrees with its verdict on the global cell.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Dict, Optional, Sequence

import torch
import torch.nn.functional as F

from kd.errors import KDError
from kd.losses.base import DistillInputs, DistillLoss
from kd.losses.logits import dkd_rows, float32_or_wider, without_target


def cells(fmap: torch.Tensor, scales: Sequence[int], grid: int) -> torch.Tensor:
    """(N, C, R) cells of an (N, C, H, W) map: for each scale s, in order, its s x s cells (row by row).

    ``grid`` > 0: the map is average-pooled to grid x grid first (adaptively) and every scale is
    pooled from that grid, as the official code pools from its 4x4 map (so its 1x1 "global" cell of
    a 7x7 map is the mean of 16 overlapping windows, not the map's mean); 0: each scale from the map.
    """
    base = F.adaptive_avg_pool2d(fmap, grid) if grid > 0 else fmap
    return torch.cat([F.adaptive_avg_pool2d(base, s).flatten(2) for s in scales], dim=2)


def cell_logits(
    fmap: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], scales: Sequence[int], grid: int
) -> torch.Tensor:
    """(R * N, K) scores of a linear classifier on the cells of ``fmap``, cell-major (cell 0's N
    rows first), in float32 or wider."""
    x = cells(float32_or_wider(fmap), scales, grid).permute(2, 0, 1)  # R, N, C
    rows = x.reshape(-1, x.shape[-1])
    b = None if bias is None else bias.to(rows.dtype)
    return float32_or_wider(F.linear(rows, weight.to(rows.dtype), b))


def region_weights(teacher_rows: torch.Tensor, labels: torch.Tensor, cells_per_sample: int, weight: float):
    """(R * N,) weight of each cell: ``weight`` where the teacher is right on it and wrong on the
    sample's global cell (cell 0), or the other way round (complementary); 1 where it agrees."""
    right = (teacher_rows.argmax(dim=1) == labels.repeat(cells_per_sample)).reshape(cells_per_sample, -1)
    ones = torch.ones_like(right, dtype=teacher_rows.dtype)
    return torch.where(right == right[0:1], ones, ones * weight).reshape(-1)


def kd_rows(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 KL(teacher || student) of each row at ``temperature``."""
    t = temperature
    log_s, log_t = F.log_softmax(student / t, dim=1), F.log_softmax(teacher.detach() / t, dim=1)
    return F.kl_div(log_s, log_t, reduction="none", log_target=True).sum(1) * (t * t)


def nkd_rows(
    student: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    gamma: float,
    drop_target: bool,
) -> torch.Tensor:
    """NKD of each row: ``-p_t[y] log p_s[y]`` at T 1 plus ``gamma`` T^2 times the cross-entropy of
    the teacher's and student's distributions at ``temperature``, over every class (the official SDD
    code's mask keeps the target) or, ``drop_target``, over the non-target classes (NKD's own)."""
    t = temperature
    label = labels.reshape(-1, 1)
    z = teacher.detach()
    target = -(z.softmax(dim=1).gather(1, label) * F.log_softmax(student, dim=1).gather(1, label)).squeeze(1)
    s_rest, z_rest = student / t, z / t
    if drop_target:
        s_rest, z_rest = without_target(s_rest, labels), without_target(z_rest, labels)
    rest = -(z_rest.softmax(dim=1) * F.log_softmax(s_rest, dim=1)).sum(dim=1) * (t * t)
    return target + gamma * rest


class ScaleDecoupled(DistillLoss):
    """The scale-decoupled part shared by ``sdkd``, ``sddkd`` and ``sdnkd``: each side's final
    feature map and classifier (the engine finds them: :func:`kd.utils.taps.final_map`), the cells
    (:func:`cells`) and their weights (:func:`region_weights`); :meth:`rows` is the method's loss per cell."""

    scale_defaults: ClassVar[Dict[str, Any]] = {"scales": [1, 2, 4], "grid": 4, "complementary_weight": 2.0}

    teacher_weight: Optional[torch.Tensor]
    teacher_bias: Optional[torch.Tensor]

    def __init__(self, num_classes: int, **hparams: Any):
        super().__init__(num_classes, **hparams)
        scales, grid = self.hparams["scales"], self.hparams["grid"]
        listed = scales if isinstance(scales, (list, tuple)) else []
        whole = [s for s in listed if isinstance(s, int) and not isinstance(s, bool) and s >= 1]
        if not whole or len(whole) != len(listed) or whole[0] != 1 or len(set(whole)) != len(whole):
            raise KDError(
                f"KD loss {self.name!r}: scales must be distinct whole numbers from 1 (the global cell), got {scales!r}"
            )
        if not isinstance(grid, int) or isinstance(grid, bool) or grid < 0 or (grid and max(whole) > grid):
            raise KDError(
                f"KD loss {self.name!r}: grid must be 0 or a whole number at least the largest scale, got {grid!r}"
            )
        self.student_head = ""  # the student's linear classifier, by module name
        # copied from the frozen teacher at every start, so not in the checkpoint
        self.register_buffer("teacher_weight", None, persistent=False)
        self.register_buffer("teacher_bias", None, persistent=False)

    def setup_classifiers(self, student_head: str, teacher_weight: torch.Tensor, teacher_bias: Optional[torch.Tensor]):
        """The student's linear classifier (its module name: it trains) and the teacher's (float32 copies)."""
        self.student_head = student_head
        self.teacher_weight, self.teacher_bias = teacher_weight, teacher_bias

    def rows(self, student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The method's loss of each cell row (R * N,)."""
        raise NotImplementedError  # pragma: no cover

    def scale_decoupled(self, x: DistillInputs) -> torch.Tensor:
        """sum(weight * rows) / (R * N) over every cell of every sample."""
        h = self.hparams
        if x.labels.dim() != 1:
            raise KDError(f"KD loss {self.name!r} needs class-index labels; soft labels (mixup, cutmix) have none")
        if x.student_classifier is None or self.teacher_weight is None or len(x.student_feats) != 1:
            raise KDError(f"KD loss {self.name!r} needs each side's final feature map and classifier; none was given")
        head = x.student_classifier
        assert isinstance(head, torch.nn.Linear)  # the engine's final_map found it so
        (s_map,), (t_map,) = x.student_feats.values(), x.teacher_feats.values()
        student = cell_logits(s_map, head.weight, head.bias, h["scales"], h["grid"])
        with torch.no_grad():
            teacher = cell_logits(t_map, self.teacher_weight, self.teacher_bias, h["scales"], h["grid"])
        per_sample = sum(s * s for s in h["scales"])
        weights = region_weights(teacher, x.labels, per_sample, h["complementary_weight"])
        return (weights * self.rows(student, teacher, x.labels.repeat(per_sample))).mean()


def ramp(warmup: float, progress: float) -> float:
    """mdistiller's per-epoch warm-up factor, the epoch counted from 1 (0: none)."""
    return min((math.floor(progress) + 1) / warmup, 1.0) if warmup > 0 else 1.0


class ScaleDecoupledKD(ScaleDecoupled):
    """SD-KD: ``ce_weight * CE + kd_weight * sum(cell weight * KD of each cell) / cells``.

    Defaults are the official ImageNet SD-KD code's (shicaiwei123/SDD-CVPR2024 ``KD.py``
    ``sdd_kd_loss``; its ImageNet configs have no KD block, so mdistiller's defaults: T 4, CE 0.1,
    KD 0.9), scales [1, 2, 4] from a 4x4 grid, complementary cells weighted 2.
    """

    defaults = {"ce_weight": 0.1, "kd_weight": 0.9, "temperature": 4.0, **ScaleDecoupled.scale_defaults}

    def rows(self, student, teacher, labels):
        return kd_rows(student, teacher, self.hparams["temperature"])

    def distill(self, x: DistillInputs):
        sd = self.scale_decoupled(x)
        return self.hparams["kd_weight"] * sd, {"kd": sd}


class ScaleDecoupledDKD(ScaleDecoupled):
    """SD-DKD: ``ce_weight * CE + ramp * sum(cell weight * (tckd_weight TCKD + nckd_weight NCKD)) / cells``.

    Defaults are the official ImageNet ResNet-34 -> ResNet-18 setting (``SDD_DKD.py`` ``multi_dkd``,
    ``configs/imagenet/r34_r18/sdd_dkd.yaml``: ALPHA 1, BETA 0.5, T 1, no warm-up; ``--M [1,2]``
    in its run.sh, scales [1, 2, 4] by default here as its train.py's).
    """

    defaults = {
        "ce_weight": 1.0,
        "tckd_weight": 1.0,
        "nckd_weight": 0.5,
        "temperature": 1.0,
        "warmup": 1.0,
        **ScaleDecoupled.scale_defaults,
    }

    def rows(self, student, teacher, labels):
        h = self.hparams
        tckd, nckd = dkd_rows(student, teacher, labels, h["temperature"])
        return h["tckd_weight"] * tckd + h["nckd_weight"] * nckd

    def distill(self, x: DistillInputs):
        sd = self.scale_decoupled(x)
        return ramp(self.hparams["warmup"], x.progress) * sd, {"kd": sd}


class ScaleDecoupledNKD(ScaleDecoupled):
    """SD-NKD: ``ce_weight * CE + sum(cell weight * NKD of each cell) / cells`` (:func:`nkd_rows`).

    Defaults are the official ImageNet ResNet-34 -> ResNet-18 setting (``SDD_nkd.py``
    ``multi_nkd_loss``, ``configs/imagenet/r34_r18/sdd_nkd.yaml``: gamma = its DKD BETA 0.5, T 1);
    ``drop_target`` 0 keeps the official code's mask, which leaves the target class in the
    non-target term (1: NKD's own, without it).
    """

    defaults = {
        "ce_weight": 1.0,
        "non_target_weight": 0.5,
        "temperature": 1.0,
        "drop_target": 0,
        **ScaleDecoupled.scale_defaults,
    }

    def rows(self, student, teacher, labels):
        h = self.hparams
        return nkd_rows(student, teacher, labels, h["temperature"], h["non_target_weight"], bool(h["drop_target"]))

    def distill(self, x: DistillInputs):
        sd = self.scale_decoupled(x)
        return sd, {"kd": sd}
