"""The frozen teacher of a run, set up once: on its device, fused, its precision chosen on a few
validation batches (:mod:`kd.teacher.precision`), wrapped forward-only by the backend, compiled where asked.

One :class:`Teacher` serves one student (``kd train``) or several (``kd train --kd-loss kd,dkd``,
:mod:`kd.run.students`): its outputs are float32 logits and tapped features (:class:`TeacherSide`, the
module the backend wraps), computed without gradients, that any number of students may read.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from kd.data.data_config import DataConfig, renormaliser
from kd.data.loader import val_transform
from kd.data.model_data import teacher_preprocessing_note
from kd.teacher import precision as kd_teacher
from kd.teacher.fuse import returned_taps
from kd.teacher.source import Targets
from kd.utils.accuracy import evaluate
from kd.utils.signals import StopFlag
from kd.utils.taps import Taps


class TeacherSide(nn.Module):
    """The frozen teacher: logits cast to float32 for the KD softmax, plus tapped features."""

    def __init__(self, teacher: nn.Module, layers: List[str]):
        super().__init__()
        self.teacher = teacher
        self.layers = layers
        # a fused teacher returns its taps with its logits (kd.teacher.fuse); another is tapped by hooks
        self.returns_taps = bool(layers) and returned_taps(teacher) == tuple(layers)
        self.taps = Taps(teacher, [] if self.returns_taps else layers)

    def forward(self, images: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        if self.returns_taps:
            logits, feats = self.teacher(images)
            return logits.float(), dict(feats)
        self.taps.arm(self.teacher)
        logits = self.teacher(images)
        return logits.float(), self.taps.take(self.teacher)


class ToSize:
    """Images resized on their device to ``size`` x ``size`` pixels (bilinear, antialiased where they
    shrink); images of that size are returned as they are."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if tuple(images.shape[-2:]) == (self.size, self.size):
            return images
        shrink = self.size < min(images.shape[-2:])
        return F.interpolate(images, (self.size, self.size), mode="bilinear", align_corners=False, antialias=shrink)


