"""A teacher source: what the students of a run learn from, for one batch.

The loop asks the run's source for each batch's :data:`Targets` once and hands them to every
student that learns from a teacher; it never knows whether they were computed or replayed. Two
sources implement it: the live frozen teacher (:class:`kd.teacher.frozen.Teacher`: one forward,
the union of every student's taps) and the soft-label store (:class:`kd.teacher.store.SoftLabels`:
the logits it kept for the epoch's crops; methods that need features or a second view are refused
before a run).
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Protocol

import torch


class Targets(NamedTuple):
    """The teacher's outputs for one batch: float32 logits (batch x classes), the tapped features by
    layer name, and where the batch holds a second view of each sample (:mod:`kd.data.views`), the
    float32 logits of that view (from the same teacher, once for every student); else None."""

    logits: torch.Tensor
    feats: Dict[str, torch.Tensor]
    second_logits: Optional[torch.Tensor] = None


class TeacherSource(Protocol):
    def set_epoch(self, epoch: int) -> None:
        """The epoch the next batches belong to (a store keeps each epoch's crops apart)."""

    def targets(self, batch) -> Targets:
        """The teacher's outputs for ``batch`` (a :class:`kd.data.loader.Batch`), on the run's device."""

    def close(self) -> None:
        """Whatever it holds open (loaders, memory maps) released."""
