"""A teacher source: what the students of a run learn from, for one batch.

The loop asks the run's source for each batch's :data:`Targets` once and hands them to every
student that learns from a teacher; it never knows whether they were computed or replayed. Two
sources implement it: the live frozen teacher (:class:`kd.teacher.frozen.Teacher`: one forward,
the union of every student's taps) and the soft-label store (:class:`kd.teacher.store.SoftLabels`:
the logits it kept for the epoch's crops; methods that need features are refused before a run).
"""

from __future__ import annotations

from typing import Dict, Protocol, Tuple

import torch

#: float32 logits (batch x classes) and the tapped features by layer name
Targets = Tuple[torch.Tensor, Dict[str, torch.Tensor]]


class TeacherSource(Protocol):
    def set_epoch(self, epoch: int) -> None:
        """The epoch the next batches belong to (a store keeps each epoch's crops apart)."""

    def targets(self, batch) -> Targets:
        """The teacher's outputs for ``batch`` (a :class:`kd.data.loader.Batch`), on the run's device."""

    def close(self) -> None:
        """Whatever it holds open (loaders, memory maps) released."""
