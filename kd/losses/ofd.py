"""Heo et al. 2019, "A Comprehensive Overhaul of Feature Distillation" (ICCV), https://arxiv.org/abs/1904.01866."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from kd.errors import KDError
from kd.losses.base import DistillInputs, DistillLoss
from kd.losses.features import (
    REDUCED_DTYPES,
    Connector,
    default_stage_layers,
    feature_pairs,
    map_pairs,
    pool_to_common,
)
from kd.losses.logits import float32_or_wider

# below this probability of a negative pre-ReLU value the expectation is replaced by -3 std
_TINY_NEGATIVE_PROBABILITY = 0.001


def relu_margins(weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The margin of each channel from the BatchNorm (weight, bias) before a ReLU, in float32.

    The BatchNorm output x is taken as N(bias, weight^2); the margin is E[x | x < 0] =
    bias - |weight| * pdf(z) / cdf(z) with z = -bias / |weight|, or -3 |weight| where
    cdf(z) <= 0.001. Computed in float64 and rounded to float32, as the official code does
    (Python floats into a FloatTensor). A zero weight gives the limit: bias when bias < 0, else 0.
    """
    std = weight.detach().double().abs()
    mean = bias.detach().double()
    z = -mean / std
    negative = torch.special.ndtr(z)
    expected = -std * torch.exp(-z * z / 2) / math.sqrt(2 * math.pi) / negative + mean
    return torch.where(negative > _TINY_NEGATIVE_PROBABILITY, expected, -3 * std).float()


def partial_l2(student: torch.Tensor, teacher: torch.Tensor, margin: torch.Tensor) -> torch.Tensor:
    """Sum over all elements of (s - t')^2, t' = max(t, margin), except where s <= t' <= 0.

    ``margin`` is one value per channel. Where the teacher's value is negative the student
    need only stay below it: the teacher's ReLU would zero both.
    """
    target = torch.max(teacher, margin.to(teacher.dtype).view(1, -1, 1, 1))
    kept = (student > target) | (target > 0)
    return torch.where(kept, (student - target).pow(2), torch.zeros_like(student)).sum()