class Teacher:
    """``model`` (frozen, on the CPU) ready to run: ``forward(images)`` gives its float32 logits and the
    features of ``layers``; ``precision`` is the :class:`kd.teacher.precision.TeacherPrecision` it runs in.

    ``precision`` (the student's) gives the dtype the choice starts from and the context another
    model's forward needs; ``val`` is the loader the choice probes; ``notes`` receives the choice
    when kd made it (``--teacher-precision auto``), for ``config.yaml``.
    """

    def __init__(
        self,
        model: nn.Module,
        layers: List[str],
        cfg,
        backend,
        runtime,
        precision,
        val,
        log: Callable[[str], None],
        notes: List[str],
        renorm: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        owns_val: bool = False,
        train_size: Optional[int] = None,
        val_size: Optional[int] = None,
    ):
        """``renorm``: from the loaders' normalisation to the teacher's own (None where they agree);
        ``owns_val``: ``val`` is the teacher's own (its eval transform), closed after its first validation;
        ``train_size``, ``val_size``: the size in pixels the teacher is fed the training crops and
        ``val``'s images at, resized on the device from the size they come at (None: as they come)."""
        self.cfg = cfg
        self.backend = backend
        self.layers = list(layers)
        self.val = val
        self.owns_val = owns_val
        self.top1: Optional[float] = None  # its val top-1 once measured (validate)
        self.top5: Optional[float] = None
        self.unreadable_files: List[str] = []  # the val files its validation could not read (counted as errors)
        normalise = renorm if renorm is not None else (lambda images: images)
        to_train = ToSize(train_size) if train_size else (lambda images: images)
        to_val = ToSize(val_size) if val_size else (lambda images: images)
        self.renorm = lambda images: to_train(normalise(images))  # a training batch as the teacher wants it
        self.val_renorm = lambda images: to_val(normalise(images))  # a batch of ``val`` likewise
        self.log = log
        self.graph_step = runtime.cuda_graphs
        self.precision: kd_teacher.TeacherPrecision  # set by choose() below (fuse_and_choose always calls it)

        def choose(candidate: nn.Module) -> nn.Module:
            def probe(m, p):
                side = backend.wrap_forward(TeacherSide(m, self.layers))
                return evaluate(
                    lambda images: side(self.val_renorm(images))[0], val, backend, p, limit=kd_teacher.PROBE_BATCHES
                )

            seconds: Dict[str, float] = {}
            self.precision, chosen, line = kd_teacher.choose(
                candidate,
                probe,
                cfg.teacher_precision,
                precision.dtype,
                backend.device,
                cfg.teacher,
                outer=precision.other_model_context,
                seconds=seconds,
            )
            log(line)
            if seconds:  # where a slow start goes: each probe's validation batches (and cuDNN's autotuning)
                log(f"teacher {cfg.teacher}: probes " + ", ".join(f"{name} {t:.1f} s" for name, t in seconds.items()))
            if cfg.teacher_precision == "auto":
                notes.append(line)
            return chosen

        memory_format = runtime.memory_format
        model = kd_teacher.fuse_and_choose(model, self.layers, runtime.fuse_teacher, memory_format, choose, log)
        self.module = backend.wrap_forward(TeacherSide(model, self.layers))
        if runtime.compile:
            self.module = torch.compile(self.module, mode=cfg.compile_mode)

    @property
    def dtype_name(self) -> str:
        return kd_teacher.dtype_name(self.precision.dtype)

    def forward(self, images: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """The frozen teacher's float32 logits and tapped features for a batch, in its own precision."""
        with torch.no_grad(), self.precision.autocast():
            return self.module(self.precision.input_cast(self.renorm(images)))

    def set_epoch(self, epoch: int) -> None:
        """A live teacher's outputs do not depend on the epoch."""

    def targets(self, batch) -> Targets:
        """:meth:`forward` on ``batch``'s images (:class:`kd.teacher.source.TeacherSource`), and on its
        second view where it has one (the logits alone)."""
        logits, feats = self.forward(batch.images)
        if batch.second_images is None:
            return Targets(logits, feats)
        if self.graph_step:  # the second call's graph would overwrite the first call's outputs
            logits, feats = logits.clone(), {k: v.clone() for k, v in feats.items()}
            torch.compiler.cudagraph_mark_step_begin()
        return Targets(logits, feats, self.forward(batch.second_images)[0])

    def _logits(self, images: torch.Tensor) -> torch.Tensor:
        if self.graph_step:  # under CUDA graphs a new call may overwrite the last call's outputs
            torch.compiler.cudagraph_mark_step_begin()
        return self.module(self.val_renorm(images))[0]

    def close(self) -> None:
        """The teacher's own val loader's workers, if it has one, stopped (idempotent)."""
        if self.owns_val:
            self.val.close()
            self.owns_val = False

    def validate(self, stop: Optional[StopFlag] = None) -> Optional[float]:
        """Top-1 on the val split (top-5 in :attr:`top5`), logged with the teacher's precision (and a
        preprocessing note); measured once (several students ask for it), None in every process where ``stop`` ended
        the pass."""
        if self.top1 is not None:
            return self.top1
        start = time.perf_counter()
        asked = (lambda: stop.requested) if stop is not None else None
        val = evaluate(self._logits, self.val, self.backend, self.precision, stop=asked)
        if val["stopped"]:
            return None
        self.close()  # its own val loader is needed for nothing more
        self.top1 = top1 = val["top1"]
        self.top5 = val["top5"]
        self.unreadable_files = val["unreadable_files"]
        for path in self.unreadable_files:
            self.log(f"unreadable val image {path}")
        self.log(
            f"teacher {self.cfg.teacher}: val top-1 {top1:.2f} ({val['images']} images, {val['unreadable']} "
            f"unreadable; in {self.dtype_name}, {time.perf_counter() - start:.1f}s)"
        )
        note = teacher_preprocessing_note(self.cfg)
        if note:
            self.log(note)
        return top1


def build_teacher(
    model: torch.nn.Module,
    layers: List[str],
    cfg,
    backend,
    data,
    precision,
    log: Callable[[str], None],
    runtime,
    hooks: Sequence[Any] = (),
    notes: Optional[List[str]] = None,
) -> Teacher:
    """The frozen teacher ``model`` on this run's device and memory format, shown to ``hooks``, then
    made ready (:class:`kd.teacher.frozen.Teacher`: fused, its precision chosen on the validation
    data ``data.val`` against the student's ``precision``) with feature taps on ``layers``; what kd
    chose goes to ``notes``. ``runtime``: the run's resolved runtime (memory format, fusion,
    compilation: :func:`kd.run.runtime.resolve`); ``hooks``: the run's step hooks
    (:class:`kd.run.step.StepHook`), shown the teacher before it is fused."""
    model = model.to(backend.device, memory_format=runtime.memory_format)  # type: ignore[call-overload]  # valid at run time; torch's overloads list the two apart
    with precision.other_model_context():  # (apex O1: its casts off, as for the teacher's forward)
        for hook in hooks:
            hook.on_teacher(model, cfg, data.train)
    teacher_data = DataConfig.from_dict(cfg.teacher_data or {})
    crop, resize = teacher_data.evaluation(cfg.image_size)
    evaluation = (crop, resize, teacher_data.interpolation)
    val, owns_val, val_size = data.val, False, None
    if data.own_val is not None and data.val_samples and evaluation != (cfg.image_size, *val_transform(cfg)):
        own = dataclasses.replace(cfg, image_size=crop, val_resize=resize, val_interpolation=evaluation[2])
        val, owns_val = data.own_val(own), True  # its own crops
        log(f"teacher {cfg.teacher}: validated on its own crops ({evaluation[2]}, resize {resize}, crop {crop})")
    elif crop != cfg.image_size:  # no own crops (synthetic data): the run's, resized on the device
        val_size = crop
    train_size = teacher_data.train_size(cfg.image_size)
    renorm = renormaliser(getattr(data.train, "norm", None), cfg.teacher_data)
    notes = notes if notes is not None else []
    sizes = dict(train_size=train_size if train_size != cfg.image_size else None, val_size=val_size)
    return Teacher(model, layers, cfg, backend, runtime, precision, val, log, notes, renorm, owns_val, **sizes)
