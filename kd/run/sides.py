"""The student side of a KD step as one module, which turns a step's inputs (:class:`kd.run.record.StepInputs`)
into the loss parts (the frozen teacher's side is :class:`kd.teacher.frozen.TeacherSide`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List

import torch
from torch import nn

from kd.losses.base import DistillInputs, DistillLoss
from kd.run.step import LOGITS_SUM
from kd.utils.taps import Taps

if TYPE_CHECKING:  # made by kd.run.record.step_inputs
    from kd.run.record import StepInputs


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
        self.taps = Taps(student, layers)  # hooks torch.compile traces with the forward

    def forward(self, inputs: StepInputs) -> Dict[str, torch.Tensor]:
        """The loss parts of one step's :class:`StepInputs`: the student forwards its images (and the
        second view, where the record holds one), and the loss sees its outputs with the record's
        ``loss_inputs``."""
        self.taps.arm(self.student)
        logits = self.student(inputs.images)
        feats = self.taps.take(self.student)  # spec order: the losses pair by position
        distill = None
        if isinstance(logits, tuple):  # a distillation token's student, both heads (reads_distill_head)
            logits, distill = logits
        second = None if inputs.second_images is None else self.student(inputs.second_images)
        # this replica's own classifier, where the loss trains it through its cell scores
        classifier = None if inputs.classifier is None else self.student.get_submodule(inputs.classifier)
        x = DistillInputs(
            student_logits=logits,
            student_feats=feats,
            second_student_logits=second,
            student_classifier=classifier,
            distill_logits=distill,
            **inputs.loss_inputs,
        )
        parts = self.loss(x)
        parts[LOGITS_SUM] = logits.detach().float().sum()  # finite iff every logit is: names a non-finite loss's source
        for more in (second, distill):
            if more is not None:
                parts[LOGITS_SUM] = parts[LOGITS_SUM] + more.detach().float().sum()
        return parts
