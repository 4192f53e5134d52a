"""The training loop: :meth:`Trainer.step` (one public step) and the rules around it (non-finite
losses, unreadable images, stop signals, logging, checkpoints). It asks the backend and the
precision object; it never branches on which backend or opt level is in use."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from kd import checkpoint
from kd import config as kd_config
from kd import data as kd_data
from kd.cpu import slow_precision_warning
from kd.data.loader import Batch
from kd.errors import KDError, NonFinite
from kd.logging import NullLogger, RunLogger, command_start, first_step_record
from kd.meter import Meter, format_record, nonfinite_flags, nonfinite_message
from kd.optim import build_optimizer, build_scheduler
from kd.precision import make_precision
from kd.runfolder import RunFolder
from kd.runtime import resolve as resolve_runtime
from kd.sides import LOGITS_SUM, StudentSide, build_models
from kd.signals import Interrupted, StopFlag
from kd.step import StepHook, StepOutput, check_batch
from kd.teaching import Teacher
from kd.validation import validate_student


class Trainer:
    """One process's part of a run: built from a config, a set-up backend and the run folder.

    One student of several (``kd train --kd-loss kd,dkd``, :mod:`kd.multi`) is a Trainer built
    with ``shared``: the data pipeline, the teacher's model and the stop flag come from there, its
    teacher is prepared once for all (:meth:`use_teacher`), and the multi-student loop drives
    :meth:`begin_epoch`, :meth:`step` (with the teacher's outputs), :meth:`after_step` and
    :meth:`end_epoch` as :meth:`fit` does for one student.
    """

    def __init__(self, cfg, backend, out: Path, resume_from: Optional[Path] = None, hooks: Sequence[StepHook] = (),
                 validate: bool = True, shared=None):
        """``hooks`` see every step and epoch record; ``validate=False`` skips the teacher's and the
        student's validation passes (timed benchmark runs); ``shared`` is a :class:`kd.together.Shared`."""
        self.started = command_start(default=time.time())
        self.hooks = list(hooks)
        self.validates = validate
        self.first_step: Optional[Dict[str, float]] = None  # seconds to the first step, once taken
        self.loss_terms: List[str] = []  # the loss parts besides the total, in the order of the non-finite flags
        resumed = checkpoint.load(resume_from) if resume_from is not None else None  # a broken file fails first
        self.cfg = cfg
        self.backend = backend
        self.out = Path(out)
        self.resume_from = resume_from
        self.device = dev = backend.device
        self.runtime = resolve_runtime(cfg, dev)
        self.memory_format = self.runtime.memory_format
        prefix = f"[{self.out.name}] " if shared is not None else ""
        self.logger = RunLogger(self.out, cfg.progress_bar, prefix) if backend.is_main else NullLogger()
        if dev.type == "cuda":
            torch.backends.cudnn.benchmark = cfg.cudnn_benchmark

        self.name = self.out.name  # the student's name beside others (kd.multi); its run folder's name
        self.rng: Dict[str, Any] = {}  # kd.multi: its generators' state between its calls (checkpoint.rng_state)
        self.owns_inputs = shared is None
        if shared is None:
            num_replicas, rank = backend.data_shard()
            self.data = kd_data.build(cfg, num_replicas, rank, backend.local_batch(cfg.batch_size), dev,
                                       self.runtime.channels_last)
        else:
            self.data = shared.data
        self.num_classes = num_classes = cfg.num_classes or len(self.data.classes)
        if cfg.num_classes and cfg.data != "synthetic" and cfg.num_classes != len(self.data.classes):
            raise KDError(f"--num-classes {cfg.num_classes} but {cfg.data} has {len(self.data.classes)} class folders")

        self.precision = make_precision(cfg, dev, prefer_apex=backend.prefers_apex_amp)
        self.logger.info(self.precision.describe())
        warning = slow_precision_warning(cfg.opt, self.precision.dtype, dev)
        if warning:
            self.logger.info(warning)
        torch.manual_seed(cfg.seed)  # the same initial student on every process, and beside other students
        student, loss, teacher, s_layers, self.t_layers = build_models(
            cfg, num_classes, shared.teacher_model if shared is not None else None)
        if shared is not None and teacher is not None:
            shared.teacher_model = teacher  # built after this student, as its own run builds it
        self.needs_teacher = teacher is not None

        # Module.to(device, memory_format=...) is valid at run time; torch's overloads list the two apart
        self.side = StudentSide(student, loss, s_layers).to(dev, memory_format=self.memory_format)  # type: ignore[call-overload]
        self.side = backend.prepare_model(self.side)  # before the optimizer: sync-BN layers, parameter layout
        self.prepared_teacher: Optional[Teacher] = None
        self.notes: List[str] = []  # what kd chose for the user, kept as comments in config.yaml
        if teacher is not None and shared is None:
            teacher = teacher.to(dev, memory_format=self.memory_format)
            for hook in self.hooks:
                hook.on_teacher(self, teacher)
            self.use_teacher(Teacher(teacher, self.t_layers, cfg, backend, self.runtime, self.precision, self.data.val,
                                     self.logger.info, self.notes))
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
        self.params = [p for p in self.side.parameters() if p.requires_grad]
        self.scheduler = build_scheduler(cfg, self.optimizer, len(self.data.train))

        self.epoch = 0
        self.batch_in_epoch = 0
        self.global_step = 0
        self.best_top1 = -1.0
        self.bad_images = 0
        self.meter = Meter(dev)
        self.stop = StopFlag() if shared is None else shared.stop
        self.steps_in_epoch = len(self.data.train)
        self.stop_every = min(cfg.log_every, 10)  # steps between stop checks across processes
        self.epoch_ended: Optional[float] = None
        self.teacher_top1: Optional[float] = None
        if resumed is not None:
            checkpoint.restore_run(self, resumed)
            self.logger.info(f"resumed from {resume_from} at epoch {self.epoch + 1}")
        self._resumed_step = self.global_step
        if shared is None:
            self.logger.info(self.data.train.describe())  # after set-up, so a failed start stays one line
            self.start_folder()
        self._setup_seconds = time.time() - self.started

    @property
    def teacher(self):
        """The frozen teacher's module (wrapped forward-only), or None."""
        return self.prepared_teacher.module if self.prepared_teacher is not None else None

    def use_teacher(self, teacher: Teacher) -> None:
        """The prepared teacher this student learns from (its own, or one shared with other students)."""
        self.prepared_teacher = teacher
        self.cfg = dataclasses.replace(self.cfg, teacher_precision=teacher.dtype_name)

    def start_folder(self) -> None:
        """Once set-up has succeeded, the main process starts the run folder (a failed start leaves no
        run behind) and writes config.yaml."""
        if self.backend.is_main:
            RunFolder(self.out).start() if self.resume_from is None else self.out.mkdir(parents=True, exist_ok=True)
            kd_config.save(self.cfg, RunFolder(self.out).config, notes=self.notes)

    def close(self) -> None:
        """Signal handlers back, logs closed, loader workers and threads stopped: nothing outlives the run."""
        if self.owns_inputs:
            self.stop.restore()
            self.data.close()
        self.logger.close()

    def save(self, best: bool, step_copy: bool = False) -> None:
        checkpoint.save_run(self, best, step_copy)

    # ----------------------------------------------------------------- the loop
    def _graph_step_begin(self) -> None:
        """Under CUDA graphs (compile_mode), a new call may overwrite the last call's outputs."""
        if self.graph_step:
            torch.compiler.cudagraph_mark_step_begin()

    def fit(self) -> Dict[str, float]:
        """Epochs until ``cfg.epochs``: train, validate, log, checkpoint; returns the last epoch's record."""
        record: Dict[str, float] = {}
        if self.prepared_teacher is not None and self.epoch == 0 and self.batch_in_epoch == 0 and self.validates:
            self.teacher_top1 = self.prepared_teacher.validate()
        while self.epoch < self.cfg.epochs:
            start = time.perf_counter()
            train = self.train_epoch()
            record = self.end_epoch(train, start, time.perf_counter() - start)
        self.finish()
        return record

    def end_epoch(self, train: Dict[str, float], start: float, seconds: float,
                  extra: Optional[Dict[str, object]] = None) -> Dict[str, float]:
        """The epoch's record from its training totals: hooks, validation, the log, metrics.jsonl and
        the checkpoint; the epoch counter moves on. ``extra`` joins the record first."""
        cfg = self.cfg
        record = {"epoch": self.epoch + 1, **{f"train_{k}": v for k, v in train.items()},
                  "lr": self.optimizer.param_groups[0]["lr"], "seconds": seconds,
                  "img_per_s": train.get("images", 0) / max(seconds, 1e-9), **(extra or {})}
        if self.epoch_ended is not None:  # the last epoch's checkpoint and logging, this epoch's loader start
            record["between_epochs_s"] = start - self.epoch_ended
        for hook in self.hooks:
            hook.on_epoch_end(self, record)
        if self.validates and ((self.epoch + 1) % cfg.eval_every == 0 or self.epoch == cfg.epochs - 1):
            record.update(validate_student(self.side, self.eval_forward, self.data.val, self.backend, self.precision))
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
        self.epoch_ended = time.perf_counter()
        self.logger.epoch(record)
        self.logger.info(format_record(record, cfg.epochs))
        self.epoch += 1
        self.batch_in_epoch = 0
        self.save(best)
        return record

    def finish(self) -> None:
        """The end of training: a run whose last steps were not finite fails; the logs close."""
        ended_nonfinite = self.meter.streak.clone()
        self.backend.all_reduce_sum(ended_nonfinite)
        if ended_nonfinite.item() > 0:  # a run is not done on weights that the last steps could not train
            raise NonFinite(self._nonfinite_message(f"in its last {int(self.meter.streak.item())} step(s)", self.epoch))
        self.logger.close()

    def train_epoch(self) -> Dict[str, float]:
        """One epoch (or its rest, after a mid-epoch resume) of :meth:`step` under the loop's rules:
        unreadable images, non-finite losses, stop signals, logging and step checkpoints."""
        loader = self.data.train
        loader.set_epoch(self.epoch, self.batch_in_epoch)
        self.begin_epoch(len(loader) + self.batch_in_epoch)
        it = iter(loader)
        try:
            first_wait = None
            while True:
                t0 = time.perf_counter()
                batch = next(it, None)
                waited = time.perf_counter() - t0
                self.meter.wait += waited
                first_wait = waited if first_wait is None else first_wait
                if batch is None:
                    break
                check_batch(batch, self.logger.info)
                if self.after_step(self.step(batch), batch, t0, waited):
                    raise self.interrupt()
            return self.end_train_epoch(first_wait)
        finally:
            close = getattr(it, "close", None)  # a generator stopped early (error, signal): its thread stops now
            if close is not None:
                close()

    def step(self, batch: Batch, teacher_out=None) -> StepOutput:
        """One training step on ``batch``: teacher forward (or its outputs ``teacher_out``, computed
        once for several students), student forward and loss, and the precision's backward / sync /
        unscale / clip / optimizer step (skipped on non-finite gradients), then the schedule. Reads
        nothing back from the device."""
        precision = self.precision
        self._graph_step_begin()
        images = precision.input_cast(batch.images)
        progress = self.epoch + self.batch_in_epoch / max(self.steps_in_epoch, 1)
        t_logits = t_feats = None
        if teacher_out is None and self.prepared_teacher is not None:
            teacher_out = self.prepared_teacher.forward(images)
        if teacher_out is not None:
            t_logits, t_feats = teacher_out[0], {k: teacher_out[1][k] for k in self.t_layers}
        with precision.autocast():
            parts = self.model(images, batch.labels, t_logits, t_feats, progress)
        parts = {k: v.float().mean() for k, v in parts.items()}
        self.loss_terms = self.loss_terms or sorted(k for k in parts if k not in ("loss", LOGITS_SUM))
        flags = nonfinite_flags(parts, t_logits, self.loss_terms)
        skipped = precision.step(parts["loss"], self.optimizer, self.params,
                                 lambda: self.backend.sync_gradients(self.model), self.cfg.grad_clip)
        self.scheduler.step()
        self.global_step += 1
        self.batch_in_epoch += 1
        out = StepOutput(parts, skipped, flags, len(batch))
        for hook in self.hooks:
            hook.on_step(self, out)
        return out

    def begin_epoch(self, steps: int) -> None:
        """Train mode, fresh interval meter and progress bar for an epoch of ``steps`` steps."""
        self.steps_in_epoch = steps
        self.side.train()
        self._interval = Meter(self.device)
        self._bar = self.logger.progress(steps, f"epoch {self.epoch + 1}/{self.cfg.epochs}")
        self._bar.update(self.batch_in_epoch)
        self._t_interval = time.perf_counter()

    def after_step(self, out: StepOutput, batch: Batch, asked: float, waited: float) -> bool:
        """The loop's rules after a step: meters, logging, the non-finite and unreadable-image limits
        (a KDError), step checkpoints. True when a stop signal asks every process to stop here."""
        cfg, backend, meter = self.cfg, self.backend, self.meter
        with torch.no_grad():
            for m in (meter, self._interval):
                m.add(out.parts, out.images, out.skipped, len(batch.bad), out.flags)
        self._bar.update(1)
        if self.first_step is None and self.global_step == self._resumed_step + 1:
            self.first_step = first_step_record(self.started, self._setup_seconds, asked, waited, self.device,
                                                self.logger.info)
        end_of_epoch = self.batch_in_epoch == self.steps_in_epoch
        stop_check = self.stop.requested if backend.world_size == 1 else self.global_step % self.stop_every == 0
        if self.global_step % cfg.log_every == 0 or end_of_epoch or stop_check:
            stats = self._interval.reduce(backend, extra=[float(self.stop.requested), meter.worst, meter.streak,
                                                          float(meter.bad)])
            stop_all, worst, _, bad_epoch = stats.pop("_extra")
            self._log_interval(stats, time.perf_counter() - self._t_interval, self._bar)
            self._interval = Meter(self.device)
            self._t_interval = time.perf_counter()
            if worst >= cfg.max_nonfinite_steps:
                raise NonFinite(self._nonfinite_message(f"for {cfg.max_nonfinite_steps} consecutive steps"))
            if self.bad_images + bad_epoch > cfg.max_bad_images:
                raise KDError(f"{int(self.bad_images + bad_epoch)} unreadable images, more than "
                              f"--max-bad-images {cfg.max_bad_images}; see the log for their names")
            if stop_all > 0 and not end_of_epoch:
                return True
        if cfg.save_every_steps and self.global_step % cfg.save_every_steps == 0 and not end_of_epoch:
            self.save(best=False, step_copy=True)
        return False

    def interrupt(self) -> Interrupted:
        """A stop asked for by a signal: this step's checkpoint, and the exception that says so."""
        self._bar.close()
        self.save(best=False)
        return Interrupted(self.stop.signame, self.global_step, self.out)

    def end_train_epoch(self, first_wait: Optional[float]) -> Dict[str, float]:
        """The epoch's training totals over every process (a collective)."""
        self._bar.close()
        meter = self.meter
        totals = meter.reduce(self.backend)
        self.bad_images += int(totals.pop("bad"))
        totals.update(data_wait_s=meter.wait, first_batch_s=first_wait or 0.0, bad_images=self.bad_images)
        self.meter = Meter(self.device)
        self.meter.streak, self.meter.sources = meter.streak, meter.sources  # a non-finite streak spans epochs
        return totals

    def _nonfinite_message(self, how_long: str, epoch: Optional[int] = None) -> str:
        """The error for a run whose loss stayed non-finite (a collective); ``epoch`` is 1-based."""
        sources = self.meter.sources.clone()
        self.backend.all_reduce_sum(sources)
        teacher = (self.cfg.teacher, self.prepared_teacher.dtype_name) if self.prepared_teacher else None
        return nonfinite_message(how_long, sources.tolist(), self.loss_terms, epoch or self.epoch + 1, self.global_step,
                                 teacher, RunFolder(self.out).last)

    def _log_interval(self, stats: Dict[str, float], elapsed: float, bar) -> None:
        scale = self.precision.loss_scale()
        extra = {"lr": self.optimizer.param_groups[0]["lr"], "bad_images": self.bad_images + self.meter.bad,
                 **({"loss_scale": float(scale)} if scale is not None else {}),
                 **({"gpu_mem_gb": torch.cuda.memory_allocated(self.device) / 2**30}
                    if self.device.type == "cuda" else {})}
        self.logger.interval(stats, extra, elapsed, self.global_step, bar)

