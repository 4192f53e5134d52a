"""What one training step hands back, and the hooks the loop calls around its steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from torch import nn


@dataclass
class StepOutput:
    """What :meth:`Trainer.step` leaves on the device: the loss parts (0-dim float32: ``loss``, the
    method's terms), whether the optimizer step was skipped, the non-finite flags per source, and
    the number of images. The step of several students (:mod:`kd.multi`) hands its hooks no loss
    parts and None for ``skipped`` and ``flags``: each student's optimizer step is its own."""

    parts: Dict[str, torch.Tensor]
    skipped: Optional[torch.Tensor]
    flags: Optional[torch.Tensor]
    images: int


class StepHook:
    """Called by the loop: after every :meth:`Trainer.step`, and at each epoch's end with the epoch's
    record before it is logged (``kd bench``'s timer is one). ``trainer`` is the :class:`kd.engine.Trainer`."""

    def on_teacher(self, trainer: Any, teacher: nn.Module) -> None:
        """The frozen teacher on its device, before it is fused and its precision chosen."""

    def on_step(self, trainer: Any, out: StepOutput) -> None:
        pass

    def on_epoch_end(self, trainer: Any, record: Dict[str, object]) -> None:
        pass


def check_batch(batch, log) -> None:
    """Unreadable images of a batch named through ``log``; a batch of nothing else stops the run."""
    from kd.errors import KDError

    for path in batch.bad:
        log(f"skipped unreadable image {path}")
    if len(batch) == 0:
        raise KDError("a whole batch of images was unreadable; check the data folder")
