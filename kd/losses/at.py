"""Zagoruyko & Komodakis 2017, "Paying More Attention to Attention: Improving the Performance of
Convolutional Neural Networks via Attention Transfer" (ICLR), https://arxiv.org/abs/1612.03928."""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn.functional as F

from kd.losses.base import DistillInputs, DistillLoss
from kd.losses.features import default_stage_layers, feature_pairs, map_pairs, pool_to_common


def attention_map(feat: torch.Tensor, p: float) -> torch.Tensor:
    """Spatial attention (N, H, W): mean over channels of |f|^p, in float32 (not normalised)."""
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
