"""The optimizer and its per-step LR schedule.

``--optimizer sgd`` (the default) is kd's SGD as torchvision's reference builds it (or DOT's), with
decay on weights only unless asked; any other name is timm's ``create_optimizer_v2`` (adamw, lamb,
...) on the parameter groups timm makes (no decay on norms and biases, ``--layer-decay``). The
schedules: step, cosine and constant as torchvision's reference steps them, and timm-cosine as
timm's ``CosineLRScheduler`` steps per update (``--warmup-lr``, ``--min-lr``).
"""

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


def build_optimizer(cfg, side: nn.Module, fused_ok: bool = True) -> torch.optim.Optimizer:
    """The optimizer of ``side`` (a :class:`kd.run.sides.StudentSide`: the student and its loss's
    modules): kd's SGD, or timm's optimizer ``cfg.optimizer``.

    SGD is fused where torch has fused kernels for the parameters' device (CUDA, and the CPU
    since torch 2.4) unless ``fused_optimizer`` says no, else foreach; with ``dot``, DOT's
    two-momentum SGD (:class:`kd.run.dot.DistillationOrientedSGD`). The fused kernel takes an inf
    flag on the device (the GradScaler's, or kd's own check at levels without one), so a skipped
    step needs no host synchronisation (the foreach path reads the flag with ``.item()``).
    ``fused_ok`` is False for precisions that patch the optimizer themselves (apex.amp).
    """
    if cfg.layer_decay is not None or cfg.optimizer != "sgd":
        groups = timm_groups(cfg, side)
    else:
        groups = param_groups(side.named_parameters(), cfg.weight_decay, cfg.wd_bn_bias)
    if cfg.dot:  # its own step, on the label and the distillation gradients (config refuses fused with it)
        from kd.run.dot import DistillationOrientedSGD

        return DistillationOrientedSGD(groups, lr=cfg.lr, momentum=cfg.momentum, delta=cfg.dot_delta)
    supported = fused_devices()
    on_fused_device = all(p.device.type in supported for g in groups for p in g["params"])
    has_fused = cfg.optimizer in FUSED
    fused = fused_ok and on_fused_device and has_fused and cfg.fused_optimizer is not False
    if cfg.fused_optimizer and not fused:
        from kd.errors import KDError

        raise KDError(
            f"fused_optimizer=true needs --optimizer {' or '.join(FUSED)}, every trainable parameter on a device "
            f"with fused kernels ({', '.join(sorted(supported))}) and a precision other than apex.amp"
        )
    kind = {"fused": True} if fused else {"foreach": True}
    if cfg.optimizer != "sgd":
        from timm.optim import create_optimizer_v2

        extra = {k: v for k, v in (("eps", cfg.opt_eps), ("betas", cfg.opt_betas)) if v is not None}
        if "betas" in extra:
            extra["betas"] = tuple(extra["betas"])
        if fused:  # timm passes it on to torch's Adam and AdamW
            extra["fused"] = True
        return create_optimizer_v2(  # each group carries its weight decay, as timm's own groups do
            groups, opt=cfg.optimizer, lr=cfg.lr, weight_decay=0.0, momentum=cfg.momentum,
            foreach=None if fused else True, **extra,
        )  # fmt: skip
    optimizer = torch.optim.SGD(
        groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0, **kind
    )
    if fused:
        zero_momentum_buffers(optimizer)
    return optimizer


def check_optimizer(cfg) -> None:
    """Before any work: ``--optimizer`` is sgd or an optimizer timm knows, and ``--layer-decay`` has a
    student that orders its layers (timm's ``group_matcher``; built on the meta device to ask)."""
    from kd.errors import KDError, suggest

    if cfg.optimizer != "sgd":
        from timm.optim import list_optimizers

        names = [str(n) for n in list_optimizers()]
        if cfg.optimizer not in names:
            raise KDError(
                f"--optimizer {cfg.optimizer} is neither sgd nor an optimizer timm knows"
                f"{suggest(cfg.optimizer, ['sgd', *names])} (timm.optim.list_optimizers() lists them)"
            )
    if cfg.layer_decay is not None:
        from kd.utils.model_names import TIMM_PREFIX

        ordered = False
        if cfg.student.startswith(TIMM_PREFIX):
            import timm

            with torch.device("meta"):
                ordered = hasattr(timm.create_model(cfg.student[len(TIMM_PREFIX) :].split(".")[0]), "group_matcher")
        if not ordered:
            raise KDError(
                f"--layer-decay needs a model that orders its layers (timm's group_matcher); {cfg.student} has none"
            )


