"""Building one student of a run (a :class:`kd.run.lane.Lane`): its precision, models, side,
optimizer, wrap and schedule, and where a resumed one stands, in the order that keeps a failed start from leaving
anything behind; the run's loop (:mod:`kd.run.loop`) builds the data and the teacher it shares."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from kd import models
from kd.errors import KDError
from kd.losses import DistillLoss, build_loss, split_layers
from kd.precision import make_precision
from kd.precision.cpu import slow_precision_warning
from kd.run import checkpoint
from kd.run.lane import Lane
from kd.run.optim import build_optimizer, build_scheduler
from kd.run.sides import StudentSide
from kd.run.step import BufferGuard
from kd.run.taps import check_layers, layer_names, tap


def build_lane(
    cfg, backend, out: Path, resume_from: Optional[Path], shared, validate: bool = True, alone: bool = True
) -> Lane:
    """One student for ``cfg`` on the set-up ``backend``, in ``out``, resumed from ``resume_from``
    where given; ``shared`` (:class:`kd.run.loop.Shared`) brings the data, the teacher's model, the
    stop flag and the set-up's clock; ``alone``: the run's only student. A stop signal during
    set-up ends it at the next of a few points, every process alike, with nothing written."""
    resumed = checkpoint.load(resume_from) if resume_from is not None else None  # (the loop checked it)
    lane = Lane(models.with_data_configs(cfg), backend, Path(out), resume_from, shared, validate, alone)
    cfg, dev = lane.cfg, lane.device
    lane.stop_in_setup()
    lane.num_classes = num_classes = cfg.num_classes or len(lane.data.classes)
    if cfg.num_classes and cfg.data != "synthetic" and cfg.num_classes != len(lane.data.classes):
        raise KDError(f"--num-classes {cfg.num_classes} but {cfg.data} has {len(lane.data.classes)} class folders")

    # apex.amp holds one model per process: beside other students, apex_ddp's wish for it gives way
    lane.precision = make_precision(cfg, dev, prefer_apex=backend.prefers_apex_amp and alone)
    said = [lane.precision.describe()]  # logged once set-up has succeeded: a failed start stays one line
    warning = slow_precision_warning(cfg.opt, lane.precision.dtype, dev)
    if warning:
        lane.logger.info(warning)
    torch.manual_seed(cfg.seed)  # the same initial student on every process, and beside other students
    student, loss, teacher, s_layers, lane.t_layers = build_models(cfg, num_classes, shared.teacher_model)
    if teacher is not None:
        shared.teacher_model = teacher  # built after this student, as its own run builds it
    lane.needs_teacher = loss.needs_teacher  # its outputs live, or from a store (--soft-labels)
    lane.clock.mark("models")

    # Module.to(device, memory_format=...) is valid at run time; torch's overloads list the two apart
    lane.side = StudentSide(student, loss, s_layers).to(dev, memory_format=lane.memory_format)  # type: ignore[call-overload]
    lane.side = backend.convert_model(lane.side)  # before the optimizer: sync-BN layers, parameter layout
    # the loaders normalise for the (first) student; another student renormalises on the device
    lane.renorm = models.renormaliser(getattr(lane.data.train, "norm", None), cfg.student_data)
    lane.stop_in_setup()
    optimizer = build_optimizer(cfg, lane.side.named_parameters(), fused_ok=lane.precision.fused_optimizer_ok)
    lane.side, lane.optimizer = lane.precision.convert(lane.side, optimizer)
    lane.model = backend.wrap(lane.side)
    torch.manual_seed(cfg.seed + backend.rank)  # each process its own dropout / drop-path masks
    said.append(backend.describe())  # after wrap: what the backend decided there (e.g. torch_ddp's detection)
    forward = backend.wrap_forward(lane.side.student)
    renorm = lane.renorm
    lane.eval_forward = forward if renorm is None else (lambda images: forward(renorm(images)))
    # CUDA-graph modes: each step starts a new graph generation (the last step's outputs are dead)
    lane.graph_step = lane.runtime.cuda_graphs
    if lane.runtime.compile:
        said.append(
            f"torch.compile ({cfg.compile_mode}): the first step compiles the student "
            f"{'and the teacher ' if not cfg.no_teacher else ''}(a minute or more), the steps after run faster"
        )
        lane.model = torch.compile(lane.model, mode=cfg.compile_mode)
    lane.params = [p for p in lane.side.parameters() if p.requires_grad]
    lane.buffers = BufferGuard(lane.side)  # put back on a skipped step
    lane.scheduler = build_scheduler(cfg, lane.optimizer, len(lane.data.train))
    lane.clock.mark("optimizer")  # with the precision, the backend's wrap and torch.compile's
    lane.step_lr = lane.optimizer.param_groups[0]["lr"]  # the lr of the last step taken (logged)
    if resumed is not None:
        checkpoint.restore_run(lane, resumed)
        lane.logger.resume_at(lane.epoch)
        lane.logger.info(f"resumed from {resume_from} at epoch {lane.epoch + 1}")
    lane.resumed_step = lane.global_step
    for line in said:
        lane.logger.info(line)
    lane.log_data_configs()  # once set-up has succeeded: a failed start stays one line
    return lane


def setup_feature_layers(
    loss: DistillLoss, student: nn.Module, teacher: Optional[nn.Module], cfg
) -> Tuple[List[str], List[str]]:
    """(student layers, teacher layers) to tap for a feature method (``--feature-layers`` or the
    method's default); builds the loss's connectors from a dry run. Empty for logit methods."""
    if not loss.uses_features:
        return [], []
    assert teacher is not None  # a feature method needs a teacher (needs_teacher), so build_models made one
    specs = cfg.feature_layers or loss.default_layers(layer_names(student), layer_names(teacher))
    s_layers, t_layers = split_layers(specs)
    check_layers(student, s_layers, f"student {cfg.student}")
    check_layers(teacher, t_layers, f"teacher {cfg.teacher}")
    probe = torch.zeros(2, 3, cfg.image_size, cfg.image_size)
    shapes = []
    for model, layers in ((student, s_layers), (teacher, t_layers)):
        was_training = model.training
        model.eval()
        feats: Dict[str, torch.Tensor] = {}
        with torch.no_grad(), tap(model, layers, feats):
            model(probe)
        model.train(was_training)
        shapes.append({k: feats[k].shape for k in layers})
    loss.setup_features(*shapes)
    return s_layers, t_layers


def build_models(cfg, num_classes: int, teacher: Optional[nn.Module] = None):
    """(student, loss, frozen teacher or None, student layers, teacher layers to tap), on the CPU.
    ``teacher``: the frozen teacher already built (for another student of the same run), or None."""
    loss_args = cfg.loss_kwargs()
    if cfg.no_teacher:  # KD hyper-parameters (from a recipe, say) mean nothing without a teacher
        from kd.losses.kd import CrossEntropy

        loss_args = {k: v for k, v in loss_args.items() if k in CrossEntropy.defaults}
    loss = build_loss("ce" if cfg.no_teacher else cfg.kd_loss, num_classes, loss_args)
    with seeded(cfg.seed):
        student = models.build(cfg.student, num_classes, cfg.student_weights)
    if not loss.needs_teacher or cfg.soft_labels:  # a store stands in for the teacher's forward
        teacher = None
    elif teacher is None:
        with seeded(cfg.seed + 1):  # a teacher without weights: the same whichever student builds it
            teacher = models.freeze(models.build(cfg.teacher, num_classes, cfg.teacher_weights))
    with seeded(cfg.seed + 2):  # the connectors: the same whether or not this student built the teacher
        s_layers, t_layers = setup_feature_layers(loss, student, teacher, cfg)
    return student, loss, teacher, s_layers, t_layers


@contextlib.contextmanager
def seeded(seed: int):
    """torch's CPU generator at ``seed`` inside, back where it was after: each part of a run is drawn
    from its own position, so a student built beside others equals its own run."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
