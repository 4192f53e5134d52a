"""The rules a run's config must keep (:func:`check`, which :func:`kd.config.validate` calls with kd's
methods): choices and ranges, options that cannot go together, and what the KD methods named can
train with, read from their cards in the registry given (``methods``) without torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Tuple

from kd.config.options import cli_flag
from kd.config.schema import (
    AMP_DTYPES,
    AMP_IMPLS,
    COMPILE_MODES,
    DEVICES,
    INTERPOLATIONS,
    LOSS_OPTIONS,
    LR_SCHEDULES,
    MP_CONTEXTS,
    OPT_LEVELS,
    SOFT_LABEL_DTYPES,
    TEACHER_PRECISIONS,
    RunConfig,
)
from kd.data.registry import check_loader
from kd.errors import KDError
from kd.utils.model_names import tag_disagreement

if TYPE_CHECKING:
    from kd.losses.card import MethodCard, Methods


def _one_of(names) -> str:
    """'a, b or c'."""
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


def check(cfg: RunConfig, teaching: bool, methods: Methods) -> RunConfig:
    """Checks that need no data, models or devices (of a ``kd teach`` store where ``teaching``), with
    ``methods`` the registry of KD methods (:data:`kd.losses.LOSSES`); returns ``cfg`` unchanged."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise KDError(msg)

    need(teaching or cfg.student is not None, "--student is required (a torchvision model name or timm:NAME)")
    need(
        cfg.no_teacher or cfg.teacher is not None or cfg.soft_labels is not None,
        "--teacher is required (or a kd checkpoint as --teacher-weights, which names its model; "
        "or --no-teacher to train the student alone)",
    )
    need(cfg.data is not None, "--data is required (a folder with train/ and val/ ImageFolders, or 'synthetic')")
    need(cfg.opt in OPT_LEVELS, f"--opt must be one of {', '.join(OPT_LEVELS)}, got {cfg.opt!r}")
    need(cfg.device in DEVICES, f"--device must be {_one_of(DEVICES)}, got {cfg.device!r}")
    need(
        cfg.amp_dtype is None or cfg.amp_dtype in AMP_DTYPES,
        f"--amp-dtype must be {_one_of(AMP_DTYPES)}, got {cfg.amp_dtype!r}",
    )
    need(cfg.amp_impl in AMP_IMPLS, f"--amp-impl must be {_one_of(AMP_IMPLS)}, got {cfg.amp_impl!r}")
    need(
        cfg.teacher_precision in TEACHER_PRECISIONS,
        f"--teacher-precision must be one of {', '.join(TEACHER_PRECISIONS)}, got {cfg.teacher_precision!r}",
    )
    need(
        cfg.compile_mode in COMPILE_MODES,
        f"compile_mode must be one of {', '.join(COMPILE_MODES)}, got {cfg.compile_mode!r}",
    )
    need(cfg.lr_schedule in LR_SCHEDULES, f"--lr-schedule must be {_one_of(LR_SCHEDULES)}, got {cfg.lr_schedule!r}")
    need(
        cfg.val_interpolation is None or cfg.val_interpolation in INTERPOLATIONS,
        f"val_interpolation must be {_one_of(INTERPOLATIONS)}, got {cfg.val_interpolation!r}",
    )
    need(cfg.epochs >= 1, "--epochs must be at least 1")
    need(cfg.batch_size >= 1, "--batch-size must be at least 1")
    need(cfg.lr > 0, "--lr must be positive")
    need(cfg.min_lr >= 0, "--min-lr must be at least 0")
    need(
        cfg.min_lr == 0 or cfg.lr_schedule in ("cosine", "timm-cosine"),
        f"--min-lr is the floor of the cosine schedules; --lr-schedule {cfg.lr_schedule} has none",
    )
    need(
        cfg.warmup_lr is None or cfg.lr_schedule == "timm-cosine",
        "--warmup-lr is where timm-cosine's warm-up starts; kd's schedules warm up from lr/steps: "
        "give --lr-schedule timm-cosine or leave --warmup-lr out",
    )
    need(cfg.layer_decay is None or 0 < cfg.layer_decay <= 1, "--layer-decay must be in (0, 1]")
    need(
        cfg.optimizer == "sgd" or not cfg.dot,
        f"--dot is SGD with two momenta; it cannot run with --optimizer {cfg.optimizer}",
    )
    need(
        cfg.optimizer != "sgd" or (cfg.opt_eps is None and cfg.opt_betas is None),
        "--opt-eps and --opt-betas are the Adam-style optimizers' (--optimizer adamw, lamb, ...); SGD has neither",
    )
    need(0.0 < cfg.min_crop_scale <= 1.0, "--min-crop-scale must be in (0, 1]")
    validate_augment(cfg)
    validate_repeated_aug(cfg, teaching, methods)
    need(cfg.image_size >= 8, "--image-size must be at least 8")
    check_loader(cfg.loader)
    need(cfg.workers is None or cfg.workers >= 0, "--workers must be 0 or more")
    need(cfg.val_cache_gb is None or cfg.val_cache_gb >= 0, "--val-cache-gb must be 0 or more")
    need(
        cfg.cpu_decode_share is None or 0.0 <= cfg.cpu_decode_share <= 1.0,
        f"--cpu-decode-share must be between 0 and 1, got {cfg.cpu_decode_share}",
    )
    need(
        cfg.mp_context is None or cfg.mp_context in MP_CONTEXTS,
        f"--mp-context must be {_one_of(MP_CONTEXTS)}, got {cfg.mp_context!r}",
    )
    need(cfg.log_every >= 1, "--log-every must be at least 1")
    need(cfg.nproc is None or cfg.nproc >= 1, "--nproc must be at least 1")
    need(cfg.gpus is None or len(set(cfg.gpus)) == len(cfg.gpus), f"--gpus lists a GPU twice: {cfg.gpus}")
    need(cfg.gpus is None or all(g >= 0 for g in cfg.gpus), f"--gpus must be GPU indices 0, 1, ...: {cfg.gpus}")
    need(not (cfg.gpus and cfg.device == "cpu"), "--gpus needs --device cuda (or auto), not --device cpu")
    need(cfg.keep_last >= 1, "--keep-last must be at least 1")
    need(
        cfg.save_every_steps is None or cfg.save_every_steps >= 1,
        f"--save-every-steps must be at least 1, got {cfg.save_every_steps} "
        f"(leave it out to checkpoint at each epoch's end only)",
    )
    if cfg.no_teacher and cfg.kd_loss not in ("kd", "ce"):
        raise KDError(f"--no-teacher trains with cross-entropy only; it conflicts with --kd-loss {cfg.kd_loss}")
    methods.check(cfg.kd_loss)
    for model, weights in (("student", "student_weights"), ("teacher", "teacher_weights")):
        name = getattr(cfg, model)
        line = name and tag_disagreement(name, getattr(cfg, weights), (f"--{model}", f"--{model}-weights"))
        if line:
            raise KDError(line)
    need(
        not (cfg.soft_labels and cfg.no_teacher),
        "--soft-labels holds a teacher's outputs; it conflicts with --no-teacher",
    )
    need(not (cfg.soft_labels and teaching), "kd teach writes a store (--out); it reads none (--soft-labels)")
    need(not (teaching and cfg.no_teacher), "kd teach runs a teacher; it conflicts with --no-teacher")
    need(
        not (teaching and cfg.limit_train_batches and cfg.data != "synthetic"),
        "kd teach writes whole epochs (every sample a student may meet); it takes no --limit-train-batches",
    )
    need(cfg.soft_label_k is None or cfg.soft_label_k >= 1, "--top-k must be at least 1 (or all)")
    need(
        cfg.soft_label_dtype in SOFT_LABEL_DTYPES,
        f"--logits-dtype must be {_one_of(SOFT_LABEL_DTYPES)}, got {cfg.soft_label_dtype!r}",
    )
    if cfg.soft_labels:
        for name, card in method_cards(cfg, methods):
            if card.uses_features:
                raise KDError(
                    f"--soft-labels holds the teacher's logits only; --kd-loss {name} needs the teacher's "
                    f"features: train it with the live teacher"
                )
            if card.views == 2:
                raise KDError(
                    f"--soft-labels holds the teacher's logits on one crop of each sample; --kd-loss {name} "
                    f"also needs them on a second, strongly augmented view, which kd teach does not store: "
                    f"train it with the live teacher"
                )
    validate_loss_options(cfg, methods)
    if cfg.dot:
        validate_dot(cfg, methods)
    validate_averaging(cfg)
    validate_mixing(cfg, methods)
    validate_label_loss(cfg)
    return cfg


