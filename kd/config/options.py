"""``kd train``'s command-line option table (:class:`Option`, :data:`TRAIN_OPTIONS`: flags, help,
choices of each :class:`~kd.config.schema.RunConfig` field), read by cli.py and the docs; and how a
config key and value are written on that command line (:func:`cli_flag`, :func:`cli_value`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from kd.config.schema import (
    AMP_DTYPES,
    AMP_IMPLS,
    DEVICES,
    FIELDS,
    INTERPOLATIONS,
    LR_SCHEDULES,
    MP_CONTEXTS,
    OPT_LEVELS,
    TEACHER_PRECISIONS,
    field_type,
)


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
        return "bool" in field_type(self.field)

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
    Option(
        "bce_loss",
        ("--bce-loss",),
        "The label term is timm's BinaryCrossEntropy (a sigmoid per class, the mean over samples and "
        "classes, as timm's train.py --bce-loss), not the softmax cross-entropy; logged as bce.",
    ),
    Option(
        "bce_target_thresh",
        ("--bce-target-thresh",),
        "With --bce-loss: targets (mixed or smoothed) above this are 1, the rest 0 (timm's).",
        "P",
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
