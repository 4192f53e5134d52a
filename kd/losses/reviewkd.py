"""Chen et al. 2021, "Distilling Knowledge via Knowledge Review" (CVPR), https://arxiv.org/abs/2104.09044."""

from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from kd.errors import KDError
from kd.losses.base import DistillInputs, DistillLoss
from kd.losses.features import check_maps, default_stage_layers, feature_pairs, for_layer, nearest
from kd.losses.logits import float32_or_wider

#: where each side's stages are tapped: before their final ReLU, or their output (after it)
TAPS = ("pre_relu", "output")
# The sides of the pooled maps that the hierarchical context loss compares besides the full map.
CONTEXT_SIZES = (4, 2, 1)


class ConvBN(nn.Module):
    """A bias-free convolution (Kaiming-uniform with ``a`` = 1, as the official code) + BatchNorm."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)
        nn.init.kaiming_uniform_(self.conv.weight, a=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


class ABF(nn.Module):
    """Attention-based fusion of one level: the student's map and the deeper levels' residual.

    The student's map is reduced to ``mid_channels`` (1x1 conv + BN). Where the level fuses,
    the residual is upsampled (nearest) to that map's size and the two are mixed with two
    per-position weights from a sigmoid-activated 1x1 conv on their concatenation. The mix,
    resized (nearest) to the teacher's size where that differs, is this level's residual;
    a 3x3 conv + BN of it is the output compared with the teacher.
    """

    def __init__(self, in_channels: int, mid_channels: int, out_channels: int, fuse: bool):
        super().__init__()
        self.reduce = ConvBN(in_channels, mid_channels, kernel_size=1)
        self.expand = ConvBN(mid_channels, out_channels, kernel_size=3)
        self.attention = nn.Conv2d(2 * mid_channels, 2, kernel_size=1) if fuse else None

    def forward(
        self, feat: torch.Tensor, residual: Optional[torch.Tensor], out_size: Sequence[int]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(this level's output at ``out_size``, the residual handed to the next, shallower level)."""
        x = self.reduce(for_layer(feat, self.reduce.conv.weight))
        if self.attention is not None:
            assert residual is not None  # every level but the deepest fuses
            residual = nearest(residual, x.shape[-2:])
            weights = torch.sigmoid(self.attention(torch.cat([x, residual], dim=1)))
            x = x * weights[:, 0:1] + residual * weights[:, 1:2]
        if tuple(x.shape[-2:]) != tuple(out_size):
            x = nearest(x, out_size)
        return self.expand(x), x


def review(
    abfs: nn.ModuleList, student_levels: Sequence[torch.Tensor], teacher_sizes: Sequence[Sequence[int]]
) -> List[torch.Tensor]:
    """The outputs of the chain of :class:`ABF` (deepest level first) for the levels given shallowest first.

    The outputs are in the levels' order, shallowest first.
    """
    outputs: List[torch.Tensor] = []
    residual = None
    for abf, feat, size in zip(abfs, reversed(student_levels), reversed(teacher_sizes)):
        out, residual = abf(feat, residual, size)
        outputs.insert(0, out)
    return outputs


def context_mse(fs: torch.Tensor, ft: torch.Tensor) -> torch.Tensor:
    """One level of the hierarchical context loss, in float32 (float64 stays float64).

    The MSE of the full maps (weight 1), then of both maps average-pooled to 4x4, 2x2 and 1x1,
    each size used only when it is smaller than the maps' height, with weights 1/2, 1/4, 1/8
    in the order used; divided by the sum of the weights used.
    """
    fs, ft = float32_or_wider(fs), float32_or_wider(ft.detach())
    loss = F.mse_loss(fs, ft)
    weight = weights = 1.0
    for size in CONTEXT_SIZES:
        if size < fs.shape[2]:
            weight /= 2
            weights += weight
            loss = loss + weight * F.mse_loss(F.adaptive_avg_pool2d(fs, size), F.adaptive_avg_pool2d(ft, size))
    return loss / weights


def hcl(student_maps: Sequence[torch.Tensor], teacher_maps: Sequence[torch.Tensor]) -> torch.Tensor:
    """Hierarchical context loss: :func:`context_mse` summed over the levels."""
    losses = [context_mse(fs, ft) for fs, ft in zip(student_maps, teacher_maps)]
    return torch.stack(losses).sum()


def as_levels(feats: Mapping[str, torch.Tensor]) -> List[torch.Tensor]:
    """The stage maps in order, then the pooled feature (N, C) as an (N, C, 1, 1) map."""
    maps = list(feats.values())
    pooled = maps.pop()
    return [*maps, pooled.reshape(pooled.shape[0], -1, 1, 1)]


