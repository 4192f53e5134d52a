"""A student's training state: where its training stands, beyond the state of its modules and
optimizer; what a checkpoint saves and a resume restores (:mod:`kd.run.checkpoint`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Set, Tuple


@dataclass
class TrainState:
    """Where a student's training stands, beyond its modules' and optimizer's state: what its
    checkpoint saves and a resume restores (:mod:`kd.run.checkpoint`)."""

    epoch: int = 0
    batch_in_epoch: int = 0
    global_step: int = 0
    best_top1: float = -1.0
    best_epoch: Optional[int] = None  # the epoch (counted from 1) best.pt holds
    bad_files: Set[str] = field(default_factory=set)  # the unreadable files met so far, on every process
    # an epoch trained whose validation a stop cut short: its training totals and seconds
    pending_epoch: Optional[Tuple[Dict[str, float], float]] = None

    @property
    def position(self) -> Tuple[int, int]:
        """(epoch, batch in epoch) where training goes on: an epoch whose validation is pending counts as ended."""
        if self.pending_epoch is not None:
            return self.epoch + 1, 0
        return self.epoch, self.batch_in_epoch