def method_cards(cfg: RunConfig, methods: Methods) -> List[Tuple[str, MethodCard]]:
    """(name, card) of each KD method ``cfg`` names (``--kd-loss a,b``: one per student), without torch."""
    return [(name, methods.card(name)) for name in cfg.kd_loss.split(",") if name in methods]


def validate_augment(cfg: RunConfig) -> None:
    """The training augmentations' options (kd.data.augment): timm reads the --aa string here, before any work."""
    from kd.data.augment_options import ERASE_MODES, wanted

    if not 0.0 <= cfg.reprob <= 1.0:
        raise KDError(f"--reprob must be between 0 and 1, got {cfg.reprob:g}")
    if cfg.remode not in ERASE_MODES:
        raise KDError(f"--remode must be {_one_of(ERASE_MODES)}, got {cfg.remode!r}")
    if cfg.recount < 1:
        raise KDError("--recount must be at least 1")
    if cfg.color_jitter is not None and cfg.color_jitter < 0:
        raise KDError(f"--color-jitter must be 0 or more, got {cfg.color_jitter:g}")
    if cfg.train_interpolation not in INTERPOLATIONS:
        raise KDError(f"--train-interpolation must be {_one_of(INTERPOLATIONS)}, got {cfg.train_interpolation!r}")
    if cfg.loader == "gpu" and wanted(cfg):
        raise KDError(
            "--loader gpu crops on the GPU, bilinearly, and cannot apply --aa, --color-jitter, --reprob or "
            "--train-interpolation bicubic: give --loader pil (or auto, which chooses pil for them)"
        )
    if wanted(cfg):  # torch and timm only where a run augments
        from kd.data.augment import timm_pieces

        timm_pieces(cfg.image_size, cfg, ((0.0,) * 3, (255.0,) * 3))


