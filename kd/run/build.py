"""Building one student of a run (a :class:`kd.run.lane.Lane`): its precision, models, side,
optimizer, wrap and schedule, and where a resumed one stands, in the order that keeps a failed start from leaving
anything behind; the run's loop (:mod:`kd.run.loop`) builds the data and the teacher it shares."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import torch
from torch import nn

from kd import models
from kd.data.data_config import DataConfig, renormaliser
from kd.data.model_data import with_data_configs
from kd.errors import KDError
from kd.losses import LOSSES, DistillLoss, build_loss, split_layers
from kd.losses.card import MethodCard
from kd.precision import make_precision
from kd.precision.cpu import slow_precision_warning
from kd.run import paper_setting
from kd.run.dot import check_applies
from kd.run.ema import ModelEma
from kd.run.lane import Lane, stop_in_setup
from kd.run.log import NullLogger, RunLogger
from kd.run.optim import build_optimizer, build_scheduler, lr_note
from kd.run.record import compile_numbers_dynamic
from kd.run.runtime import resolve as resolve_runtime
from kd.run.sides import StudentSide
from kd.utils.taps import check_layers, final_map, layer_names, pooled_key, pre_relu_keys, tap


def build_lane(
    name: str,
    cfg,
    backend,
    out: Path,
    resumed: Optional[Tuple[Path, Dict[str, Any]]],
    shared,
    validate: bool = True,
    alone: bool = True,
    first: bool = True,
) -> Lane:
    """The student ``name`` for ``cfg`` on the set-up ``backend`` (its own fork), in ``out``, resumed
    from the checkpoint ``resumed`` (path, state) where given (read once, by the loop); ``shared``
    (:class:`kd.run.loop.Shared`) brings the data, the teacher's model, the stop flag and the
    set-up's clock; ``alone``: the run's only student; ``first``: the first built (it alone shows a
    progress bar). A stop signal during set-up ends it at the next of a few points, every process
    alike, with nothing written."""
    cfg = with_data_configs(cfg)
    dev = backend.device
    runtime = resolve_runtime(cfg, dev)
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
    prefix = "" if alone else f"[{out.name}] "
    logger = RunLogger(out, cfg.progress_bar if first else False, prefix) if backend.is_main else NullLogger()
    clock, data = shared.clock, shared.data
    stop_in_setup(shared.stop, backend)
    num_classes = cfg.num_classes or len(data.classes)
    if cfg.num_classes and cfg.data != "synthetic" and cfg.num_classes != len(data.classes):
        raise KDError(f"--num-classes {cfg.num_classes} but {cfg.data} has {len(data.classes)} class folders")

    # apex.amp holds one model per process: beside other students, apex_ddp's wish for it gives way
    precision = make_precision(cfg, dev, prefer_apex=backend.prefers_apex_amp and alone and not cfg.dot)
    said = [precision.describe()]  # logged once set-up has succeeded: a failed start stays one line
    warning = slow_precision_warning(cfg.opt, precision.dtype, dev)
    if warning:
        logger.info(warning)
    torch.manual_seed(cfg.seed)  # the same initial student on every process, and beside other students
    student, loss, teacher, s_layers, t_layers = build_models(cfg, num_classes, shared.teacher_model)
    check_batch_norm(student, cfg, backend)
    if teacher is not None:
        shared.teacher_model = teacher  # built after this student, as its own run builds it
    said += size_lines(cfg, student, teacher)
    clock.mark("models")

    # Module.to(device, memory_format=...) is valid at run time; torch's overloads list the two apart
    side = StudentSide(student, loss, s_layers).to(dev, memory_format=runtime.memory_format)  # type: ignore[call-overload]
    side = backend.convert_model(side)  # before the optimizer: sync-BN layers, parameter layout
    side.taps.install(side.student)  # on a tapped module the conversion replaced
    if loss.card.uses_samples:  # CRD's memory: one row per training sample, classes to draw negatives from
        labels = torch.tensor([label for _, label in data.train_samples], dtype=torch.long)
        sampling = loss.setup_samples(labels, cfg.seed, backend.all_gather)
        if sampling:
            logger.info(sampling)
    # the loaders normalise for the (first) student; another student renormalises on the device
    renorm = renormaliser(getattr(data.train, "norm", None), cfg.student_data)
    stop_in_setup(shared.stop, backend)
    if cfg.dot:  # once its connectors, heads and memory exist; the loss hands over its two parts
        check_applies(loss, precision.splits_gradients, cfg.kd_loss)
        loss.split_parts = True
    optimizer = build_optimizer(cfg, side, fused_ok=precision.fused_optimizer_ok)
    # the student's float32 weights as the average starts them, before the precision casts them
    ema = ModelEma(side.student, precision, cfg.model_ema_decay, cfg.model_ema_warmup) if cfg.model_ema else None
    side, optimizer = precision.convert(side, optimizer)
    model = backend.wrap(side)
    torch.manual_seed(cfg.seed + backend.rank)  # each process its own dropout / drop-path masks
    said.append(backend.describe())  # after wrap: what the backend decided there (e.g. torch_ddp's detection)
    eval_forward = evaluation_forward(backend, cast(nn.Module, side.student), renorm)
    if ema is not None:
        ema.forward = evaluation_forward(backend, ema.module, renorm)
    if runtime.compile:
        said.append(
            f"torch.compile ({cfg.compile_mode}): the first step compiles the student "
            f"{'and the teacher ' if not cfg.no_teacher else ''}(a minute or more), the steps after run faster"
        )
        compile_numbers_dynamic()  # a step that reads the progress or the step: one graph, not two
        model = torch.compile(model, mode=cfg.compile_mode)
    scheduler = build_scheduler(cfg, optimizer, len(data.train))
    # the teacher of a store is its manifest's (set later), not compared here
    setting = {k: v for k, v in cfg.to_dict().items() if not (cfg.soft_labels and k == "teacher_weights")}
    setting["num_classes"] = num_classes
    # what kd kept or chose, and where it departs from the paper it resembles: also in config.yaml
    notes = [
        line
        for line in (
            lr_note(cfg),
            cfg.schedule_note,
            paper_setting.start_line(setting, method_defaults),
            mixed_class_note(cfg, loss.card),
        )
        if line
    ]
    clock.mark("optimizer")  # with the precision, the backend's wrap and torch.compile's
    lane = Lane(
        name=name,
        cfg=cfg,
        backend=backend,
        out=out,
        data=data,
        shared=shared,
        logger=logger,
        precision=precision,
        side=side,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        renorm=renorm,
        eval_forward=eval_forward,
        num_classes=num_classes,
        needs_teacher=loss.card.needs_teacher,  # its outputs live, or from a store (--soft-labels)
        t_layers=t_layers,
        notes=notes,
        validate=validate,
        ema=ema,
        resumed=resumed[1] if resumed is not None else None,
    )
    if resumed is not None:
        logger.resume_at(lane.state.epoch)
        logger.info(f"resumed from {resumed[0]} at epoch {lane.state.epoch + 1}")
    for line in said + notes:
        logger.info(line)
    lane.log_data_configs()  # once set-up has succeeded: a failed start stays one line
    return lane


def evaluation_forward(backend, model: nn.Module, renorm) -> Callable[[torch.Tensor], Any]:
    """``model``'s forward for evaluation as the backend runs it, from the loaders' normalisation
    (``renorm`` to the student's own where they differ)."""
    forward = backend.wrap_forward(model)
    return forward if renorm is None else (lambda images: forward(renorm(images)))


def method_defaults(method: str) -> Dict[str, Any]:
    """A KD method's default hyper-parameters (none for a name no method has)."""
    return dict(LOSSES.get(method).defaults) if method in LOSSES.names() else {}


def setup_feature_layers(
    loss: DistillLoss, student: nn.Module, teacher: Optional[nn.Module], cfg
) -> Tuple[List[str], List[str]]:
    """(student tap keys, teacher tap keys) of a feature method (:mod:`kd.utils.taps`: the layers
    of ``--feature-layers`` or the method's default, before their ReLU for a ``pre_relu`` method,
    then the pooled feature where it uses it: the method's card); builds the loss's connectors from a
    dry run and gives a ``reads_teacher_norms`` method the teacher's BatchNorms. Empty for logit methods."""
    card = loss.card
    if not card.uses_features:
        return [], []
    assert teacher is not None  # a feature method needs a teacher (needs_teacher), so build_models made one
    if card.uses_classifier:
        return setup_final_maps(loss, student, teacher, cfg)
    with naming_models(cfg):
        specs = cfg.feature_layers or loss.default_layers(layer_names(student), layer_names(teacher))
    s_layers, t_layers = split_layers(specs)
    check_layers(student, s_layers, f"student {cfg.student}")
    check_layers(teacher, t_layers, f"teacher {cfg.teacher}")
    probe = torch.randn(2, 3, cfg.image_size, cfg.image_size, generator=torch.Generator().manual_seed(0))
    keys: List[List[str]] = []
    norms: Dict[str, Optional[str]] = {}  # the teacher's BatchNorm before each pre-ReLU tap
    for model, layers, role, which in (
        (student, s_layers, f"student {cfg.student}", "student"),
        (teacher, t_layers, f"teacher {cfg.teacher}", "teacher"),
    ):
        side = list(layers)
        if loss.side_tap_point(which) == "pre_relu":
            found = pre_relu_keys(model, layers, probe, loss.name, role)  # one forward for every stage
            side = [key for key, _ in found]
            if model is teacher:
                norms = dict(found)
        if card.uses_pooled:
            side.append(pooled_key(model, loss.name, role))
        keys.append(side)
    shapes = []
    for model, side in zip((student, teacher), keys):
        was_training = model.training
        model.eval()
        feats: Dict[str, torch.Tensor] = {}
        with torch.no_grad(), tap(model, side, feats):
            model(probe)
        model.train(was_training)
        shapes.append({k: feats[k].shape for k in side})
    with naming_models(cfg):
        loss.setup_features(*shapes)
    if card.reads_teacher_norms:
        loss.setup_teacher(teacher_norms(teacher, norms, loss.name, f"teacher {cfg.teacher}"))
    return keys[0], keys[1]


def setup_final_maps(loss: DistillLoss, student: nn.Module, teacher: nn.Module, cfg) -> Tuple[List[str], List[str]]:
    """([student's final map key], [teacher's]) of a ``uses_classifier`` method (:func:`final_map`);
    gives the loss the student's classifier by name and a float32 copy of the teacher's."""
    if cfg.feature_layers:
        raise KDError(f"KD loss {loss.name!r} reads each side's final feature map; --feature-layers does not apply")
    probe = torch.randn(2, 3, cfg.image_size, cfg.image_size, generator=torch.Generator().manual_seed(0))
    s_map, s_head = final_map(student, probe, loss.name, f"student {cfg.student}")
    t_map, t_head = final_map(teacher, probe, loss.name, f"teacher {cfg.teacher}")
    head = teacher.get_submodule(t_head)
    assert isinstance(head, nn.Linear)  # final_map found it so
    bias = None if head.bias is None else head.bias.detach().float().clone()
    loss.setup_classifiers(s_head, head.weight.detach().float().clone(), bias)
    return [s_map], [t_map]


@contextlib.contextmanager
def naming_models(cfg):
    """A feature method's refusal of the models' layers (no default layers for them, token features
    where it needs feature maps) with the two models named."""
    try:
        yield
    except KDError as exc:
        raise KDError(f"{exc} (student {cfg.student}, teacher {cfg.teacher})") from None


def teacher_norms(teacher: nn.Module, norms: Dict[str, Optional[str]], method: str, role: str):
    """float32 (weight, bias) of the BatchNorm named for each tap key; KDError where one has none."""
    modules = dict(teacher.named_modules())
    out = {}
    for key, name in norms.items():
        bn = modules.get(name) if name else None
        if bn is None or getattr(bn, "weight", None) is None:
            raise KDError(f"KD loss {method!r} needs the BatchNorm before {role}'s ReLU at {key!r}; there is none")
        out[key] = (bn.weight.detach().float().clone(), bn.bias.detach().float().clone())
    return out


def check_batch_norm(student: nn.Module, cfg, backend) -> None:
    """A KDError, before any step, where each process trains on one image a step and ``student``
    has BatchNorm layers (in training they need more than one value per channel)."""
    if backend.local_batch(cfg.batch_size) > 1:
        return
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in student.modules()):
        raise KDError(
            f"--batch-size {cfg.batch_size} gives each of the {backend.world_size} process(es) one image a step, "
            f"and {cfg.student} has BatchNorm layers, which need more than one value per channel in training; "
            f"use --batch-size {2 * backend.world_size} or more"
        )


