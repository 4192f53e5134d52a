"""The student side of a KD step: its inputs for one step, made once (:func:`step_inputs`), and the module
that turns them into the loss parts (the frozen teacher's side is :class:`kd.teacher.frozen.TeacherSide`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional

import torch
from torch import nn

from kd.losses.base import DistillInputs
from kd.run.step import LOGITS_SUM
from kd.utils.taps import tap

if TYPE_CHECKING:  # what the loop hands a lane's step
    from kd.data.loader import Batch
    from kd.teacher.source import Targets


class StepInputs(NamedTuple):
    """One student's inputs for one step, passed whole through the backend's wrapper: DataParallel
    scatters it field by field (each tensor along the batch, a dict key by key; numbers and None go to
    every replica as they are), DDP and apex pass it on as it is.

    ``images``: what the student forwards, normalised and cast for it; ``loss_inputs``: the
    :class:`kd.losses.base.DistillInputs` fields that come from the batch and the teacher (labels,
    the teacher's logits and features, indices, progress, step, ...), by field name: the student side
    adds its own outputs and hands the loss the whole; ``second_images``: each sample's second view,
    which the student forwards too, where the method reads one (None otherwise); ``classifier``: the
    name of the student's linear classifier, which each replica hands the loss as its own
    (``student_classifier``), for the methods whose cell scores train it (None otherwise)."""

    images: torch.Tensor
    loss_inputs: Dict[str, Any]
    second_images: Optional[torch.Tensor] = None
    classifier: Optional[str] = None


def step_inputs(
    batch: Batch,
    targets: Optional[Targets],
    loss: nn.Module,
    teacher_layers: List[str],
    prepare: Callable[[torch.Tensor], torch.Tensor],
    progress: float,
    step: int,
) -> StepInputs:
    """Everything one step of a student with ``loss`` reads of the loader's ``batch`` (mixed, where
    mixup is on) and the teacher source's ``targets`` (None for a student alone), in one record; the
    one place where the engine reads what the method needs of a step. ``teacher_layers``: the
    teacher's taps the loss pairs with the student's; ``prepare``: images as the student takes them
    (its normalisation and its precision's input cast); ``progress``: the training progress in
    epochs; ``step``: the optimizer step it trains. The teacher's logits are float32 as the source
    gives them (:class:`kd.teacher.source.Targets`), never cast again."""
    images = prepare(batch.images)
    fields: Dict[str, Any] = {"labels": batch.labels, "progress": progress, "step": step}
    if targets is not None:
        fields["teacher_logits"] = targets.logits
        fields["teacher_feats"] = {k: targets.feats[k] for k in teacher_layers}
    if getattr(loss, "uses_samples", False):
        assert batch.indices is not None  # every training loader names its samples
        fields["indices"] = batch.indices.to(images.device, non_blocking=True)
    second = None
    if getattr(loss, "views", 1) == 2:  # the loaders made the strong view, the teacher forwarded it
        assert batch.second_images is not None and targets is not None
        second = prepare(batch.second_images)
        fields["second_teacher_logits"] = targets.second_logits
    classifier = str(loss.student_head) if getattr(loss, "uses_classifier", False) else None
    return StepInputs(images, fields, second, classifier)


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

    def forward(self, inputs: StepInputs) -> Dict[str, torch.Tensor]:
        """The loss parts of one step's :class:`StepInputs`: the student forwards its images (and the
        second view, where the record holds one), and the loss sees its outputs with the record's
        ``loss_inputs``."""
        feats: Dict[str, torch.Tensor] = {}
        with tap(self.student, self.layers, feats):
            logits = self.student(inputs.images)
        distill = None
        if isinstance(logits, tuple):  # a distillation token's student, both heads (reads_distill_head)
            logits, distill = logits
        feats = {k: feats[k] for k in self.layers}  # spec order: the losses pair by position
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