def validate_repeated_aug(cfg: RunConfig, teaching: bool, methods: Methods) -> None:
    """--repeated-aug in range, and refused where a sample met several times an epoch cannot serve."""
    if not cfg.repeated_aug:
        return
    if cfg.repeated_aug < 2:
        raise KDError(
            f"--repeated-aug N repeats each training sample N times an epoch (DeiT uses 3): 2 or more, "
            f"or 0 for off; got {cfg.repeated_aug}"
        )
    if teaching:
        raise KDError(
            "kd teach stores one crop of each sample an epoch; --repeated-aug draws several: give "
            "--repeated-aug 0 (students trained with it need the live teacher)"
        )
    if cfg.soft_labels:
        raise KDError(
            "--soft-labels holds the teacher's logits on one crop of each sample an epoch; --repeated-aug "
            "draws several: train it with the live teacher, or give --repeated-aug 0"
        )
    for name, card in method_cards(cfg, methods):
        if card.uses_samples:
            raise KDError(
                f"--kd-loss {name} keeps one memory entry per sample, and --repeated-aug puts each sample "
                f"in a step several times: train {name} without --repeated-aug"
            )


def validate_averaging(cfg: RunConfig) -> None:
    """--model-ema-decay and --drop-path in range (whether the student has stochastic depth is
    checked against the model itself: :func:`kd.models.check_drop_path`)."""
    if not 0.0 <= cfg.model_ema_decay < 1.0:
        raise KDError(f"--model-ema-decay must be in [0, 1), got {cfg.model_ema_decay:g}")
    if cfg.drop_path is not None and not 0.0 <= cfg.drop_path < 1.0:
        raise KDError(f"--drop-path must be in [0, 1), got {cfg.drop_path:g}")


def validate_dot(cfg: RunConfig, methods: Methods) -> None:
    """Where DOT cannot train: no distillation part, or an optimizer step other than its own."""
    alone = [name for name, card in method_cards(cfg, methods) if not card.needs_teacher]
    if cfg.no_teacher or alone:
        raise KDError(
            "--dot steps the label part and the distillation part of the loss apart; "
            f"{'--no-teacher' if cfg.no_teacher else f'--kd-loss {alone[0]}'} has no distillation part"
        )
    if cfg.momentum <= 0 or cfg.nesterov:
        raise KDError("--dot is SGD with two plain momenta: it needs --momentum above 0 and no --nesterov")
    if not (0 <= cfg.dot_delta <= cfg.momentum and cfg.momentum + cfg.dot_delta < 1):
        raise KDError(
            f"--dot-delta must be between 0 and --momentum {cfg.momentum:g}, with momentum + delta below 1; "
            f"got {cfg.dot_delta:g}"
        )
    if cfg.fused_optimizer:
        raise KDError("--dot has its own optimizer step; it conflicts with fused_optimizer=true")
    if cfg.amp_impl == "apex":
        raise KDError(
            "--dot keeps the distillation gradient apart from the label gradient; apex.amp unscales and "
            "checks one gradient per step inside its scale_loss: use --amp-impl native"
        )


