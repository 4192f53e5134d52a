"""Run configuration: defaults < recipe < command-line options < ``--set key=value``.

A :class:`RunConfig` is plain data. Recipes are YAML files with the same keys
(``yaml.safe_load`` only); the resolved config is saved as ``OUT/config.yaml``.
Every problem found here raises :class:`~kd.errors.KDError`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import yaml

from kd.data.registry import check_loader
from kd.errors import KDError, suggest
from kd.losses import LOSSES, MethodCard, check_method
from kd.utils.model_names import tag_disagreement

RECIPE_DIR = Path(__file__).resolve().parent.parent / "recipes"
OPT_LEVELS = ("O0", "O1", "O2", "O3")
TEACHER_PRECISIONS = ("auto", "float16", "bfloat16", "float32")
DEVICES = ("auto", "cpu", "cuda")
AMP_DTYPES = ("float16", "bfloat16")
AMP_IMPLS = ("auto", "native", "apex")
LR_SCHEDULES = ("step", "cosine", "constant", "timm-cosine")
MP_CONTEXTS = ("fork", "forkserver", "spawn")
#: how kd teach stores the logits (--logits-dtype): auto chooses one of the others (kd.teacher.store)
SOFT_LABEL_DTYPES = ("auto", "float16", "float32")
#: val_interpolation (kd.models resizes with these)
INTERPOLATIONS = ("bilinear", "bicubic")


@dataclass
class RunConfig:
    """Every option of ``kd train``; field names are the recipe keys and the ``--set`` keys."""

    # data
    data: Optional[str] = None
    image_size: int = 224
    val_resize: Optional[int] = None  # default: the student's data config's, at image_size
    val_interpolation: Optional[str] = None  # bilinear | bicubic; default: the student's data config's
    # each model's data config (kd.models.DataConfig as a dict: mean, std, interpolation, resize);
    # None: resolved from the model's name and weights at set-up, then saved here
    student_data: Optional[Dict[str, Any]] = None
    teacher_data: Optional[Dict[str, Any]] = None
    min_crop_scale: float = 0.08  # RandomResizedCrop's lower area bound
    # timm's training augmentations after the crop (kd.data.augment), drawn from each sample's seed
    aa: Optional[str] = None  # timm's auto-augmentation string: rand-m9-mstd0.5-inc1, augmix-m5, original
    color_jitter: Optional[float] = None  # brightness, contrast and saturation; timm leaves it out under --aa
    reprob: float = 0.0  # random erasing's probability
    remode: str = "pixel"  # random erasing's fill: const | rand | pixel
    recount: int = 1  # random erasing's boxes per image
    train_interpolation: str = "bilinear"  # the training crop's resize: bilinear | bicubic
    # DeiT's repeated augmentation (kd.data.sampler): each sample this many times an epoch, each repeat
    # its own draw; 0: off
    repeated_aug: int = 0
    loader: str = "auto"  # gpu where CUDA and a GPU JPEG decoder work, else pil (kd.data.pipeline)
    workers: Optional[int] = None  # None: the CPU cores per process on this host less one (kd.data.loader)
    mp_context: Optional[str] = None  # None: the platform's safe default (kd.data.loader)
    cpu_decode_share: Optional[float] = None  # --loader gpu; None: from the worker count (kd.data.gpu)
    max_bad_images: int = 10
    limit_train_batches: Optional[int] = None  # per epoch, for smoke tests and benchmarks
    limit_val_batches: Optional[int] = None
    val_cache_gb: Optional[float] = None  # None: an eighth of host memory per host's processes (kd.data.cache)
    # models
    teacher: Optional[str] = None
    teacher_weights: str = "pretrained"
    teacher_precision: str = (
        "auto"  # auto: the run's dtype, checked before training, with a fallback (kd.teacher.probe)
    )
    student: Optional[str] = None
    student_weights: str = "none"
    num_classes: Optional[int] = None
    no_teacher: bool = False
    soft_labels: Optional[str] = None  # a kd teach store read in place of the teacher's forward (kd.teacher.store)
    soft_label_k: Optional[int] = 10  # kd teach: logits kept per sample (None: every class)
    soft_label_dtype: str = "auto"  # kd teach: auto (from the teacher's logits) | float16 | float32
    # method
    kd_loss: str = "kd"
    ce_weight: Optional[float] = None  # None: the method's default (LOSS_OPTIONS: also loss_args keys)
    label_smoothing: Optional[float] = None
    temperature: Optional[float] = None
    standardise: Optional[bool] = None  # logit standardisation (Sun et al. 2024) on a method that has the switch
    loss_args: Dict[str, Any] = field(default_factory=dict)
    feature_layers: Optional[List[str]] = None
    # optimisation
    epochs: int = 100
    batch_size: int = 256  # the GLOBAL batch, whatever the backend
    lr: float = 0.1
    # sgd: kd's SGD (torchvision's reference); any other name: timm's create_optimizer_v2 (adamw, lamb, ...)
    optimizer: str = "sgd"
    opt_eps: Optional[float] = None  # the optimizer's epsilon (timm's --opt-eps); None: its own default
    opt_betas: Optional[List[float]] = None  # Adam-style betas (timm's --opt-betas); None: its own default
    layer_decay: Optional[float] = None  # timm's layer-wise lr decay (ViTs, ConvNeXts: models with group_matcher)
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 1e-4
    wd_bn_bias: bool = False
    lr_schedule: str = "step"
    lr_milestones: List[int] = field(default_factory=lambda: [30, 60, 90])
    lr_gamma: float = 0.1
    warmup_epochs: float = 0.0
    min_lr: float = 0.0  # the cosine schedules' floor
    warmup_lr: Optional[float] = None  # timm-cosine's warm-up start (timm's --warmup-lr); None: timm's 1e-5
    grad_clip: Optional[float] = None
    dot: bool = False  # DOT (Zhao et al. ICCV 2023): the label and distillation gradients with momenta of their own
    dot_delta: float = 0.075  # DOT's momentum - delta (label) and momentum + delta (distillation); mdistiller's default
    # hardware
    device: str = "auto"
    backend: str = "single"
    gpus: Optional[List[int]] = None
    nproc: Optional[int] = None
    # process group: auto (nccl on GPUs, gloo on the CPU or where processes share a GPU), nccl, gloo
    dist_backend: str = "auto"
    dp_output_device: Optional[int] = None
    find_unused_parameters: Optional[bool] = None  # None: detect
    static_graph: bool = False
    sync_bn: bool = False
    opt: str = "O0"
    amp_dtype: Optional[str] = None  # None: float16 on CUDA, bfloat16 on the CPU
    amp_impl: str = "auto"
    channels_last: Optional[bool] = None  # None: on for CUDA
    compile: Optional[bool] = False  # None ("auto", as recipes say): on CUDA only
    # torch.compile mode; reduce-overhead adds CUDA graphs (the compiled step is host-bound)
    compile_mode: str = "default"
    cudnn_benchmark: bool = True  # let cuDNN time its algorithms for the (fixed) input shapes
    fuse_teacher: Optional[bool] = None  # None: on for CUDA; BatchNorm folded, conv+bias(+add)+ReLU as one cuDNN call
    # None: fused SGD where torch has it (CUDA, CPU): skipped steps without a host sync
    fused_optimizer: Optional[bool] = None
    # run
    seed: int = 0
    out: str = "runs/kd"
    log_every: int = 50
    eval_every: int = 1
    save_every_steps: Optional[int] = None
    keep_last: int = 1
    max_nonfinite_steps: int = 20
    max_restarts: int = 0  # torch elastic restarts of a multi-process group (from the last checkpoint)
    progress_bar: Optional[bool] = None  # None: only on a terminal
    # weight averaging and stochastic depth, under timm's option names (kd.run.ema, kd.models)
    model_ema: bool = False  # an exponential moving average of the student's weights, evaluated beside them
    model_ema_decay: float = 0.9998
    model_ema_warmup: bool = False  # the decay ramps up from 0 as timm's ModelEmaV3 warm-up does
    drop_path: Optional[float] = None  # the student's stochastic depth; None: its model's own default
    # mixup and cutmix on the device batch, under timm's option names (kd.run.mixup)
    mixup: float = 0.0  # mixup's beta alpha; 0: off
    cutmix: float = 0.0  # cutmix's beta alpha; 0: off
    mixup_prob: float = 1.0  # the chance that a batch is mixed
    mixup_switch_prob: float = 0.5  # with both on: the chance that a mixed batch is cut-mixed
    smoothing: float = 0.0  # label smoothing of the mixed targets (timm's Mixup label_smoothing)
    # recipe metadata (not options)
    recipe: Optional[str] = None
    description: Optional[str] = None
    reference: Optional[Dict[str, Any]] = None
    # the recipe's batch, where the run keeps the lr the recipe set for it (set by resolve; see kd.run.optim.lr_note)
    lr_for_batch: Optional[int] = None
    # what --epochs changed in the planned schedule (set by resolve; said at the run's start)
    schedule_note: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def loss_kwargs(self) -> Dict[str, Any]:
        """Hyper-parameters of the KD method: ``loss_args`` plus ``--ce-weight``,
        ``--label-smoothing``, ``--temperature``. Without a teacher only the label smoothing
        stays: a recipe's KD settings (its label weight too) mean nothing there."""
        args = {**self.loss_args, **{k: getattr(self, k) for k in LOSS_OPTIONS if getattr(self, k) is not None}}
        if self.no_teacher:
            args = {k: v for k, v in args.items() if k == "label_smoothing"}
        return args