#: the optimizers with fused kernels in torch (a skipped step without a host read)
FUSED = ("sgd", "adam", "adamw")


def timm_groups(cfg, side: nn.Module) -> List[dict]:
    """The parameter groups timm makes for the student (no weight decay on 1-d parameters and the
    names its ``no_weight_decay()`` gives, unless ``wd_bn_bias``; with ``layer_decay``, timm's
    layer-wise lr scales, which each group's lr carries here), then the loss's own modules
    (connectors, heads) as timm would group a model of their own, without layer decay."""
    from timm.optim import param_groups_layer_decay, param_groups_weight_decay

    student: nn.Module = getattr(side, "student", side)
    no_decay = getattr(student, "no_weight_decay", None)
    skip = set(no_decay()) if callable(no_decay) else set()
    wd = cfg.weight_decay
    if cfg.wd_bn_bias or not wd:
        groups = [{"params": [p for p in student.parameters() if p.requires_grad], "weight_decay": wd}]
    elif cfg.layer_decay is not None:  # a student with a group_matcher (check_optimizer)
        groups = param_groups_layer_decay(student, wd, no_weight_decay_list=skip, layer_decay=cfg.layer_decay)
    else:
        groups = param_groups_weight_decay(student, wd, no_weight_decay_list=skip)
    loss = getattr(side, "loss", None)
    if loss is not None and any(p.requires_grad for p in loss.parameters()):
        groups += param_groups_weight_decay(loss, wd) if wd and not cfg.wd_bn_bias else [
            {"params": [p for p in loss.parameters() if p.requires_grad], "weight_decay": wd}
        ]  # fmt: skip
    for group in groups:  # the schedule scales each group's own lr
        group["lr"] = cfg.lr * group.get("lr_scale", 1.0)
    return [g for g in groups if g["params"]]


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
    ``LinearLR(start_factor=1/n, total_iters=n-1)`` does, not at zero. Cosine ends at ``min_lr``."""
    warm = cfg.warmup_epochs
    if warm > 0 and epoch < warm:
        return min((epoch + step_epochs) / warm, 1.0)
    if cfg.lr_schedule == "step":
        return cfg.lr_gamma ** bisect.bisect_right(sorted(cfg.lr_milestones), math.floor(epoch + 1e-9))
    if cfg.lr_schedule == "cosine":
        span = max(cfg.epochs - warm, 1e-8)
        floor = cfg.min_lr / cfg.lr
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(max(epoch - warm, 0.0) / span, 1.0)))
    return 1.0


#: timm's default warm-up start (train.py's --warmup-lr)
TIMM_WARMUP_LR = 1e-5


def timm_cosine_factor(cfg, update: int, steps_per_epoch: int) -> float:
    """The LR multiplier of update ``update`` (from 0) as timm's ``CosineLRScheduler`` gives it when
    ``create_scheduler_v2(sched="cosine", step_on_epochs=False)`` makes it: a linear warm-up from
    ``warmup_lr`` over ``warmup_epochs``, inside one cosine cycle over every update to ``min_lr``."""
    total = cfg.epochs * steps_per_epoch
    warm = int(cfg.warmup_epochs * steps_per_epoch)
    start = TIMM_WARMUP_LR if cfg.warmup_lr is None else cfg.warmup_lr
    if update < warm:
        return (start + update * (cfg.lr - start) / warm) / cfg.lr
    if update >= total:
        return cfg.min_lr / cfg.lr
    return (cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * update / total))) / cfg.lr


def build_scheduler(cfg, optimizer, steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Stepped once per optimizer step; ``steps_per_epoch`` converts steps to epochs."""
    steps = max(steps_per_epoch, 1)
    if cfg.lr_schedule == "timm-cosine":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: timm_cosine_factor(cfg, step, steps))
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
