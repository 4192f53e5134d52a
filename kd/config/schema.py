"""The run's options as data: :class:`RunConfig` (every field and its default), the choices of its
named fields, and :func:`coerce` (a value from YAML or ``--set`` to its field's type)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

from kd.errors import KDError, suggest

OPT_LEVELS = ("O0", "O1", "O2", "O3")
TEACHER_PRECISIONS = ("auto", "float16", "bfloat16", "float32")
DEVICES = ("auto", "cpu", "cuda")
AMP_DTYPES = ("float16", "bfloat16")
AMP_IMPLS = ("auto", "native", "apex")
LR_SCHEDULES = ("step", "cosine", "constant", "timm-cosine")
MP_CONTEXTS = ("fork", "forkserver", "spawn")
#: how kd teach stores the logits (--logits-dtype): auto chooses one of the others (kd.teacher.store)
SOFT_LABEL_DTYPES = ("auto", "float16", "float32")
#: val_interpolation (kd.data.data_config resizes with these)
INTERPOLATIONS = ("bilinear", "bicubic")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class RunConfig:
    """Every option of ``kd train``; field names are the recipe keys and the ``--set`` keys."""

    # data
    data: Optional[str] = None
    image_size: int = 224
    val_resize: Optional[int] = None  # default: the student's data config's, at image_size
    val_interpolation: Optional[str] = None  # bilinear | bicubic; default: the student's data config's
    # each model's data config (kd.data.data_config.DataConfig as a dict: mean, std, interpolation, resize);
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
        "auto"  # auto: the run's dtype, checked before training, with a fallback (kd.teacher.precision)
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
    # the label term as timm's train.py --bce-loss makes it (kd.losses.base.DistillLoss.use_bce)
    bce_loss: bool = False  # timm's BinaryCrossEntropy (a sigmoid per class) for the softmax cross-entropy
    bce_target_thresh: Optional[float] = None  # with bce_loss: targets above it 1, the rest 0
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


def field_type(name: str) -> str:
    """The annotation of field ``name`` as text (``Optional[int]``)."""
    return str(FIELDS[name].type).replace("typing.", "")


def coerce(name: str, value: Any) -> Any:
    """Convert ``value`` (from YAML or a ``--set`` string) to the type of field ``name``."""
    if name == FORMER_ALPHA:  # no field any more; kd.config.resolution.apply maps it
        name = "ce_weight"
    if name not in FIELDS:
        raise KDError(f"unknown option {name!r}{suggest(name, FIELDS)}")
    default = FIELDS[name].default
    ftype = field_type(name)
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
