"""The student side of a KD step as one module (the frozen teacher's is :class:`kd.teacher.frozen.TeacherSide`)."""

from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn

from kd.losses.base import DistillInputs, DistillLoss
from kd.run.step import LOGITS_SUM
from kd.utils.taps import tap


class StudentSide(nn.Module):
    """The trainable side: the student and the loss with its connectors.

    The backend wraps this one module, so connector gradients are synchronised with the
    student's; the forward returns the loss parts, so DataParallel replicas compute them too.
    """

    def __init__(self, student: nn.Module, loss: DistillLoss, layers: List[str]):
        super().__init__()
        self.student = student
        self.loss = loss
        self.layers = layers

    def forward(
        self,
        images,
        labels,
        teacher_logits=None,
        teacher_feats=None,
        progress: float = 0.0,
        indices=None,
        step: int = 0,
        second_images=None,
        second_teacher_logits=None,
    ):
        """The loss parts of one batch; ``second_images``: each sample's second view, which the
        student forwards too (a second call, as a loss with ``views = 2`` asks)."""
        feats: Dict[str, torch.Tensor] = {}
        with tap(self.student, self.layers, feats):
            logits = self.student(images)
        distill = None
        if isinstance(logits, tuple):  # a distillation token's student, both heads (reads_distill_head)
            logits, distill = logits
        feats = {k: feats[k] for k in self.layers}  # spec order: the losses pair by position
        second = None if second_images is None else self.student(second_images)
        inputs = DistillInputs(logits, labels, teacher_logits, feats, teacher_feats or {}, progress, indices, step)
        inputs.second_student_logits, inputs.second_teacher_logits = second, second_teacher_logits
        if self.loss.card.uses_classifier:  # this replica's own classifier: its cell scores train it
            inputs.student_classifier = self.student.get_submodule(str(self.loss.student_head))
        inputs.distill_logits = distill
        parts = self.loss(inputs)
        parts[LOGITS_SUM] = logits.detach().float().sum()  # finite iff every logit is: names a non-finite loss's source
        for more in (second, distill):
            if more is not None:
                parts[LOGITS_SUM] = parts[LOGITS_SUM] + more.detach().float().sum()
        return parts
