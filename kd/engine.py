"""The training loop: :meth:`Trainer.step` (one public step) and the rules around it (non-finite
losses, unreadable images, stop signals, logging, checkpoints). It asks the backend and the
precision object; it never branches on which backend or opt level is in use."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from kd import checkpoint
from kd import config as kd_config
from kd import data as kd_data
from kd import teacher as kd_teacher
from kd.cpu import slow_precision_warning
from kd.data.loader import Batch, Loader
from kd.errors import KDError
from kd.evaluate import teacher_preprocessing_note
from kd.logging import NullLogger, RunLogger, command_start
from kd.meter import Meter, format_record, nonfinite_message
from kd.optim import build_optimizer, build_scheduler
from kd.precision import make_precision
from kd.runfolder import RunFolder
from kd.runtime import resolve as resolve_runtime
from kd.sides import LOGITS_SUM, StudentSide, TeacherSide, build_models
from kd.signals import Interrupted, StopFlag
from kd.step import StepHook, StepOutput
from kd.validation import evaluate


class Trainer:
    """One process's part of a run: built from a config, a set-up backend and the run folder."""

    def __init__(self, cfg, backend, out: Path, resume_from: Optional[Path] = None, hooks: Sequence[StepHook] = (),
                 validate: bool = True):
        """``hooks`` see every step and epoch record; ``validate=False`` skips the teacher's and the
        student's validation passes (timed benchmark runs)."""
        self.started = command_start(default=time.time())
        self.hooks = list(hooks)
        self.validates = validate
        self.first_step: Optional[Dict[str, float]] = None  # seconds to the first step, once taken
        self.loss_terms: List[str] = []  # the loss parts besides the total, in the order of the non-finite flags
        resumed = checkpoint.load(resume_from) if resume_from is not None else None  # a broken file fails first
        self.cfg = cfg
        self.backend = backend
        self.out = Path(out)
        self.device = dev = backend.device
        self.runtime = resolve_runtime(cfg, dev)
        self.memory_format = self.runtime.memory_format
        self.logger = RunLogger(self.out, cfg.progress_bar) if backend.is_main else NullLogger()
        if dev.type == "cuda":
            torch.backends.cudnn.benchmark = cfg.cudnn_benchmark

        torch.manual_seed(cfg.seed)  # the same initial student on every process
        num_replicas, rank = backend.data_shard()
        self.data = kd_data.build(cfg, num_replicas, rank, backend.local_batch(cfg.batch_size), dev,
                                   self.runtime.channels_last)
        self.num_classes = num_classes = cfg.num_classes or len(self.data.classes)
        if cfg.num_classes and cfg.data != "synthetic" and cfg.num_classes != len(self.data.classes):
            raise KDError(f"--num-classes {cfg.num_classes} but {cfg.data} has {len(self.data.classes)} class folders")

        self.precision = make_precision(cfg, dev, prefer_apex=backend.prefers_apex_amp)
        self.logger.info(self.precision.describe())
        warning = slow_precision_warning(cfg.opt, self.precision.dtype, dev)
        if warning:
            self.logger.info(warning)
        student, loss, teacher, s_layers, t_layers = build_models(cfg, num_classes)

        # Module.to(device, memory_format=...) is valid at run time; torch's overloads list the two apart
        self.side = StudentSide(student, loss, s_layers).to(dev, memory_format=self.memory_format)  # type: ignore[call-overload]
        self.side = backend.prepare_model(self.side)  # before the optimizer: sync-BN layers, parameter layout
        self.teacher: Optional[Callable[..., Any]] = None  # TeacherSide, wrapped by the backend (and compiled)
        self.teacher_precision: Optional[kd_teacher.TeacherPrecision] = None
        self.notes: List[str] = []  # what kd chose for the user, kept as comments in config.yaml
        if teacher is not None:
            teacher = teacher.to(dev, memory_format=self.memory_format)
            for hook in self.hooks:
                hook.on_teacher(self, teacher)
            teacher = kd_teacher.prepare(teacher, t_layers, self.runtime.fuse_teacher, self.memory_format,
                                         lambda model: self._choose_teacher_precision(model, t_layers),
                                         self.logger.info)
            self.teacher = backend.wrap_forward(TeacherSide(teacher, t_layers))
            assert self.teacher_precision is not None  # set by _choose_teacher_precision, within prepare
            self.cfg = cfg = dataclasses.replace(
                cfg, teacher_precision=kd_teacher.dtype_name(self.teacher_precision.dtype))
        optimizer = build_optimizer(cfg, self.side.named_parameters(), fused_ok=self.precision.fused_optimizer_ok)
        self.side, self.optimizer = self.precision.prepare(self.side, optimizer)
        self.model = backend.wrap(self.side)
        torch.manual_seed(cfg.seed + backend.rank)  # each process its own dropout / drop-path masks
        self.logger.info(backend.describe())  # after wrap: what the backend decided there (e.g. torch_ddp's detection)
        self.eval_forward = backend.wrap_forward(self.side.student)
        # CUDA-graph modes: each step starts a new graph generation (the last step's outputs are dead)
        self.graph_step = cfg.compile and cfg.compile_mode in ("reduce-overhead", "max-autotune")
        if cfg.compile:
            self.model = torch.compile(self.model, mode=cfg.compile_mode)
            if self.teacher is not None:
                self.teacher = torch.compile(self.teacher, mode=cfg.compile_mode)
        self.params = [p for p in self.side.parameters() if p.requires_grad]
        self.scheduler = build_scheduler(cfg, self.optimizer, len(self._train_loader()))

        self.epoch = 0
        self.batch_in_epoch = 0
        self.global_step = 0
        self.best_top1 = -1.0
        self.bad_images = 0
        self.meter = Meter(dev)
        self.stop = StopFlag()
        self.steps_in_epoch = len(self._train_loader())
        self.stop_every = min(cfg.log_every, 10)  # steps between stop checks across processes
        if resumed is not None:
            checkpoint.restore_run(self, resumed)
            self.logger.info(f"resumed from {resume_from} at epoch {self.epoch + 1}")
        self._resumed_step = self.global_step
        self.logger.info(self._train_loader().describe())  # after set-up, so a failed start stays one line
        if backend.is_main:  # written once set-up has succeeded, so a failed start leaves no run behind
            RunFolder(self.out).start() if resume_from is None else self.out.mkdir(parents=True, exist_ok=True)
            kd_config.save(cfg, RunFolder(self.out).config, notes=self.notes)
        self._setup_seconds = time.time() - self.started

    def close(self) -> None:
        """Signal handlers back, logs closed, loader workers and threads stopped: nothing outlives the run."""
        self.stop.restore()
        self.logger.close()
        self.data.close()

    # ----------------------------------------------------------------- set-up helpers
    def _train_loader(self) -> Loader:
        return self.data.train

    def _choose_teacher_precision(self, teacher: nn.Module, layers: List[str]) -> nn.Module:
        """``teacher`` in the precision :func:`kd.teacher.choose` finds it runs well in (sets ``teacher_precision``)."""
        def probe(model, precision):
            side = self.backend.wrap_forward(TeacherSide(model, layers))
            return evaluate(lambda images: side(images)[0], self.data.val, self.backend, precision,
                            limit=kd_teacher.PROBE_BATCHES)

        self.teacher_precision, model, line = kd_teacher.choose(
            teacher, probe, self.cfg.teacher_precision, self.precision.dtype, self.device, self.cfg.teacher,
            outer=self.precision.other_model_context)
        self.logger.info(line)
        if self.cfg.teacher_precision == "auto":
            self.notes.append(line)
        return model

    def save(self, best: bool, step_copy: bool = False) -> None:
        checkpoint.save_run(self, best, step_copy)

    # ----------------------------------------------------------------- the loop
    def _graph_step_begin(self) -> None:
        """Under CUDA graphs (compile_mode), a new call may overwrite the last call's outputs."""
        if self.graph_step:
            torch.compiler.cudagraph_mark_step_begin()

    def _teacher_logits(self, images: torch.Tensor) -> torch.Tensor:
        self._graph_step_begin()
        assert self.teacher is not None  # only called for a run with a teacher
        return self.teacher(images)[0]

    def teacher_forward(self, images: torch.Tensor):
        """The frozen teacher's float32 logits and tapped features for a batch, in its own precision."""
        precision = self.teacher_precision
        assert self.teacher is not None and precision is not None  # only called for a run with a teacher
        with torch.no_grad(), precision.autocast():
            return self.teacher(precision.input_cast(images))

    def fit(self) -> Dict[str, Any]:
        """Epochs until ``cfg.epochs``: train, validate, log, checkpoint; returns the last epoch's record."""
        cfg = self.cfg
        record: Dict[str, Any] = {}  # floats, and whatever a hook adds (kd bench's timer)
        self.teacher_top1 = None
        if self.teacher is not None and self.epoch == 0 and self.batch_in_epoch == 0 and self.validates:
            self.teacher_top1 = self._validate_teacher()
        previous_end = None
        while self.epoch < cfg.epochs:
            start = time.perf_counter()
            train = self.train_epoch()
            seconds = time.perf_counter() - start
            record = {"epoch": self.epoch + 1, **{f"train_{k}": v for k, v in train.items()},
                      "lr": self.optimizer.param_groups[0]["lr"], "seconds": seconds,
                      "img_per_s": train.get("images", 0) / max(seconds, 1e-9)}
            if previous_end is not None:  # the last epoch's checkpoint and logging, this epoch's loader start
                record["between_epochs_s"] = start - previous_end
            for hook in self.hooks:
                hook.on_epoch_end(self, record)
            if self.validates and ((self.epoch + 1) % cfg.eval_every == 0 or self.epoch == cfg.epochs - 1):
                record.update(self._validate())
            if self.teacher_top1 is not None:
                record["teacher_top1"], self.teacher_top1 = self.teacher_top1, None
            if self.device.type == "cuda":
                record["gpu_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            best = record.get("val_top1", -1.0) > self.best_top1
            self.best_top1 = max(self.best_top1, record.get("val_top1", -1.0))
            record["best_top1"] = self.best_top1
            if self.first_step is not None:
                record.update(self.first_step)
                self.first_step = None
            previous_end = time.perf_counter()
            self.logger.epoch(record)
            self.logger.info(format_record(record, cfg.epochs))
            self.epoch += 1
            self.batch_in_epoch = 0
            self.save(best)
        ended_nonfinite = self.meter.streak.clone()
        self.backend.all_reduce_sum(ended_nonfinite)
        if ended_nonfinite.item() > 0:  # a run is not done on weights that the last steps could not train
            raise KDError(self._nonfinite_message(f"in its last {int(self.meter.streak.item())} step(s)", self.epoch))
        self.logger.close()
        return record

    def _validate_teacher(self) -> float:
        assert self.teacher_precision is not None  # only called for a run with a teacher
        teacher_val = evaluate(self._teacher_logits, self.data.val, self.backend, self.teacher_precision)
        self.logger.info(f"teacher {self.cfg.teacher}: val top-1 {teacher_val['top1']:.2f} "
                         f"(in {kd_teacher.dtype_name(self.teacher_precision.dtype)})")
        note = teacher_preprocessing_note(self.cfg)
        if note:
            self.logger.info(note)
        return teacher_val["top1"]

    def _validate(self) -> Dict[str, float]:
        """The student on the val split: the model the checkpoint holds (every process's buffers as rank 0's)."""
        self.side.eval()
        self.backend.sync_buffers(self.side)
        start = time.perf_counter()
        val = evaluate(self.eval_forward, self.data.val, self.backend, self.precision)
        return {"val_top1": val["top1"], "val_top5": val["top5"], "val_loss": val["loss"],
                "val_s": time.perf_counter() - start}

    def train_epoch(self) -> Dict[str, float]:
        """One epoch (or its rest, after a mid-epoch resume) of :meth:`step` under the loop's rules:
        unreadable images, non-finite losses, stop signals, logging and step checkpoints."""
        loader = self._train_loader()
        loader.set_epoch(self.epoch, self.batch_in_epoch)
        self.steps_in_epoch = len(loader) + self.batch_in_epoch
        it = iter(loader)
        try:
            return self._train_steps(it)
        finally:
            close = getattr(it, "close", None)  # a generator stopped early (error, signal): its thread stops now
            if close is not None:
                close()

    def step(self, batch: Batch) -> StepOutput:
        """One training step on ``batch``: teacher forward, student forward and loss, and the precision's
        backward / sync / unscale / clip / optimizer step (skipped on non-finite gradients), then the
        schedule. Reads nothing back from the device."""
        precision = self.precision
        self._graph_step_begin()
        images = precision.input_cast(batch.images)
        progress = self.epoch + self.batch_in_epoch / max(self.steps_in_epoch, 1)
        t_logits = t_feats = None
        if self.teacher is not None:
            t_logits, t_feats = self.teacher_forward(images)
        with precision.autocast():
            parts = self.model(images, batch.labels, t_logits, t_feats, progress)
        parts = {k: v.float().mean() for k, v in parts.items()}
        flags = self._nonfinite_flags(parts, t_logits)
        skipped = precision.step(parts["loss"], self.optimizer, self.params,
                                 lambda: self.backend.sync_gradients(self.model), self.cfg.grad_clip)
        self.scheduler.step()
        self.global_step += 1
        self.batch_in_epoch += 1
        out = StepOutput(parts, skipped, flags, len(batch))
        for hook in self.hooks:
            hook.on_step(self, out)
        return out

    def _train_steps(self, it) -> Dict[str, float]:
        cfg, backend, steps = self.cfg, self.backend, self.steps_in_epoch
        self.side.train()
        meter = self.meter
        interval = Meter(self.device)
        bar = self.logger.progress(steps, f"epoch {self.epoch + 1}/{cfg.epochs}")
        bar.update(self.batch_in_epoch)
        t_interval = time.perf_counter()
        first_wait = None
        while True:
            t0 = time.perf_counter()
            batch = next(it, None)
            waited = time.perf_counter() - t0
            meter.wait += waited
            first_wait = waited if first_wait is None else first_wait
            if batch is None:
                break
            for path in batch.bad:
                self.logger.info(f"skipped unreadable image {path}")
            if len(batch) == 0:
                raise KDError("a whole batch of images was unreadable; check the data folder")
            out = self.step(batch)
            with torch.no_grad():
                for m in (meter, interval):
                    m.add(out.parts, out.images, out.skipped, len(batch.bad), out.flags)
            bar.update(1)
            if self.first_step is None and self.global_step == self._resumed_step + 1:
                self._log_first_step(t0, waited)
            end_of_epoch = self.batch_in_epoch == steps
            stop_check = self.stop.requested if backend.world_size == 1 else self.global_step % self.stop_every == 0
            if self.global_step % cfg.log_every == 0 or end_of_epoch or stop_check:
                stats = interval.reduce(backend, extra=[float(self.stop.requested), meter.worst, meter.streak,
                                                        float(meter.bad)])
                stop_all, worst, _, bad_epoch = stats.pop("_extra")
                self._log_interval(stats, time.perf_counter() - t_interval, bar)
                interval = Meter(self.device)
                t_interval = time.perf_counter()
                if worst >= cfg.max_nonfinite_steps:
                    raise KDError(self._nonfinite_message(f"for {cfg.max_nonfinite_steps} consecutive steps"))
                if self.bad_images + bad_epoch > cfg.max_bad_images:
                    raise KDError(f"{int(self.bad_images + bad_epoch)} unreadable images, more than "
                                  f"--max-bad-images {cfg.max_bad_images}; see the log for their names")
                if stop_all > 0 and not end_of_epoch:
                    bar.close()
                    self.save(best=False)
                    raise Interrupted(self.stop.signame, self.global_step, self.out)
            if cfg.save_every_steps and self.global_step % cfg.save_every_steps == 0 and not end_of_epoch:
                self.save(best=False, step_copy=True)
        bar.close()
        totals = meter.reduce(backend)
        self.bad_images += int(totals.pop("bad"))
        totals.update(data_wait_s=meter.wait, first_batch_s=first_wait or 0.0, bad_images=self.bad_images)
        self.meter = Meter(self.device)
        self.meter.streak, self.meter.sources = meter.streak, meter.sources  # a non-finite streak spans epochs
        return totals

    def _log_first_step(self, batch_asked: float, waited: float) -> None:
        """Seconds from the command to this process's first step, logged and kept for metrics.jsonl
        (one device sync, once)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        step = time.perf_counter() - batch_asked - waited
        total = time.time() - self.started
        self.first_step = {"startup_s": total, "startup_setup_s": self._setup_seconds, "startup_first_batch_s": waited}
        self.logger.info(f"first step done {total:.1f} s after the command (set-up {self._setup_seconds:.1f} s, "
                         f"then the first batch {waited:.1f} s and the step {step:.1f} s)")

    def _nonfinite_flags(self, parts: Dict[str, torch.Tensor], t_logits: Optional[torch.Tensor]) -> torch.Tensor:
        """1 for each source (the teacher's logits, the student's, each loss term) not finite in this step,
        on the device."""
        if not self.loss_terms:
            self.loss_terms = sorted(k for k in parts if k not in ("loss", LOGITS_SUM))
        teacher = t_logits.sum() if t_logits is not None else torch.zeros((), device=self.device)
        values = torch.stack([teacher, parts.pop(LOGITS_SUM), *[parts[k] for k in self.loss_terms]])
        return (~torch.isfinite(values)).float()

    def _nonfinite_message(self, how_long: str, epoch: Optional[int] = None) -> str:
        """The error for a run whose loss stayed non-finite (a collective); ``epoch`` is 1-based."""
        sources = self.meter.sources.clone()
        self.backend.all_reduce_sum(sources)
        teacher = ((self.cfg.teacher, kd_teacher.dtype_name(self.teacher_precision.dtype))
                   if self.teacher and self.teacher_precision is not None else None)
        return nonfinite_message(how_long, sources.tolist(), self.loss_terms, epoch or self.epoch + 1, self.global_step,
                                 teacher, RunFolder(self.out).last)

    def _log_interval(self, stats: Dict[str, float], elapsed: float, bar) -> None:
        scale = self.precision.loss_scale()
        extra = {"lr": self.optimizer.param_groups[0]["lr"], "bad_images": self.bad_images + self.meter.bad,
                 **({"loss_scale": float(scale)} if scale is not None else {}),
                 **({"gpu_mem_gb": torch.cuda.memory_allocated(self.device) / 2**30}
                    if self.device.type == "cuda" else {})}
        self.logger.interval(stats, extra, elapsed, self.global_step, bar)