class _PartialL2(torch.autograd.Function):
    """:func:`partial_l2` of a float16/bfloat16 student map, with the float32 passes of eager autograd cut.

    Forward in float32 as the expression (the teacher's side without autograd): ``u = s - t'``,
    ``v = u`` where ``t' > 0`` else ``max(u, 0)`` (``v = u`` where kept, else 0), the loss the sum of
    ``v u`` (``v^2``; a non-finite map gives a non-finite loss, as the official code's mask product
    does). Backward: ``2 v g`` per element rounded once to the student's dtype, one pass (the bits of
    the expression's backward). The expression's autograd made a float32 copy of the student's map and
    ran the mask, the square, the selection and their backwards as separate passes over it.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, student: torch.Tensor, teacher: torch.Tensor, margin: torch.Tensor
    ) -> torch.Tensor:
        with torch.autocast(student.device.type, enabled=False):
            target = torch.maximum(teacher, margin.view(1, -1, 1, 1))  # float32, as the margins
            u = torch.sub(student, target)
            v = torch.where(target > 0, u, u.clamp(min=0))
            ctx.save_for_backward(v)
            ctx.dtype = student.dtype
            # v . u, summed as torch sums (a tree: a dot product's one long float32 run drifts by 1e-4 over
            # an ImageNet stage); v * u is v^2, and 0 * inf a NaN where a non-finite map is left out, as the
            # official code's mask product makes it: a map that overflowed gives a loss that says so
            return (v * u).sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (v,) = ctx.saved_tensors
        return torch.mul(v, 2 * grad.float(), out=torch.empty_like(v, dtype=ctx.dtype)), None, None


def stage_distance(student: torch.Tensor, teacher: torch.Tensor, margin: torch.Tensor) -> torch.Tensor:
    """:func:`partial_l2` of one stage's connector output and teacher map, the larger average-pooled to the
    smaller; reduced-dtype maps of one size (the ImageNet pairs) through :class:`_PartialL2` in eager."""
    if student.dtype in REDUCED_DTYPES and student.shape == teacher.shape and not torch.compiler.is_compiling():
        return _PartialL2.apply(student, teacher.detach(), margin.float())
    return partial_l2(*pool_to_common(float32_or_wider(student), float32_or_wider(teacher.detach())), margin)


class OverhaulDistillation(DistillLoss):
    """OFD: ``ce_weight * CE + ofd_weight * sum_i 2^-(n-1-i) partial_l2(connector_i(f_s), f_t) / N``.

    The features are the pre-ReLU stage outputs of both models (``tap_point``), by default the
    four stages at strides 4-32, as in the official ImageNet code; the last stage weighs 1, each
    earlier one half the next. The teacher's map is clamped below by the margin of its channel
    (:func:`relu_margins`, from the teacher's BatchNorm before the stage's final ReLU, given to
    :meth:`setup_teacher`), and the partial L2 distance (:func:`partial_l2`) is summed over
    batch, channels and positions and divided by the batch size N. For a ResNet stage, whose
    pre-ReLU output is the last block's BatchNorm plus the shortcut, the official code takes the
    margin from that BatchNorm alone. Both the official code and mdistiller run the teacher with
    batch statistics (train mode) while distilling.

    Connectors (:class:`kd.losses.features.Connector`, initialised as the official code does) are
    trained with the student. The official code needs equal spatial sizes; where they differ the
    larger map is average-pooled to the smaller after the connector.

    ``ofd_weight`` = 1e-4 is the official ImageNet setting (``CE + loss.sum() / batch / 10000``;
    its CIFAR-100 code divides by 1000). mdistiller's ``OFD.LOSS.FEAT_WEIGHT`` is the same weight
    (1e-4 in ``configs/imagenet/r50_mv1/ofd.yaml``, 1e-3 by default), but it distils only the
    last three stages (weights 1/4, 1/2, 1) and pools the teacher's map to the student's size.
    """

    defaults = {"ce_weight": 1.0, "ofd_weight": 1e-4}

    margins: Optional[torch.Tensor]

    def __init__(self, num_classes: int, **hparams):
        super().__init__(num_classes, **hparams)
        self.connectors = nn.ModuleList()
        self.pairs: List[Tuple[str, str]] = []
        self.channels: List[int] = []  # the teacher's, per pair
        # recomputed from the teacher at every start, so not in the checkpoint
        self.register_buffer("margins", None, persistent=False)

    @classmethod
    def default_layers(cls, student_layers: List[str], teacher_layers: List[str]) -> List[str]:
        return default_stage_layers(cls.name, student_layers, teacher_layers, stages=(0, 1, 2, 3))

    def setup_features(self, student_shapes: Dict[str, torch.Size], teacher_shapes: Dict[str, torch.Size]) -> None:
        self.pairs = map_pairs(self.name, student_shapes, teacher_shapes)
        self.connectors = nn.ModuleList(  # initialised as the official code: N(0, 2 / out_channels) weights
            Connector(student_shapes[s][1], teacher_shapes[t][1], weight_std=math.sqrt(2.0 / teacher_shapes[t][1]))
            for s, t in self.pairs
        )
        self.channels = [int(teacher_shapes[t][1]) for _, t in self.pairs]

    def setup_teacher(self, norms: Dict[str, Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The margins from the (weight, bias) of the teacher's BatchNorm before each stage's final ReLU."""
        teacher = [t for _, t in self.pairs]
        if sorted(norms) != sorted(teacher):
            raise KDError(
                f"KD loss 'ofd' needs the teacher's BatchNorm of the layers {', '.join(teacher) or 'none'}; "
                f"got {', '.join(norms) or 'none'}"
            )
        margins = []
        for t, channels in zip(teacher, self.channels):
            weight, bias = norms[t]
            if weight.shape != (channels,) or bias.shape != (channels,):
                raise KDError(
                    f"KD loss 'ofd': the BatchNorm before the ReLU of teacher layer {t!r} has "
                    f"{tuple(weight.shape)} weights, the layer {channels} channels"
                )
            margins.append(relu_margins(weight, bias))
        self.margins = torch.cat(margins).to(next(self.connectors.parameters()).device)

    def distill(self, x: DistillInputs):
        pairs = feature_pairs(self.name, x.student_feats, x.teacher_feats)
        if len(pairs) != len(self.connectors):
            raise KDError(f"KD loss 'ofd' was set up for {len(self.connectors)} layer pair(s), got {len(pairs)}")
        if self.margins is None:
            raise KDError("KD loss 'ofd' needs the teacher's BatchNorm before each distilled ReLU; none was given")
        margins = self.margins.split(self.channels)
        stages = []
        for connector, margin, (s, t) in zip(self.connectors, margins, pairs):
            stages.append(stage_distance(connector(x.student_feats[s]), x.teacher_feats[t], margin))
        n = len(stages)
        ofd = sum(loss / 2 ** (n - 1 - i) for i, loss in enumerate(stages)) / x.student_feats[pairs[0][0]].shape[0]
        return self.hparams["ofd_weight"] * ofd, {"ofd": ofd}
