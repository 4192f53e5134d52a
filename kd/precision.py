"""Opt levels as apex users know them, on native torch.amp.

One precision object per run owns everything about reduced precision: the autocast context,
casting of the models, the loss scaler and the step sequence (scale, backward, gradient sync,
unscale, clip, step, update, zero). Nothing else calls ``autocast`` or ``scaler.*``.

| level | meaning |
|---|---|
| O0 | float32 everywhere |
| O1 | float32 weights, autocast, dynamic loss scaling (float16) |
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch
from torch import nn

from kd.errors import KDError

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def amp_dtype(cfg, device: torch.device) -> torch.dtype:
    """float16 on CUDA (as apex), bfloat16 on the CPU, unless ``--amp-dtype`` says otherwise."""
    name = cfg.amp_dtype or ("float16" if device.type == "cuda" else "bfloat16")
    if device.type == "cpu" and name == "float16" and cfg.opt != "O0":
        raise KDError("--amp-dtype float16 needs CUDA; on the CPU use --amp-dtype bfloat16")
    return DTYPES[name]


class Precision:
    """Base class: float32, no scaler. Subclasses override what their level changes."""

    opt = "O0"
    impl = "native"

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32):
        self.device = device
        self.dtype = dtype
        self.scaler = None

    def describe(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return f"precision {self.opt} ({self.impl}, {dtype}{', loss scaling' if self.scaler else ''})"

    def autocast(self):
        """Context for the forward passes of teacher and student."""
        return contextlib.nullcontext()

    def prepare_teacher(self, teacher: nn.Module) -> nn.Module:
        return teacher

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Tuple[nn.Module, torch.optim.Optimizer]:
        """Called once, after the optimizer is built and before the backend wraps the model."""
        return model, optimizer

    def input_cast(self, images: torch.Tensor) -> torch.Tensor:
        return images

    def step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor],
             sync: Callable[[], None], clip: Optional[float]) -> torch.Tensor:
        """The whole update for one batch; returns a 0-dim bool tensor: was the step skipped."""
        scaler = self.scaler
        (scaler.scale(loss) if scaler else loss).backward()
        sync()
        if clip:
            if scaler:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(list(params), clip)
        if scaler:
            scale_before = scaler._scale.clone()
            scaler.step(optimizer)
            scaler.update()
            skipped = scaler._scale < scale_before
        else:
            optimizer.step()
            skipped = torch.zeros((), dtype=torch.bool, device=self.device)
        optimizer.zero_grad(set_to_none=True)
        return skipped

    def loss_scale(self) -> Optional[torch.Tensor]:
        return self.scaler._scale if self.scaler is not None and self.scaler._scale is not None else None

    def model_state(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        """The float32 weights to checkpoint (master weights where the level keeps them)."""
        return model.state_dict()

    def load_model_state(self, model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
        model.load_state_dict(state)

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict()} if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


class AutocastPrecision(Precision):
    """O1: float32 weights, ops in reduced precision where torch.autocast deems it safe."""

    opt = "O1"

    def __init__(self, device: torch.device, dtype: torch.dtype):
        super().__init__(device, dtype)
        if dtype == torch.float16:
            self.scaler = torch.amp.GradScaler(device.type)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype)


def make_precision(cfg, device: torch.device, prefer_apex: bool = False) -> Precision:
    """The precision object for ``cfg.opt``: native, or real apex.amp where asked and installed.

    ``prefer_apex`` is the backend's wish (apex_ddp); ``--amp-impl`` decides when given.
    """
    if cfg.opt == "O0":
        return Precision(device)
    dtype = amp_dtype(cfg, device)
    if cfg.opt == "O1":
        return AutocastPrecision(device, dtype)
    raise KDError(f"--opt {cfg.opt} is not available yet; use O0 or O1")
