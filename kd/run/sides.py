"""The two sides of a KD step as modules: the trainable student side and the frozen teacher side."""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from kd import models
from kd.losses import DistillInputs, DistillLoss, build_loss, split_layers
from kd.run.features import check_layers, layer_names, tap

LOGITS_SUM = "_student_logits_sum"


class StudentSide(nn.Module):
    """The trainable side: the student and the loss with its connectors.

    The backend wraps this one module, so connector gradients are synchronised with the
    student's; the forward returns the loss parts, so DataParallel replicas compute them too.
    """

    def __init__(self, student: nn.Module, loss: nn.Module, layers: List[str]):
        super().__init__()
        self.student = student
        self.loss = loss
        self.layers = layers

    def forward(self, images, labels, teacher_logits=None, teacher_feats=None, progress: float = 0.0):
        feats: Dict[str, torch.Tensor] = {}
        with tap(self.student, self.layers, feats):
            logits = self.student(images)
        feats = {k: feats[k] for k in self.layers}  # spec order: the losses pair by position
        parts = self.loss(DistillInputs(logits, labels, teacher_logits, feats, teacher_feats or {}, progress))
        parts[LOGITS_SUM] = logits.detach().float().sum()  # finite iff every logit is: names a non-finite loss's source
        return parts


class TeacherSide(nn.Module):
    """The frozen teacher: logits cast to float32 for the KD softmax, plus tapped features."""

    def __init__(self, teacher: nn.Module, layers: List[str]):
        super().__init__()
        self.teacher = teacher
        self.layers = layers

    def forward(self, images: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        feats: Dict[str, torch.Tensor] = {}
        with tap(self.teacher, self.layers, feats):
            logits = self.teacher(images)
        feats = {k: feats[k] for k in self.layers}
        return logits.float(), feats


def setup_feature_layers(
    loss: DistillLoss, student: nn.Module, teacher: Optional[nn.Module], cfg
) -> Tuple[List[str], List[str]]:
    """(student layers, teacher layers) to tap for a feature method (``--feature-layers`` or the
    method's default); builds the loss's connectors from a dry run. Empty for logit methods."""
    if not loss.uses_features:
        return [], []
    assert teacher is not None  # a feature method needs a teacher (needs_teacher), so build_models made one
    specs = cfg.feature_layers or loss.default_layers(layer_names(student), layer_names(teacher))
    s_layers, t_layers = split_layers(specs)
    check_layers(student, s_layers, f"student {cfg.student}")
    check_layers(teacher, t_layers, f"teacher {cfg.teacher}")
    probe = torch.zeros(2, 3, cfg.image_size, cfg.image_size)
    shapes = []
    for model, layers in ((student, s_layers), (teacher, t_layers)):
        was_training = model.training
        model.eval()
        feats: Dict[str, torch.Tensor] = {}
        with torch.no_grad(), tap(model, layers, feats):
            model(probe)
        model.train(was_training)
        shapes.append({k: feats[k].shape for k in layers})
    loss.setup_features(*shapes)
    return s_layers, t_layers


def build_models(cfg, num_classes: int, teacher: Optional[nn.Module] = None):
    """(student, loss, frozen teacher or None, student layers, teacher layers to tap), on the CPU.
    ``teacher``: the frozen teacher already built (for another student of the same run), or None."""
    loss_args = cfg.loss_kwargs()
    if cfg.no_teacher:  # KD hyper-parameters (from a recipe, say) mean nothing without a teacher
        from kd.losses.kd import CrossEntropy

        loss_args = {k: v for k, v in loss_args.items() if k in CrossEntropy.defaults}
    loss = build_loss("ce" if cfg.no_teacher else cfg.kd_loss, num_classes, loss_args)
    with seeded(cfg.seed):
        student = models.build(cfg.student, num_classes, cfg.student_weights)
    if not loss.needs_teacher:
        teacher = None
    elif teacher is None:
        with seeded(cfg.seed + 1):  # a teacher without weights: the same whichever student builds it
            teacher = models.freeze(models.build(cfg.teacher, num_classes, cfg.teacher_weights))
    with seeded(cfg.seed + 2):  # the connectors: the same whether or not this student built the teacher
        s_layers, t_layers = setup_feature_layers(loss, student, teacher, cfg)
    return student, loss, teacher, s_layers, t_layers


@contextlib.contextmanager
def seeded(seed: int):
    """torch's CPU generator at ``seed`` inside, back where it was after: each part of a run is drawn
    from its own position, so a student built beside others equals its own run."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
