"""One student's inputs for one step (:class:`StepInputs`), made once from the loader's batch and the
teacher source's targets by :func:`step_inputs`, and passed whole to the student side
(:class:`kd.run.sides.StudentSide`) through the backend's wrapper."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional

import torch

#: where a compiled student step finds the progress and the step in its record: the side's own forward
#: (``inputs``; torch's DistributedDataParallel leaves its own forward to eager and compiles the side's),
#: and a wrapper's ``forward(*inputs)`` that torch.compile traces around it. Marked dynamic from the first
#: compilation (:func:`compile_numbers_dynamic`), a step that reads them compiles once, not again when
#: they first change.
NUMBER_SOURCES = tuple(f"L['inputs']{at}.loss_inputs['{key}']" for key in ("progress", "step") for at in ("", "[0]"))


def compile_numbers_dynamic() -> None:
    """torch.compile takes the record's progress and step as symbolic ints from the first compilation
    (``torch.compiler.config.dynamic_sources``; a torch without it compiles a reader's step twice)."""
    config = torch.compiler.config
    if not hasattr(config, "dynamic_sources"):
        return
    given = [s for s in config.dynamic_sources.split(",") if s]
    config.dynamic_sources = ",".join(given + [s for s in NUMBER_SOURCES if s not in given])


if TYPE_CHECKING:  # what the loop hands a lane's step
    from kd.data.loader import Batch
    from kd.losses.base import DistillLoss
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
    loss: DistillLoss,
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
    fields: Dict[str, Any] = {"labels": batch.labels}
    # only where read (a compiled step guards on what it is handed); a class that does not say its own
    # card (a user's subclass of a method) may read what its parent's card does not
    said = "card" in type(loss).__dict__
    if loss.card.reads_progress or not said:
        # its whole part, an int: every method reads the epoch (floor(progress) + 1), and an int changes
        # once an epoch and can be compiled symbolic (a float is specialised at the first step)
        fields["progress"] = math.floor(progress)
    if loss.card.reads_step or not said:
        fields["step"] = step
    if targets is not None:
        fields["teacher_logits"] = targets.logits
        fields["teacher_feats"] = {k: targets.feats[k] for k in teacher_layers}
    if loss.card.uses_samples:
        assert batch.indices is not None  # every training loader names its samples
        fields["indices"] = batch.indices.to(images.device, non_blocking=True)
    second = None
    if loss.card.views == 2:  # the loaders made the strong view, the teacher forwarded it
        assert batch.second_images is not None and targets is not None
        second = prepare(batch.second_images)
        fields["second_teacher_logits"] = targets.second_logits
    classifier = str(loss.student_head) if loss.card.uses_classifier else None
    return StepInputs(images, fields, second, classifier)