def build_models(cfg, num_classes: int, teacher: Optional[nn.Module] = None):
    """(student, loss, frozen teacher or None, student layers, teacher layers to tap), on the CPU.
    ``teacher``: the frozen teacher already built (for another student of the same run), or None."""
    loss_args = cfg.loss_kwargs()
    if cfg.no_teacher:  # KD hyper-parameters (from a recipe, say) mean nothing without a teacher
        from kd.losses.kd import CrossEntropy

        loss_args = {k: v for k, v in loss_args.items() if k in CrossEntropy.defaults}
    loss = build_loss("ce" if cfg.no_teacher else cfg.kd_loss, num_classes, loss_args)
    if cfg.bce_loss:
        loss.use_bce(cfg.bce_target_thresh)
    with seeded(cfg.seed):
        student = models.build(cfg.student, num_classes, cfg.student_weights, cfg.image_size, cfg.drop_path)
    if loss.card.reads_distill_head:
        models.train_both_heads(student, cfg.student, loss.name)
    if not loss.card.needs_teacher or cfg.soft_labels:  # a store stands in for the teacher's forward
        teacher = None
    elif teacher is None:
        with seeded(cfg.seed + 1):  # a teacher without weights: the same whichever student builds it
            teacher = models.freeze(models.build(cfg.teacher, num_classes, cfg.teacher_weights, teacher_size(cfg)))
    with seeded(cfg.seed + 2):  # the connectors: the same whether or not this student built the teacher
        s_layers, t_layers = setup_feature_layers(loss, student, teacher, cfg)
    return student, loss, teacher, s_layers, t_layers


def teacher_size(cfg) -> int:
    """The size in pixels the teacher is fed in training (the run's crop, or its weights' size)."""
    return DataConfig.from_dict(cfg.teacher_data or {}).train_size(cfg.image_size)


def mixed_class_note(cfg, card: MethodCard) -> str:
    """The line of a target-class method that takes a mixed image's class from its mixed target, where one is mixed."""
    if not (card.class_of_mixed and (cfg.mixup or cfg.cutmix)):
        return ""
    return (
        f"--kd-loss {cfg.kd_loss}: a mixed image's target class is the larger part of its mixed target (the argmax), "
        "as the method's official code takes it"
    )


def size_lines(cfg, student: nn.Module, teacher: Optional[nn.Module]) -> List[str]:
    """The log lines of the student and the teacher where either is built for another size than its own."""
    sides = [("student", cfg.student, student, cfg.image_size)]
    if teacher is not None:
        sides.append(("teacher", cfg.teacher, teacher, teacher_size(cfg)))
    return [line for line in (models.other_size_line(*side) for side in sides) if line]


@contextlib.contextmanager
def seeded(seed: int):
    """torch's CPU generator at ``seed`` inside, back where it was after: each part of a run is drawn
    from its own position, so a student built beside others equals its own run."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
