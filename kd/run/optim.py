"""SGD (or DOT's) with decay on weights only (unless asked), and per-step LR schedules with warm-up."""

from __future__ import annotations

import bisect
import math
from typing import Iterable, List, Optional, Tuple

import torch
from torch import nn


def param_groups(named: Iterable[Tuple[str, nn.Parameter]], weight_decay: float, wd_bn_bias: bool):
    """Two groups: weights (decayed) and BatchNorm/bias parameters (decayed only with ``wd_bn_bias``)."""
    decay: List[nn.Parameter] = []
    no_decay: List[nn.Parameter] = []
    for _, p in named:
        if not p.requires_grad:
            continue
        (decay if p.ndim > 1 or wd_bn_bias else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(cfg, named_params, fused_ok: bool = True) -> torch.optim.Optimizer:
    """SGD, fused where torch has fused kernels for the parameters' device (CUDA, and the CPU
    since torch 2.4) unless ``fused_optimizer`` says no, else foreach; with ``dot``, DOT's
    two-momentum SGD (:class:`kd.run.dot.DistillationOrientedSGD`).

    The fused kernel takes an inf flag on the device (the GradScaler's, or kd's own check at
    levels without one), so a skipped step needs no host synchronisation (the foreach path
    reads the flag with ``.item()``). ``fused_ok`` is False for precisions that patch the
    optimizer themselves (apex.amp).
    """
    groups = param_groups(named_params, cfg.weight_decay, cfg.wd_bn_bias)
    if cfg.dot:  # its own step, on the label and the distillation gradients (config refuses fused with it)
        from kd.run.dot import DistillationOrientedSGD

        return DistillationOrientedSGD(groups, lr=cfg.lr, momentum=cfg.momentum, delta=cfg.dot_delta)
    supported = fused_devices()
    on_fused_device = all(p.device.type in supported for g in groups for p in g["params"])
    fused = fused_ok and on_fused_device and cfg.fused_optimizer is not False
    if cfg.fused_optimizer and not fused:
        from kd.errors import KDError

        raise KDError(
            f"fused_optimizer=true needs every trainable parameter on a device with fused SGD "
            f"({', '.join(sorted(supported))}) and a precision other than apex.amp"
        )
    kind = {"fused": True} if fused else {"foreach": True}
    optimizer = torch.optim.SGD(
        groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0, **kind
    )
    if fused:
        zero_momentum_buffers(optimizer)
    return optimizer


def fused_devices() -> set:
    """Device types with torch's fused SGD kernels."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # pragma: no cover - a torch that moved it
        return {"cuda"}
    return set(_get_fused_kernels_supported_devices())


def zero_momentum_buffers(optimizer: torch.optim.SGD) -> None:
    """Give every parameter a zero momentum buffer just before the first step (for fused SGD).

    torch's fused SGD creates its buffers with ``empty_like`` inside its first step and fills
    them in the same kernel, which does nothing when the GradScaler reports inf gradients. A
    skipped first step (the usual case: float16 loss scaling starts at 2**16) therefore leaves
    uninitialised memory that the next step reads as momentum, and the weights become NaN.
    Zero buffers give the same first update (``buf = momentum * 0 + grad``; only without
    dampening) and are harmless to skip. They are made by a step pre-hook, so they take the
    dtype the parameters have by then (O3 casts them after the optimizer is built) and a
    resumed optimizer state is kept.
    """
    if not all(g["momentum"] and not g["dampening"] for g in optimizer.param_groups):
        return
    first = True

    @torch.no_grad()
    def before_step(opt, args, kwargs):
        nonlocal first
        if first:
            for group in opt.param_groups:
                for p in group["params"]:
                    if "momentum_buffer" not in opt.state[p]:
                        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
            first = False

    optimizer.register_step_pre_hook(before_step)


def lr_factor(cfg, epoch: float, step_epochs: float = 0.0) -> float:
    """The LR multiplier of the step that starts at fractional ``epoch`` (one step is ``step_epochs``
    long) for the configured schedule. The linear warm-up counts the step itself: its first step
    trains at ``1/n`` of the lr and its last at the full lr (n warm-up steps), as torchvision's
    ``LinearLR(start_factor=1/n, total_iters=n-1)`` does, not at zero."""
    warm = cfg.warmup_epochs
    if warm > 0 and epoch < warm:
        return min((epoch + step_epochs) / warm, 1.0)
    if cfg.lr_schedule == "step":
        return cfg.lr_gamma ** bisect.bisect_right(sorted(cfg.lr_milestones), math.floor(epoch + 1e-9))
    if cfg.lr_schedule == "cosine":
        span = max(cfg.epochs - warm, 1e-8)
        return 0.5 * (1.0 + math.cos(math.pi * min(max(epoch - warm, 0.0) / span, 1.0)))
    return 1.0


def build_scheduler(cfg, optimizer, steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Stepped once per optimizer step; ``steps_per_epoch`` converts steps to epochs."""
    steps = max(steps_per_epoch, 1)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg, step / steps, 1 / steps))


def lr_note(cfg) -> Optional[str]:
    """The line that says the run keeps its recipe's lr at another batch than the recipe's (kd changes
    no recipe value the user did not), with the lr the linear scaling rule would give; None where the
    lr is the user's or the batch the recipe's."""
    if cfg.lr_for_batch is None or cfg.recipe is None or cfg.lr_for_batch == cfg.batch_size:
        return None
    scaled = cfg.lr * cfg.batch_size / cfg.lr_for_batch
    return (
        f"lr {cfg.lr:g} is recipe {cfg.recipe}'s for batch {cfg.lr_for_batch}; this run's batch is "
        f"{cfg.batch_size} and kd keeps lr {cfg.lr:g} (the linear rule gives --lr {scaled:g})"
    )
