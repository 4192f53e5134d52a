"""What one training step hands back, and the hooks the loop calls around its steps."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch import nn

from kd.run.dot import clip_total

#: The key of the student's summed logits among a step's loss parts (finite iff every logit is):
#: it names the source of a non-finite loss.
LOGITS_SUM = "_student_logits_sum"


@dataclass
class StepOutput:
    """What :meth:`kd.run.lane.Lane.step` leaves on the device: the loss parts (0-dim float32: ``loss``, the
    method's terms), whether the optimizer step was skipped, the non-finite flags per source, and
    the number of images. The loop hands its hooks the step's output where one student trains; where
    several do, no loss parts and None for ``skipped`` and ``flags`` (each student's step is its own)."""

    parts: Dict[str, torch.Tensor]
    skipped: Optional[torch.Tensor]
    flags: Optional[torch.Tensor]
    images: int


class StepHook:
    """Called by the loop: after every step, and at each epoch's end with the epoch's record before
    it is logged (``kd bench``'s timer is one). ``trainer`` is the :class:`kd.run.loop.Trainer` (or
    ``kd teach``'s :class:`kd.run.teach.Teaching`)."""

    def on_teacher(self, teacher: nn.Module, cfg: Any, train_loader: Any) -> None:
        """The frozen teacher on its device, before it is fused and its precision chosen; ``cfg`` is
        the run's config (the first student's), ``train_loader`` the run's training batches."""

    def on_step(self, trainer: Any, out: StepOutput) -> None:
        pass

    def on_epoch_end(self, trainer: Any, record: Dict[str, object]) -> None:
        pass


def apply_gradients(
    precision,
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    params,
    sync: Callable[[], None],
    clip: Optional[float],
    keep_scale: Optional[torch.Tensor] = None,
    apart: Optional[torch.Tensor] = None,
    reduce_apart: Optional[Callable[[List[Optional[torch.Tensor]]], None]] = None,
) -> torch.Tensor:
    """One update from ``loss`` under the step's policy, the same for every precision; returns a
    0-dim bool tensor on the device: was it skipped.

    The precision carries out the pieces (scale and backward, unscale, the optimizer's step, the
    loss scale's update); the decisions are taken here. A step is skipped where any gradient, read
    after the sync so that every process decides alike, holds inf or NaN: a non-finite loss (the
    lane makes a refused step's gradients NaN) never reaches the weights, at any level, also where
    the precision's own scaler checks nothing (apex at a static scale). ``keep_scale`` (0-dim bool):
    the step was refused for a cause the loss scale did not make, so the scale does not back off.
    ``params``: the model's trainable parameters (their gradients, or the float32 masters', are
    clipped to ``clip``); ``sync`` reduces the gradients across processes.

    ``apart``: a second part of the loss whose gradients the optimizer keeps apart from ``loss``'s
    (DOT's distillation part, :mod:`kd.run.dot`; ``loss`` is then the label part): back-propagated
    first by the precision, off ``.grad``, averaged across processes by ``reduce_apart``, unscaled
    and checked with the rest (inf or NaN in either skips the step), clipped together with
    ``loss``'s (the norm of their sum) and handed to the optimizer's ``hold`` before its step.
    """
    params = list(params)
    kept = None
    if apart is not None:
        kept = precision.gradients_apart(apart, params)
        if reduce_apart is not None:
            reduce_apart(kept)
    precision.backward(loss, sync)
    grads, found = precision.unscale(optimizer, params, *([kept] if kept is not None else []))
    if kept is not None:
        if clip:
            clip_total(grads, kept, clip)
        optimizer.hold(grads, kept)  # type: ignore[attr-defined]  # a kd.run.dot.DistillationOrientedSGD
    elif clip:
        torch.nn.utils.clip_grad_norm_(grads, clip)
    precision.optimizer_step(optimizer, found)
    precision.update(found, keep_scale)
    precision.finish(optimizer)
    return found > 0


def check_batch(batch, log, empty_ok: bool = False) -> None:
    """Unreadable images of a batch named through ``log``; a batch of nothing else stops the run
    unless ``empty_ok`` (the caller finds a :func:`stand_in`)."""
    from kd.errors import KDError

    for path in batch.bad:
        log(f"skipped unreadable image {path}")
    if len(batch) == 0 and not empty_ok:
        raise KDError("a whole batch of images was unreadable; check the data folder")


def stand_in(empty, last, batches: Iterator, ahead: List, log):
    """What a process trains on where every image of its batch ``empty`` was unreadable, so that it
    steps with the others (under DDP it cannot skip a step alone): the last readable batch ``last``,
    else the next one drawn from ``batches`` (put in ``ahead``, trained on again at its own step).
    Its unreadable files stay counted; a KDError where no readable batch comes."""
    from kd.errors import KDError

    which = "the previous batch"
    if last is None:
        last = next(batches, None)
        if last is None or len(last) == 0:
            raise KDError("a whole batch of images was unreadable, and the next one too; check the data folder")
        ahead.append(last)
        which = "the next batch"
    log(f"no readable image in this batch: {which} stands in for it")
    return dataclasses.replace(last, bad=list(empty.bad))


class BufferGuard:
    """The buffers a training forward changes (BatchNorm's running statistics and its counter),
    saved before each step and put back where the step is skipped, so that a skipped step leaves
    the model exactly as it was. All on the device, no host sync: :meth:`save` before the
    forward, :meth:`check` after it, :meth:`restore` once the step's fate is known. One flat copy
    per dtype, so a step costs a few kernels whatever the number of layers."""

    def __init__(self, module: nn.Module):
        self.module = module
        self._groups: List[List[torch.Tensor]] = []
        self._saved: List[torch.Tensor] = []
        self._now: List[torch.Tensor] = []

    def refresh(self) -> None:
        """Collect the buffers again, after anything that may have replaced them (a cast, a resume)."""
        groups: Dict[torch.dtype, List[torch.Tensor]] = {}
        for buf in self.module.buffers():
            if buf is not None and buf.numel():
                groups.setdefault(buf.dtype, []).append(buf)
        self._groups = list(groups.values())

    def _flat(self) -> List[torch.Tensor]:
        return [torch.cat([b.detach().reshape(-1) for b in group]) for group in self._groups]

    def save(self) -> None:
        """Before the step's forward."""
        self._saved = self._flat()

    def check(self) -> Optional[torch.Tensor]:
        """After the forward: a 0-dim bool on the device, true where every floating buffer is finite
        (None for a model without floating buffers)."""
        self._now = self._flat()
        checks = [torch.isfinite(flat).all() for flat in self._now if flat.is_floating_point()]
        return torch.stack(checks).all() if checks else None

    @torch.no_grad()
    def restore(self, skipped: torch.Tensor) -> None:
        """Every buffer back to its value at :meth:`save` where ``skipped`` (0-dim bool) is true."""
        for group, saved, now in zip(self._groups, self._saved, self._now):
            kept = torch.where(skipped, saved, now)
            torch._foreach_copy_(group, [v.view_as(b) for v, b in zip(kept.split([b.numel() for b in group]), group)])
        self._saved = self._now = []