FIELDS = {f.name: f for f in fields(RunConfig)}
# Options that are also hyper-parameters of the KD method, and so keys of loss_args: whichever
# of the two a later source (recipe < command line < --set) gives wins.
LOSS_OPTIONS = ("ce_weight", "label_smoothing", "temperature", "standardise")
# The former top-level option: the label weight of Hinton KD (kd); only that method takes it.
FORMER_ALPHA = "alpha"
_LIST_INT = {"lr_milestones", "gpus"}
_LIST_FLOAT = {"opt_betas"}
_LIST_STR = {"feature_layers"}


def _type_name(name: str) -> str:
    return str(FIELDS[name].type).replace("typing.", "")


def coerce(name: str, value: Any) -> Any:
    """Convert ``value`` (from YAML or a ``--set`` string) to the type of field ``name``."""
    if name == FORMER_ALPHA:  # no field any more; :func:`apply` maps it
        name = "ce_weight"
    if name not in FIELDS:
        raise KDError(f"unknown option {name!r}{suggest(name, FIELDS)}")
    default = FIELDS[name].default
    ftype = _type_name(name)
    if value is None:
        if "Optional" in ftype:
            return None
        raise KDError(f"option {name!r} cannot be empty")
    try:
        if name in _LIST_INT or name in _LIST_STR or name in _LIST_FLOAT:
            if isinstance(value, str):
                value = [v for v in value.replace(" ", "").split(",") if v]
            elif isinstance(value, (int, float)):
                value = [value]
            kind = int if name in _LIST_INT else float if name in _LIST_FLOAT else str
            try:
                return [kind(v) for v in value]
            except (TypeError, ValueError):
                raise ValueError({int: "a list of integers", float: "a list of numbers"}.get(kind, "a list")) from None
        if name == "loss_args":
            if not isinstance(value, dict):
                raise ValueError("a mapping")
            return dict(value)
        if name == "reference":
            return dict(value) if isinstance(value, dict) else {"top1": float(value)}
        if name in ("student_data", "teacher_data"):
            if not isinstance(value, dict):
                raise ValueError("a mapping (mean, std, interpolation, resize_ratio)")
            return dict(value)
        if "bool" in ftype:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            if text == "auto" and "Optional" in ftype:
                return None
            raise ValueError("true or false" + (" or auto" if "Optional" in ftype else ""))
        if "int" in ftype and "float" not in ftype and not isinstance(default, float):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("an integer")
            try:
                return int(value)
            except (TypeError, ValueError):
                raise ValueError("an integer") from None
        if "float" in ftype:
            if isinstance(value, bool):
                raise ValueError("a number")
            try:
                return float(value)
            except (TypeError, ValueError):
                raise ValueError("a number") from None
        return str(value)
    except (TypeError, ValueError) as exc:
        raise KDError(f"option {name!r} must be {exc}, got {value!r}") from None


