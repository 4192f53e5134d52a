"""Romero et al. 2015, "FitNets: Hints for Thin Deep Nets" (ICLR), https://arxiv.org/abs/1412.6550."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from kd.errors import KDError
from kd.losses.base import DistillInputs, DistillLoss, kd_divergence
from kd.losses.features import Connector, default_stage_layers, feature_pairs, map_pairs, pool_to_common


def hint_loss(student_hint: torch.Tensor, teacher_feat: torch.Tensor) -> torch.Tensor:
    """Mean squared error between the connector's output and the teacher's feature map.

    The larger of the two maps is average-pooled to the smaller spatial size first.
    """
    s, t = pool_to_common(student_hint.float(), teacher_feat.detach().float())
    return F.mse_loss(s, t)


class FitNet(DistillLoss):
    """Hint training: ``ce_weight * CE + hint_weight * MSE(connector(f_s), f_t) + kd_weight * KD``.

    The hint is one middle layer by default: the stride-16 stage (``layer3`` of a ResNet,
    ``features.13`` of torchvision's MobileNetV2, ``blocks.4`` of timm's). Several layers
    may be given; their hint losses are summed, each with its own connector. Layer specs
    are ``name`` or ``student_name:teacher_name``, paired by position (see
    :mod:`kd.losses.features`). Defaults follow mdistiller (``FITNET.LOSS``: CE 1, FEAT 100,
    MSE averaged over all elements); its connector resamples by strided convolutions, here
    the larger map is average-pooled instead. The optional Hinton KD term
    (``kd_weight``, ``temperature``) is off by default.
    """

    defaults = {"ce_weight": 1.0, "hint_weight": 100.0, "kd_weight": 0.0, "temperature": 4.0}

    def __init__(self, num_classes: int, **hparams):
        super().__init__(num_classes, **hparams)
        self.connectors = nn.ModuleList()
        self.pairs: List[Tuple[str, str]] = []

    @classmethod
    def default_layers(cls, student_layers: List[str], teacher_layers: List[str]) -> List[str]:
        return default_stage_layers(cls.name, student_layers, teacher_layers, stages=(2,))

    def setup_features(self, student_shapes: Dict[str, torch.Size], teacher_shapes: Dict[str, torch.Size]) -> None:
        self.pairs = map_pairs(self.name, student_shapes, teacher_shapes)
        self.connectors = nn.ModuleList(Connector(student_shapes[s][1], teacher_shapes[t][1]) for s, t in self.pairs)

    def distill(self, x: DistillInputs):
        h = self.hparams
        pairs = feature_pairs(self.name, x.student_feats, x.teacher_feats)
        if len(pairs) != len(self.connectors):
            raise KDError(f"KD loss 'fitnet' was set up for {len(self.connectors)} layer pair(s), got {len(pairs)}")
        hint = sum(
            hint_loss(connector(x.student_feats[s]), x.teacher_feats[t])
            for connector, (s, t) in zip(self.connectors, pairs)
        )
        terms = {"hint": hint}
        part = h["hint_weight"] * hint
        if h["kd_weight"]:
            assert x.teacher_logits is not None  # a method that needs_teacher always gets its logits
            terms["kd"] = kd_divergence(x.student_logits, x.teacher_logits, h["temperature"])
            part = part + h["kd_weight"] * terms["kd"]
        return part, terms