def validate_loss_options(cfg: RunConfig, methods: Methods) -> None:
    """The KD hyper-parameters given as options: in range, given once, and known to the method."""
    for name in LOSS_OPTIONS:
        if getattr(cfg, name) is not None and name in cfg.loss_args:
            raise KDError(f"{name} is given twice, as --{name.replace('_', '-')} and in loss_args")
    args = {**cfg.loss_args, **{k: getattr(cfg, k) for k in LOSS_OPTIONS if getattr(cfg, k) is not None}}
    checks = {
        "ce_weight": (lambda v: v >= 0, "must be 0 or more"),
        "label_smoothing": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
        "temperature": (lambda v: v > 0, "must be positive"),
    }
    for name, (ok, what) in checks.items():
        value = args.get(name)
        if isinstance(value, (int, float)) and not ok(value):
            raise KDError(f"--{name.replace('_', '-')} {what}, got {value}")
    if cfg.no_teacher or (cfg.temperature is None and cfg.standardise is None):
        return
    known = methods.get(cfg.kd_loss).defaults  # torch: only where an option needs the method's hyper-parameters
    if cfg.temperature is not None and "temperature" not in known:
        raise KDError(
            f"--temperature: KD loss {cfg.kd_loss!r} has no temperature; its hyper-parameters: {', '.join(known)}"
        )
    if cfg.standardise is not None and "standardise" not in known:
        switched = ", ".join(n for n in methods.names() if "standardise" in methods.get(n).defaults)
        raise KDError(
            f"--logit-standardisation: KD loss {cfg.kd_loss!r} has no standardisation switch; the methods with it: "
            f"{switched} (lskd is KD with it)"
        )


def validate_label_loss(cfg: RunConfig) -> None:
    """--bce-target-thresh only with --bce-loss, and a probability."""
    if cfg.bce_target_thresh is None:
        return
    if not cfg.bce_loss:
        raise KDError("--bce-target-thresh thresholds the targets of --bce-loss; give --bce-loss too")
    if not 0.0 <= cfg.bce_target_thresh < 1.0:
        raise KDError(f"--bce-target-thresh must be in [0, 1), got {cfg.bce_target_thresh:g}")


def validate_mixing(cfg: RunConfig, methods: Methods) -> None:
    """--mixup, --cutmix and their options in range, and refused where the mixed batch cannot serve."""
    if cfg.mixup < 0 or cfg.cutmix < 0:
        raise KDError(f"--mixup and --cutmix are beta alphas, 0 or more (0: off); got {cfg.mixup:g}, {cfg.cutmix:g}")
    for name in ("mixup_prob", "mixup_switch_prob"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            raise KDError(f"{cli_flag(name)} must be in [0, 1], got {getattr(cfg, name):g}")
    if not 0.0 <= cfg.smoothing < 1.0:
        raise KDError(f"--smoothing must be in [0, 1), got {cfg.smoothing:g}")
    if not (cfg.mixup or cfg.cutmix):
        if cfg.smoothing:
            raise KDError(
                "--smoothing smooths the targets of --mixup and --cutmix; smooth hard labels with --label-smoothing"
            )
        return
    if cfg.soft_labels:
        raise KDError(
            "--soft-labels holds the teacher's logits on unmixed crops; --mixup and --cutmix need the live teacher"
        )
    cards = method_cards(cfg, methods)
    for name, card in cards:
        if card.uses_samples:
            raise KDError(
                f"--kd-loss {name} keys its memory by sample, and a mixed image is two samples: "
                f"train {name} without --mixup and --cutmix"
            )
    for name, card in cards:
        if card.class_labels and not card.class_of_mixed:
            raise KDError(
                f"--kd-loss {name} splits each sample's target class from the others; mixup's and cutmix's "
                f"soft targets have no one target class: train it without --mixup and --cutmix"
            )
    if cfg.label_smoothing or cfg.loss_args.get("label_smoothing"):
        raise KDError(
            "--label-smoothing would smooth the mixed targets a second time; give --smoothing with --mixup and --cutmix"
        )
