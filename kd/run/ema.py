"""An exponential moving average of a student's weights (``--model-ema``), as timm's
:class:`timm.utils.ModelEmaV3` keeps it, updated inside the step without a host sync.

As ModelEmaV3: every floating tensor of the student's state dict (parameters and buffers) moves
towards the student's by ``1 - decay`` after each optimizer step, integer buffers (BatchNorm's
counter) are copied. The decay of the n-th step (counted from 1, as timm's ``train.py`` counts
``num_updates``) is 0 at the first (the average starts as the weights after it), then ``decay``;
with warm-up, ``min(decay, 1 - n ** (-2/3))`` (timm's ``warmup_gamma`` 1 and ``warmup_power`` 2/3).

What kd adds: the update's weight is multiplied on the device by the step's "stepped" flag, so that
a step the step's policy skipped leaves the average exactly as it was, and no flag is read on the
host; the weights of the coming steps are computed on the host a block at a time and copied to the
device once a block. The average is float32 on the student's device, follows the float32 master
weights where the precision keeps them (O2), and is checkpointed and restored exactly. The update is
``ema * (1 - w) + student * w`` in three multi-tensor kernels, ModelEmaV3's formula for an average
whose dtype differs from the model's: equal to its ``lerp`` to float32 rounding.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

#: steps whose update weights are copied to the device at once
BLOCK = 1024


class ModelEma:
    """The moving average of ``student`` (the unwrapped model, not a backend's wrapper), a float32
    copy on its device; ``precision`` names the master weights it follows (:meth:`kd.precision.Precision.masters`)."""

    def __init__(self, student: nn.Module, precision, decay: float, warmup: bool):
        self.module = copy.deepcopy(student).float().eval().requires_grad_(False)
        #: its forward for evaluation: the module's own, or the backend's forward-only wrapper of it (the build's)
        self.forward: Callable[[torch.Tensor], Any] = self.module
        self.student = student
        self.precision = precision
        self.decay = decay
        self.warmup = warmup
        # (average's floats, student's, average's integers, student's, whether a student's float is not float32)
        self._pairs: Optional[tuple] = None
        self._weights: Optional[torch.Tensor] = None  # 1 - decay of steps _first, _first + 1, ...
        self._first = 0

    def decay_at(self, step: int) -> float:
        """The decay of optimizer step ``step`` (from 1): ModelEmaV3's ``get_decay(step)``."""
        step = max(0, step - 1)
        if step <= 0:
            return 0.0
        if self.warmup:
            return max(min(1 - (1 + step) ** -(2 / 3), self.decay), 0.0)
        return self.decay

    def refresh(self) -> None:
        """Pair the average's tensors with the student's again at the next update (after a cast, a resume)."""
        self._pairs = None

    def _pair(self) -> tuple:
        masters = self.precision.masters(self.student)
        own = self.student.state_dict()
        floats: List[torch.Tensor] = []
        sources: List[torch.Tensor] = []
        ints: List[torch.Tensor] = []
        counts: List[torch.Tensor] = []
        for key, value in self.module.state_dict().items():
            source = masters.get(key, own[key])
            (floats if value.is_floating_point() else ints).append(value)
            (sources if value.is_floating_point() else counts).append(source)
        return floats, sources, ints, counts, any(s.dtype != torch.float32 for s in sources)

    def _weight(self, step: int) -> torch.Tensor:
        """``1 - decay`` of step ``step`` as a 0-dim float32 tensor on the device (a view of a block)."""
        index = step - self._first
        if self._weights is None or not 0 <= index < len(self._weights):
            self._first, index = step, 0
            block = torch.tensor([1.0 - self.decay_at(s) for s in range(step, step + BLOCK)], dtype=torch.float32)
            device = next(self.module.parameters()).device
            self._weights = block.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else block
        return self._weights[index]

    @torch.no_grad()
    def update(self, step: int, skipped: torch.Tensor) -> None:
        """After optimizer step ``step`` (from 1); ``skipped`` (0-dim bool on the device): the step's
        policy skipped it, and the average stays as it was. No host sync."""
        if self._pairs is None:
            self._pairs = self._pair()
        floats, sources, ints, counts, cast = self._pairs
        weight = self._weight(step) * ~skipped
        if cast:  # O3's weights, a buffer cast with them
            sources = [s.float() for s in sources]
        torch._foreach_mul_(floats, 1.0 - weight)
        torch._foreach_add_(floats, torch._foreach_mul(sources, weight))
        if ints:
            torch._foreach_copy_(ints, counts)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """The average's state dict (the student's keys), float32: what a checkpoint holds as ``state_dict_ema``."""
        return self.module.state_dict()

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state)
        self.refresh()
