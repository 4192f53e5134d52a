"""Zagoruyko & Komodakis 2017, "Paying More Attention to Attention: Improving the Performance of
Convolutional Neural Networks via Attention Transfer" (ICLR), https://arxiv.org/abs/1612.03928."""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from kd.losses.base import DistillInputs, DistillLoss
from kd.losses.features import REDUCED_DTYPES, default_stage_layers, feature_pairs, map_pairs, pool_to_common


class _SquareMean(torch.autograd.Function):
    """``f.float().pow(2).mean(1)`` of a float16 or bfloat16 map (N, C, H, W) without a float32 copy of it.

    Forward: one reduction reads the map and accumulates its squares in float32 (CUDA reads the reduced
    dtype in the kernel), as the root of the sum, squared: the expression's float32 values to a few ulps.
    Backward: ``2 f g / C`` in float32 per element, rounded once to the map's dtype (``mul`` into a
    tensor of that dtype), the bits of the expression's own backward. Eager ran the cast, ``abs``,
    ``pow`` and their backwards as separate float32 passes over every tapped map (4.8 ms of copies and
    2.7 of elementwise kernels in AT's 31 ms step on an H100, docs/benchmarks.md); the compiled step
    fuses the expression itself.
    """

    @staticmethod
    def forward(ctx, feat: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(feat)
        with torch.autocast(feat.device.type, enabled=False):
            return torch.linalg.vector_norm(feat, 2, dim=1, dtype=torch.float32).square() / feat.shape[1]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (feat,) = ctx.saved_tensors
        scale = (grad.float() / (feat.shape[1] / 2.0)).unsqueeze(1)  # 2 g / C as the mean and pow backwards round it
        return torch.mul(feat, scale, out=torch.empty_like(feat))


def attention_map(feat: torch.Tensor, p: float) -> torch.Tensor:
    """Spatial attention (N, H, W): mean over channels of |f|^p, in float32 (not normalised)."""
    if p == 2 and feat.dtype in REDUCED_DTYPES and not torch.compiler.is_compiling():
        return _SquareMean.apply(feat)
    return feat.float().abs().pow(p).mean(dim=1)


def at_distance(student_feat: torch.Tensor, teacher_feat: torch.Tensor, p: float) -> torch.Tensor:
    """Mean squared difference of the L2-normalised, flattened attention maps of one stage.

    The mean runs over batch and positions, as in the official code. When the spatial sizes
    differ, the larger attention map is average-pooled to the smaller one before normalising.
    """
    a_s, a_t = pool_to_common(attention_map(student_feat, p), attention_map(teacher_feat.detach(), p))
    q_s = F.normalize(a_s.flatten(1), dim=1)
    q_t = F.normalize(a_t.flatten(1), dim=1)
    return (q_s - q_t).pow(2).mean()


class AttentionTransfer(DistillLoss):
    """AT: ``ce_weight * CE + at_weight * sum over stages of at_distance``.

    Default layers are the four stage outputs (``layer1..layer4`` of ResNets, the stride 4-32
    stages of MobileNets); specs are ``name`` or ``student_name:teacher_name`` paired by
    position (see :mod:`kd.losses.features`). ``at_weight`` = 1000 and ``p`` = 2 are the official
    code's and mdistiller's (their ``beta``, applied without the paper's 1/2).
    """

    defaults = {"ce_weight": 1.0, "at_weight": 1000.0, "p": 2.0}
    renamed = {"beta": "at_weight"}

    @classmethod
    def default_layers(cls, student_layers: List[str], teacher_layers: List[str]) -> List[str]:
        return default_stage_layers(cls.name, student_layers, teacher_layers, stages=(0, 1, 2, 3))

    def setup_features(self, student_shapes: Dict[str, torch.Size], teacher_shapes: Dict[str, torch.Size]) -> None:
        map_pairs(self.name, student_shapes, teacher_shapes)

    def distill(self, x: DistillInputs):
        h = self.hparams
        pairs = feature_pairs(self.name, x.student_feats, x.teacher_feats)
        at = sum(at_distance(x.student_feats[s], x.teacher_feats[t], h["p"]) for s, t in pairs)
        return h["at_weight"] * at, {"at": at}