def parse_set(items: List[str]) -> Dict[str, Any]:
    """``["epochs=5", "loss_args.beta=8"]`` -> ``{"epochs": "5", "loss_args": {"beta": 8}}``."""
    out: Dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise KDError(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        key = key.strip().replace("-", "_")
        if key.startswith("loss_args."):
            out.setdefault("loss_args", {})[key.split(".", 1)[1]] = yaml.safe_load(value)
        else:
            out[key] = value
    return out


def find_recipe(name: str) -> Path:
    """A recipe by path, or by name under ``recipes/`` (``imagenet/r34_r18_kd``)."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    for candidate in (RECIPE_DIR / name, RECIPE_DIR / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    known = [str(p.relative_to(RECIPE_DIR).with_suffix("")) for p in RECIPE_DIR.rglob("*.yaml")]
    raise KDError(f"no recipe {name!r}{suggest(name, known)}; see 'kd recipes list'")


def load_yaml(path: Union[str, Path], what: str = "recipe") -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise KDError(f"cannot read {what} {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise KDError(f"{what} {path} is damaged: it is not UTF-8 text") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise KDError(f"{what} {path} is not valid YAML{where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise KDError(f"{what} {path} must be a mapping of option: value")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def apply(cfg: RunConfig, values: Dict[str, Any], source: str) -> RunConfig:
    """A copy of ``cfg`` with ``values`` applied; ``source`` names where they came from in errors."""
    values = dict(values)
    alpha = values.pop(FORMER_ALPHA, None)
    changes = {}
    for key, value in values.items():
        if key not in FIELDS:
            raise KDError(f"unknown option {key!r} in {source}{suggest(key, FIELDS)}")
        try:
            changes[key] = coerce(key, value)
        except KDError as exc:
            raise KDError(f"{exc} in {source}") from None
    if alpha is not None or "loss_args" in changes or any(changes.get(k) is not None for k in LOSS_OPTIONS):
        changes.update(_loss_changes(cfg, changes, alpha, source))
    return dataclasses.replace(cfg, **changes)


def _loss_changes(cfg: RunConfig, changes: Dict[str, Any], alpha: Any, source: str) -> Dict[str, Any]:
    """``loss_args`` (and LOSS_OPTIONS) after one source's ``changes``.

    The source's former hyper-parameter names become the current ones (one deprecation line
    each; a former and its current name together are an error), its ``alpha`` too where the
    method is kd. A LOSS_OPTIONS value replaces the same key of earlier ``loss_args`` and
    the other way round, so ``--temperature`` overrides a recipe's ``loss_args.temperature``.
    """
    method = changes.get("kd_loss", cfg.kd_loss)
    own = dict(changes.get("loss_args", {}))
    if alpha is not None:
        if method != "kd":
            extra = "; it set DKD's TCKD weight, now --loss-arg tckd_weight=X" if method == "dkd" else ""
            raise KDError(
                f"option 'alpha' ({source}) is gone: it was the label weight of --kd-loss kd; "
                f"use --ce-weight for {method}'s label term{extra}"
            )
        if changes.get("ce_weight") is not None or FORMER_ALPHA in own:
            raise KDError(
                f"{source} gives 'alpha', the former name of ce_weight (and 1 - kd_weight), and ce_weight "
                "or loss_args alpha: give ce_weight and kd_weight, not both"
            )
        own[FORMER_ALPHA] = alpha
    if own:
        from kd.losses import LOSSES

        own = LOSSES.get(method).upgrade_args(own)
    for name in LOSS_OPTIONS:
        if changes.get(name) is not None and name in own:
            raise KDError(f"{source} gives {name} twice, as an option and in loss_args")
    out: Dict[str, Any] = {"loss_args": {**cfg.loss_args, **own}}
    for name in LOSS_OPTIONS:
        if changes.get(name) is not None:
            out["loss_args"].pop(name, None)
        elif name in own:
            out[name] = None
    return out


def resolve(
    recipe: Optional[str] = None,
    options: Optional[Dict[str, Any]] = None,
    sets: Optional[List[str]] = None,
    base: Optional[RunConfig] = None,
    teaching: bool = False,
) -> RunConfig:
    """Defaults (or ``base``) < recipe < ``options`` < ``--set`` items, then validated (for ``kd
    teach``'s store where ``teaching``)."""
    cfg = base or RunConfig()
    if recipe:
        path = find_recipe(recipe)
        values = load_yaml(path)
        cfg = apply(cfg, values, f"recipe {path}")
        paired = "lr" in values and "batch_size" in values
        cfg = dataclasses.replace(cfg, recipe=str(recipe), lr_for_batch=cfg.batch_size if paired else None)
    planned = cfg
    overrides: Dict[str, Any] = {}
    if options:
        cfg = apply(cfg, options, "the command line")
        overrides.update(options)
    if sets:
        parsed = parse_set(sets)
        cfg = apply(cfg, parsed, "--set")
        overrides.update(parsed)
    if overrides.get("lr") is not None:  # the user's lr: no recipe's batch to measure it against
        cfg = dataclasses.replace(cfg, lr_for_batch=None)
    if base is None and "epochs" in overrides:
        cfg = scale_schedule(cfg, planned.epochs, overrides)
    if cfg.teacher is None and not cfg.no_teacher and cfg.teacher_weights:
        check_method(cfg.kd_loss)  # a mistyped name is answered before the checkpoint is read (with torch)
        from kd.models import kd_run_model

        cfg = dataclasses.replace(cfg, teacher=kd_run_model(cfg.teacher_weights))  # a kd checkpoint names its model
    return validate(cfg, teaching)


#: options that --no-teacher would leave unused, were they typed beside it
TEACHER_OPTIONS = ("teacher", "teacher_weights", "teacher_precision")


def refuse_unused(given: Dict[str, Any]) -> None:
    """Options typed together where one would make the other do nothing: refused rather than
    ignored (a recipe's teacher under --no-teacher is fine: that is its baseline)."""
    if given.get("no_teacher"):
        unused = [name for name in TEACHER_OPTIONS if given.get(name) is not None]
        if unused:
            shown = " ".join(f"--{n.replace('_', '-')} {given[n]}" for n in unused)
            raise KDError(f"--no-teacher trains the student alone: it conflicts with {shown} (unused); give one")


def scale_schedule(cfg: RunConfig, planned_epochs: int, overrides: Dict[str, Any]) -> RunConfig:
    """A shorter (or longer) run keeps the shape of the planned LR schedule.

    When ``epochs`` is overridden (``--epochs 30`` on a 100-epoch recipe, say) and the
    milestones / warm-up are not, they are scaled by the same factor: 30/60/90 becomes 9/18/27.
    """
    if cfg.epochs == planned_epochs or planned_epochs <= 0:
        return cfg
    factor = cfg.epochs / planned_epochs
    changes: Dict[str, Any] = {}
    said = []
    if "lr_milestones" not in overrides:
        changes["lr_milestones"] = sorted({max(1, int(round(m * factor))) for m in cfg.lr_milestones})
        if changes["lr_milestones"] != cfg.lr_milestones and cfg.lr_schedule == "step":  # the others read none
            said.append(f"milestones {_epochs(cfg.lr_milestones)} -> {_epochs(changes['lr_milestones'])}")
    if "warmup_epochs" not in overrides and cfg.warmup_epochs:
        changes["warmup_epochs"] = cfg.warmup_epochs * factor
        said.append(f"warm-up {cfg.warmup_epochs:g} -> {changes['warmup_epochs']:g} epochs")
    if said:
        changes["schedule_note"] = (
            f"the lr schedule is scaled from {planned_epochs} to {cfg.epochs} epochs: {'; '.join(said)} "
            "(--lr-milestones and --warmup-epochs set them)"
        )
    return dataclasses.replace(cfg, **changes)


def _epochs(values: Sequence[int]) -> str:
    return "/".join(str(v) for v in values)


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _one_of(names) -> str:
    """'a, b or c'."""
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


def validate(cfg: RunConfig, teaching: bool = False) -> RunConfig:
    """Checks that need no data, models or devices (of a ``kd teach`` store where ``teaching``);
    returns ``cfg`` unchanged."""

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
    validate_repeated_aug(cfg, teaching)
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
    check_method(cfg.kd_loss)
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
        for name, card in method_cards(cfg):
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
    validate_loss_options(cfg)
    if cfg.dot:
        validate_dot(cfg)
    validate_averaging(cfg)
    validate_mixing(cfg)
    return cfg


def method_cards(cfg: RunConfig) -> List[Tuple[str, MethodCard]]:
    """(name, card) of each KD method ``cfg`` names (``--kd-loss a,b``: one per student), without torch."""
    return [(name, LOSSES.card(name)) for name in cfg.kd_loss.split(",") if name in LOSSES]


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


def validate_repeated_aug(cfg: RunConfig, teaching: bool) -> None:
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
    for name, card in method_cards(cfg):
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


def validate_dot(cfg: RunConfig) -> None:
    """Where DOT cannot train: no distillation part, or an optimizer step other than its own."""
    alone = [name for name, card in method_cards(cfg) if not card.needs_teacher]
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


def validate_loss_options(cfg: RunConfig) -> None:
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
    from kd.losses import LOSSES  # torch: only where an option needs the method's hyper-parameters

    known = LOSSES.get(cfg.kd_loss).defaults
    if cfg.temperature is not None and "temperature" not in known:
        raise KDError(
            f"--temperature: KD loss {cfg.kd_loss!r} has no temperature; its hyper-parameters: {', '.join(known)}"
        )
    if cfg.standardise is not None and "standardise" not in known:
        switched = ", ".join(n for n in LOSSES.names() if "standardise" in LOSSES.get(n).defaults)
        raise KDError(
            f"--logit-standardisation: KD loss {cfg.kd_loss!r} has no standardisation switch; the methods with it: "
            f"{switched} (lskd is KD with it)"
        )


def validate_mixing(cfg: RunConfig) -> None:
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
    cards = method_cards(cfg)
    for name, card in cards:
        if card.uses_samples:
            raise KDError(
                f"--kd-loss {name} keys its memory by sample, and a mixed image is two samples: "
                f"train {name} without --mixup and --cutmix"
            )
    for name, card in cards:
        if card.class_labels:
            raise KDError(
                f"--kd-loss {name} splits each sample's target class from the others; mixup's and cutmix's "
                f"soft targets have no one target class: train it without --mixup and --cutmix"
            )
    if cfg.label_smoothing or cfg.loss_args.get("label_smoothing"):
        raise KDError(
            "--label-smoothing would smooth the mixed targets a second time; give --smoothing with --mixup and --cutmix"
        )


def save(cfg: RunConfig, path: Union[str, Path], notes: Sequence[str] = ()) -> None:
    """``cfg`` as YAML; ``notes`` (what kd chose, and why) follow as comments."""
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(cfg.to_dict(), fh, sort_keys=False)
        for note in notes:
            fh.write(f"# {note}\n")


#: keys of configs saved by earlier versions that no run reads now (the command chooses what runs)
RETIRED = ("teach", "timing_warmup")


def load(path: Union[str, Path]) -> RunConfig:
    """A saved ``config.yaml`` (as written by :func:`save`; earlier versions' retired keys dropped)."""
    values = {k: v for k, v in load_yaml(path, "saved config").items() if k not in RETIRED}
    return apply(RunConfig(), values, str(path))


def cli_value(value: Any) -> str:
    """A setting as kd train's command line writes it: ``on``/``off``, ``auto`` for None, ``0.1``, ``30,60,90``."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "auto"
    if isinstance(value, (list, tuple)):
        return ",".join(cli_value(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def cli_flag(key: str) -> str:
    """The option of kd train that sets config key ``key`` (``--batch-size``; a switch's first form,
    ``--compile``), or ``--set key`` where no option does."""
    option = next((o for o in TRAIN_OPTIONS if o.field == key), None)
    if option is None:
        return f"--set {key}"
    return next(f for f in option.flags if f.startswith("--")).split("/")[0]


@dataclass(frozen=True)
class Option:
    """How one :class:`RunConfig` field appears on ``kd train``'s command line.

    The default shown in the help is the field's own; ``note`` says what a None default means
    (``[CPU cores per process less one]``) or explains the default (``[auto: cuda where available]``).
    A ``{names}`` in ``help`` is filled by the CLI with the names its registry knows.
    """

    field: str
    flags: Tuple[str, ...]
    help: str
    metavar: Optional[str] = None
    choices: Optional[Tuple[str, ...]] = None
    note: Optional[str] = None

    @property
    def switch(self) -> bool:
        """A boolean field: ``--x/--no-x``, or a plain flag that turns it on."""
        return "bool" in _type_name(self.field)

    def default(self) -> Any:
        f = FIELDS[self.field]
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    def default_text(self) -> str:
        """``[the default: note]`` as the help shows it; empty where there is nothing to say."""
        value = self.default()
        if self.switch and "/" not in self.flags[0]:
            return ""  # a flag that turns something on: off unless given
        text = "" if value is None else cli_value(value)
        text = ": ".join(t for t in (text, self.note) if t)
        return f"[{text}]" if text else ""


TRAIN_OPTIONS = (
    Option("data", ("--data",), "ImageNet-layout folder (train/ and val/ ImageFolders), or 'synthetic'.", "DIR"),
    Option(
        "teacher",
        ("--teacher",),
        "Teacher: torchvision model name or timm:NAME (timm:NAME.TAG: that tag's weights).",
        "NAME",
    ),
    Option("teacher_weights", ("--teacher-weights",), "Teacher weights.", "pretrained|none|PATH"),
    Option(
        "teacher_precision",
        ("--teacher-precision",),
        "The frozen teacher's precision.",
        choices=TEACHER_PRECISIONS,
        note="the run's, checked on val batches, falling back to bfloat16/float32",
    ),
    Option(
        "student",
        ("--student",),
        "Student: torchvision model name or timm:NAME (timm:NAME.TAG: that tag's weights).",
        "NAME",
    ),
    Option("student_weights", ("--student-weights",), "Student initial weights.", "pretrained|none|PATH"),
    Option("num_classes", ("--num-classes",), "Classes.", note="the number of class folders"),
    Option("no_teacher", ("--no-teacher",), "Train the student alone on the labels."),
    Option(
        "soft_labels",
        ("--soft-labels",),
        "A store written by kd teach: the teacher's logits on these crops are read, the teacher is not run.",
        "STORE",
    ),
    Option(
        "kd_loss",
        ("--kd-loss",),
        "KD method: {names}; see 'kd losses'. A comma list (kd,dkd) trains one "
        "student per method at once, from one teacher forward.",
        "NAME[,NAME..]",
    ),
    Option("ce_weight", ("--ce-weight",), "Weight of the label (cross-entropy) term.", note="method default"),
    Option("label_smoothing", ("--label-smoothing",), "Label smoothing of the label term, any method.", note="0"),
    Option(
        "temperature", ("--temperature", "-T"), "Softmax temperature of methods that have one.", note="method default"
    ),
    Option(
        "standardise",
        ("--logit-standardisation/--no-logit-standardisation",),
        "Z-score both logit vectors before the method's softmax (Sun et al. CVPR 2024); "
        "the methods with a standardise switch: kd, dkd, ctkd, ctdkd, mlkd.",
        note="method default: off",
    ),
    Option("feature_layers", ("--feature-layers",), "Modules tapped by feature methods.", "A,B,.."),
    Option("epochs", ("--epochs",), "Epochs."),
    Option("batch_size", ("--batch-size", "-b"), "GLOBAL batch size, whatever the backend."),
    Option("lr", ("--lr",), "Peak learning rate."),
    Option(
        "optimizer",
        ("--optimizer",),
        "sgd: kd's SGD (torchvision's reference); any other name is timm's create_optimizer_v2 "
        "(adamw, lamb, lion, ...), with no weight decay on norms and biases as timm decides.",
        "NAME",
    ),
    Option("opt_eps", ("--opt-eps",), "Optimizer epsilon (Adam-style optimizers).", note="the optimizer's"),
    Option("opt_betas", ("--opt-betas",), "Optimizer betas (Adam-style optimizers).", "B1,B2", note="the optimizer's"),
    Option("layer_decay", ("--layer-decay",), "timm's layer-wise lr decay (models with a group_matcher)."),
    Option("momentum", ("--momentum",), "SGD momentum."),
    Option("nesterov", ("--nesterov/--no-nesterov",), "Nesterov momentum."),
    Option("weight_decay", ("--weight-decay", "--wd"), "Weight decay."),
    Option("wd_bn_bias", ("--wd-bn-bias/--no-wd-bn-bias",), "Decay BatchNorm and bias too."),
    Option(
        "lr_schedule",
        ("--lr-schedule",),
        "Learning-rate schedule, per step (cosine: torchvision's reference; timm-cosine: timm's "
        "CosineLRScheduler stepped per update, warm-up from --warmup-lr).",
        choices=LR_SCHEDULES,
    ),
    Option("lr_milestones", ("--lr-milestones",), "Epochs of the step schedule.", "E1,E2,.."),
    Option("lr_gamma", ("--lr-gamma",), "Factor at each milestone."),
    Option("warmup_epochs", ("--warmup-epochs",), "Linear LR warm-up."),
    Option("min_lr", ("--min-lr",), "The lr the cosine schedules end at."),
    Option("warmup_lr", ("--warmup-lr",), "timm-cosine's warm-up starts at this lr.", note="timm's 1e-5"),
    Option("grad_clip", ("--grad-clip",), "Clip the gradient norm to this value."),
    Option(
        "dot",
        ("--dot/--no-dot",),
        "DOT (Zhao et al. ICCV 2023): SGD with momentum - delta on the label term's gradient and "
        "momentum + delta on the distillation part's; with any method whose loss has both.",
    ),
    Option("dot_delta", ("--dot-delta",), "DOT's momentum difference delta."),
    # weight averaging and stochastic depth (timm's option names)
    Option(
        "model_ema",
        ("--model-ema",),
        "Keep an exponential moving average of the student's weights (timm's ModelEmaV3), evaluated "
        "each epoch beside them (val_top1_ema) and kept in the checkpoints; kd export --ema writes it.",
    ),
    Option("model_ema_decay", ("--model-ema-decay",), "Decay of --model-ema per optimizer step."),
    Option(
        "model_ema_warmup",
        ("--model-ema-warmup",),
        "Ramp the decay of --model-ema up from 0 (timm's warm-up: 1 - n^(-2/3) at step n, at most the decay).",
    ),
    Option(
        "drop_path",
        ("--drop-path",),
        "Stochastic depth of the student (timm's drop_path_rate, torchvision's stochastic_depth_prob); "
        "the teacher never has it.",
        "RATE",
        note="the model's own",
    ),
    # mixup and cutmix (timm's option names and meanings)
    Option("mixup", ("--mixup",), "Mixup on each training batch: its beta alpha (timm's; 0: off).", "ALPHA"),
    Option("cutmix", ("--cutmix",), "CutMix on each training batch: its beta alpha (timm's; 0: off).", "ALPHA"),
    Option("mixup_prob", ("--mixup-prob",), "The chance that a batch is mixed (mixup or cutmix)."),
    Option("mixup_switch_prob", ("--mixup-switch-prob",), "With --mixup and --cutmix: the chance of cutmix."),
    Option(
        "smoothing",
        ("--smoothing",),
        "Label smoothing of the mixed targets (timm's Mixup; --label-smoothing is for hard labels).",
    ),
    Option("image_size", ("--image-size",), "Train crop and val crop size."),
    Option(
        "val_resize",
        ("--val-resize",),
        "Val short-side resize.",
        note="from the student's data config (its weights' resize to crop ratio), else image-size * 256/224",
    ),
    Option("min_crop_scale", ("--min-crop-scale",), "Smallest crop area of RandomResizedCrop."),
    # timm's training augmentations (timm's option names), drawn from each sample's seed
    Option(
        "aa",
        ("--aa",),
        "timm's auto-augmentation of the training crop (rand-m9-mstd0.5-inc1, augmix-m5, original), "
        "in the PIL loader's workers.",
        "STRING",
    ),
    Option(
        "color_jitter",
        ("--color-jitter",),
        "Colour jitter of the training crop (brightness, contrast, saturation); timm leaves it out under --aa.",
    ),
    Option("reprob", ("--reprob",), "Random erasing probability (timm's RandomErasing, on the normalised crop)."),
    Option("remode", ("--remode",), "Random erasing fill.", choices=("const", "rand", "pixel")),
    Option("recount", ("--recount",), "Random erasing boxes per image."),
    Option(
        "train_interpolation",
        ("--train-interpolation",),
        "The training crop's resize.",
        choices=INTERPOLATIONS,
    ),
    Option(
        "repeated_aug",
        ("--repeated-aug",),
        "Repeated augmentation (DeiT's RASampler, timm's --aug-repeats): each training sample N times an "
        "epoch, each repeat its own augmentation, the repeats spread over the processes; the epoch keeps "
        "the training set's size (rounded down to a multiple of 256). DeiT uses 3; 0: off.",
        "N",
    ),
    Option(
        "loader",
        ("--loader",),
        "Input pipeline: {names} (gpu: decode and crop on the GPU; auto: gpu where CUDA and a GPU JPEG "
        "decoder work, else pil).",
        "NAME",
    ),
    Option(
        "workers",
        ("--workers", "-j"),
        "DataLoader worker processes per process.",
        note="CPU cores per process less one",
    ),
    Option("mp_context", ("--mp-context",), "Worker start method.", choices=MP_CONTEXTS, note="forkserver on Linux"),
    Option(
        "cpu_decode_share",
        ("--cpu-decode-share",),
        "--loader gpu: fraction of the images the workers decode (PIL) beside the GPU decoder.",
        note="auto: from the workers",
    ),
    Option("max_bad_images", ("--max-bad-images",), "Unreadable images tolerated before failing."),
    Option("limit_train_batches", ("--limit-train-batches",), "At most this many steps per epoch."),
    Option("limit_val_batches", ("--limit-val-batches",), "At most this many val batches."),
    Option(
        "val_cache_gb",
        ("--val-cache-gb",),
        "Keep the val crops in host memory after the first pass, up to this many GB per process (0: off).",
        note="an eighth of host memory",
    ),
    Option("device", ("--device",), "Where it runs.", choices=DEVICES, note="cuda where available"),
    Option("backend", ("--backend",), "Parallel backend: {names}; see 'kd backends'.", "NAME"),
    Option("gpus", ("--gpus",), "GPU indices to use (any subset).", "0,1,3"),
    Option(
        "nproc", ("--nproc",), "Processes for a multi-process backend: on the CPU, or sharing the --gpus (over gloo)."
    ),
    Option("dp_output_device", ("--dp-output-device",), "dp: GPU that gathers outputs.", note="first of --gpus"),
    Option(
        "find_unused_parameters",
        ("--find-unused-parameters/--no-find-unused-parameters",),
        "torch_ddp: parameters without a gradient in a step.",
        note="detect",
    ),
    Option("static_graph", ("--static-graph",), "torch_ddp static graph."),
    Option("sync_bn", ("--sync-bn",), "Synchronised BatchNorm across processes."),
    Option("opt", ("--opt",), "Opt level as in apex.", choices=OPT_LEVELS),
    Option(
        "amp_dtype",
        ("--amp-dtype",),
        "Reduced precision of O1-O3.",
        choices=AMP_DTYPES,
        note="float16 on CUDA, bfloat16 on CPU",
    ),
    Option("amp_impl", ("--amp-impl",), "Mixed precision: torch.amp (native) or apex.amp.", choices=AMP_IMPLS),
    Option("channels_last", ("--channels-last/--no-channels-last",), "NHWC memory format.", note="on for CUDA"),
    Option("compile", ("--compile/--no-compile",), "torch.compile teacher and student."),
    Option("seed", ("--seed",), "Random seed."),
    Option("out", ("--out", "-o"), "Run folder.", "DIR"),
    Option("log_every", ("--log-every",), "Steps between TensorBoard points."),
    Option("eval_every", ("--eval-every",), "Epochs between evaluations."),
    Option("save_every_steps", ("--save-every-steps",), "Also checkpoint every N steps."),
    Option("keep_last", ("--keep-last",), "Step checkpoints kept."),
    Option("max_nonfinite_steps", ("--max-nonfinite-steps",), "Consecutive NaN/inf losses before stopping."),
    Option("max_restarts", ("--max-restarts",), "Restart a failed process group from the last checkpoint."),
    Option("progress_bar", ("--progress/--no-progress",), "Progress bar.", note="on a terminal only"),
)