def check_levels(method: str, shapes: Mapping[str, Sequence[int]]) -> None:
    """KDError unless ``shapes`` are stage maps (N, C, H, W) followed by the pooled feature (N, C)."""
    names = list(shapes)
    if len(names) < 2:
        raise KDError(f"KD loss {method!r} needs stage feature maps followed by the pooled feature; got {names}")
    for name in names[:-1]:
        check_maps(method, name, shapes[name])
    if len(shapes[names[-1]]) != 2:
        raise KDError(f"KD loss {method!r} needs the pooled feature as (N, C), got shape {tuple(shapes[names[-1]])}")


class ReviewKD(DistillLoss):
    """ReviewKD: ``ce_weight * CE + ramp * reviewkd_weight * hcl(ABF chain(student levels), teacher levels)``.

    The levels are the stage outputs (the four stages by default) and the pooled feature (the
    classifier's input) of each side; the engine appends the pooled one last. ``student_tap`` and
    ``teacher_tap`` say where each side's stages are read: ``pre_relu`` (before their final ReLU,
    mdistiller's, the default) or ``output`` (after it). The official ImageNet code's ResNets give
    ``output``: their in-place ReLU overwrites the stored pre-ReLU sum; its MobileNet gives
    ``pre_relu``. The recipes set the official code's taps. A chain of
    :class:`ABF`, one per level, runs from the pooled level to the shallowest stage, each level
    fusing the student's map with the residual of the deeper ones; its outputs have the teacher's
    channels and size and are compared with the teacher's levels by :func:`hcl`. The chain's
    parameters are kept in its running order (``abfs.0`` is the pooled level), as the official code
    keeps them.

    Defaults are the official ImageNet code's (dvlab-research/ReviewKD ``ImageNet/``, ResNet-34
    -> ResNet-18): weight 1, 512 mid channels, no warm-up; its ResNet-50 -> MobileNet setting is
    ``reviewkd_weight`` 8 and ``mid_channels`` 256. ``warmup`` > 0 is mdistiller's ramp
    (``WARMUP_EPOCHS``): ``min(epoch / warmup, 1)``, stepped once per epoch, the epoch counted
    from 1. The official code needs student and teacher maps of the same size (its sizes are
    fixed for 224-pixel crops); where they differ, the fused map is resized to the teacher's
    size by nearest interpolation before the 3x3 conv, as mdistiller does.
    """

    defaults = {
        "ce_weight": 1.0,
        "reviewkd_weight": 1.0,
        "mid_channels": 512,
        "warmup": 0.0,
        "student_tap": "pre_relu",
        "teacher_tap": "pre_relu",
    }

    def __init__(self, num_classes: int, **hparams):
        super().__init__(num_classes, **hparams)
        mid = self.hparams["mid_channels"]
        if not isinstance(mid, (int, float)) or isinstance(mid, bool) or not float(mid).is_integer() or mid < 1:
            raise KDError(f"KD loss 'reviewkd': mid_channels must be a positive whole number, got {mid!r}")
        for key in ("student_tap", "teacher_tap"):
            if self.hparams[key] not in TAPS:
                raise KDError(f"KD loss 'reviewkd': {key} must be one of {', '.join(TAPS)}, got {self.hparams[key]!r}")
        self.abfs = nn.ModuleList()

    def side_tap_point(self, side: str) -> str:
        return self.hparams[f"{side}_tap"]

    @classmethod
    def default_layers(cls, student_layers: List[str], teacher_layers: List[str]) -> List[str]:
        return default_stage_layers(cls.name, student_layers, teacher_layers, stages=(0, 1, 2, 3))

    def setup_features(self, student_shapes: Dict[str, torch.Size], teacher_shapes: Dict[str, torch.Size]) -> None:
        pairs = feature_pairs(self.name, student_shapes, teacher_shapes)
        check_levels(self.name, student_shapes)
        check_levels(self.name, teacher_shapes)
        mid = int(self.hparams["mid_channels"])
        deepest_first = pairs[::-1]
        self.abfs = nn.ModuleList(
            ABF(student_shapes[s][1], mid, teacher_shapes[t][1], fuse=i > 0) for i, (s, t) in enumerate(deepest_first)
        )

    def distill(self, x: DistillInputs):
        h = self.hparams
        student, teacher = as_levels(x.student_feats), as_levels(x.teacher_feats)
        if not len(student) == len(teacher) == len(self.abfs):
            raise KDError(
                f"KD loss 'reviewkd' was set up for {len(self.abfs)} levels, got {len(student)} and {len(teacher)}"
            )
        outputs = review(self.abfs, student, [t.shape[-2:] for t in teacher])
        loss = hcl(outputs, teacher)
        epoch = math.floor(x.progress) + 1  # 1-based, as mdistiller's trainer passes it
        ramp = min(epoch / h["warmup"], 1.0) if h["warmup"] > 0 else 1.0
        return ramp * h["reviewkd_weight"] * loss, {"reviewkd": loss}
