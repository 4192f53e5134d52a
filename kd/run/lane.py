"""One student of a run (a *lane*): its side, optimizer, precision, meters, log and checkpoints, and
the rules around its steps (non-finite losses, unreadable images, stop signals, logging, step
checkpoints). :class:`kd.run.loop.Trainer` feeds every lane of a run the same batches and the same
teacher outputs; a lane asks the backend and the precision object and never branches on which
backend or opt level is in use."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, cast

import torch
from torch import nn

from kd import models
from kd.data.data_config import DataConfig
from kd.data.loader import Batch
from kd.errors import KDError, NonFinite
from kd.losses.base import DISTILL_PART, TASK_PART, DistillLoss
from kd.run import checkpoint, dot
from kd.run.ema import ModelEma
from kd.run.log import NullBar, SetupClock, first_step_record
from kd.run.meter import LearningWatch, Meter, format_record, nonfinite_flags, nonfinite_message
from kd.run.record import step_inputs
from kd.run.state import EpochSums, Generators, TrainState, Weights
from kd.run.step import LOGITS_SUM, BufferGuard, StepOutput, apply_gradients
from kd.runfolder import RunFolder
from kd.utils.accuracy import unreadable_note, validate_student
from kd.utils.signals import Interrupted, StopFlag, in_setup

if TYPE_CHECKING:  # the run's loop builds the teacher; a lane only holds it
    from kd.teacher.frozen import Teacher
    from kd.teacher.source import Targets


#: the keys of a validation's record that the moving average's validation adds, with ``_ema`` after them
EMA_RECORD = ("val_top1", "val_top5", "val_loss", "val_s")


class Lane:
    """One student's part of a run in this process, built whole by :func:`kd.run.build.build_lane`
    from its parts: its config and run folder, its fork of the set-up backend, its precision, side
    (the student and its loss's trainable modules), wrapped model, optimizer and schedule, and the
    checkpoint it resumes; whole when built (its stateful parts declared once, in :attr:`stateful`).
    The run's loop (:class:`kd.run.loop.Trainer`) drives :meth:`begin_epoch`,
    :meth:`step` (with the teacher's targets), :meth:`after_step`, :meth:`end_train_epoch` and
    :meth:`end_epoch`.
    """

    def __init__(
        self,
        *,
        name: str,
        cfg,
        backend,
        out: Path,
        data,
        shared,
        logger,
        precision,
        side: nn.Module,
        model: Any,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        renorm: Optional[Callable[[torch.Tensor], torch.Tensor]],
        eval_forward: Callable[[torch.Tensor], Any],
        num_classes: int,
        needs_teacher: bool,
        t_layers: List[str],
        notes: List[str],
        validate: bool = True,
        ema: Optional[ModelEma] = None,
        resumed: Optional[Dict[str, Any]] = None,
    ):
        """``shared``: what the run's students share (:class:`kd.run.loop.Shared`: the stop flag, the
        set-up's clock, the teacher source the run builds after its students); ``side``: the
        student side (:class:`kd.run.sides.StudentSide`) as the precision prepared it; ``model``:
        the side as the backend wrapped it (and torch.compile, where on); ``renorm``: from the
        loaders' normalisation to the student's own (None where they agree); ``t_layers``: the
        teacher layers its loss taps; ``notes``: what kd chose for the user (comments in
        config.yaml); ``validate=False`` skips the teacher's and the student's validation passes
        (timed benchmark runs); ``ema``: the moving average of the student's weights (--model-ema),
        updated after each optimizer step and validated beside the student; ``resumed``: the
        checkpoint (:func:`kd.run.checkpoint.load`) it continues from, restored here."""
        self.name = name  # the student's name beside others; its run folder's name
        self.cfg = cfg
        self.backend = backend
        self.out = out
        self.data = data
        self.shared = shared
        self.stop: StopFlag = shared.stop
        self.clock: SetupClock = shared.clock  # the run's: its set-up parts
        self.logger = logger
        self.device = backend.device
        self.precision = precision
        self.side = side
        self.loss: DistillLoss = side.loss  # type: ignore[assignment]  # a StudentSide's
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.params = [p for p in side.parameters() if p.requires_grad]
        self.buffers = BufferGuard(side)  # the side's buffers, put back on a skipped step
        self.renorm = renorm
        self.eval_forward = eval_forward
        self.num_classes = num_classes
        self.needs_teacher = needs_teacher
        self.t_layers = t_layers
        self.own_notes = notes
        self.state = TrainState()
        self.validates = validate
        self.ema = ema
        self.first_step: Optional[Dict[str, float]] = None  # seconds to the first step, once taken
        self.loss_terms: List[str] = []  # the loss parts besides the total, in the order of the non-finite flags
        self.step_lr = optimizer.param_groups[0]["lr"]  # the lr of the last step taken (logged)
        self.new_bad_files: Set[str] = set()  # the unreadable files this process met since the last check
        self.val_bad_files: Set[str] = set()  # the unreadable val files, named once (the same on every process)
        self.meter = Meter(self.device)
        self.learning = LearningWatch(num_classes, cfg)  # says once where the loss shows no learning
        self.steps_in_epoch = len(data.train)
        self.stop_every = min(cfg.log_every, 10)  # steps between stop checks across processes
        self.epoch_ended: Optional[float] = None
        self._bar: Any = NullBar()  # the epoch's progress bar (begin_epoch); none before the first epoch
        self.generators = Generators(backend)  # the process's as its build left them
        #: what its checkpoint holds beside its training state, by key, restored in this order (kd.run.checkpoint)
        self.stateful: Dict[str, Any] = {
            "student": Weights(precision, cast(nn.Module, side.student)),
            "loss": Weights(precision, self.loss),
            **({"state_dict_ema": ema} if ema is not None else {}),
            "optimizer": optimizer,
            "scheduler": scheduler,
            "precision": precision,
            "meter": EpochSums(self.meter, self.state, backend),
            "rng": self.generators,
        }
        if resumed is not None:
            checkpoint.restore_run(self, resumed)
        self.resumed_step = self.state.global_step  # the global step it started (or resumed) at

    def close(self) -> None:
        """Its logs closed (the run closes what the lanes share)."""
        self.logger.close()

    def save(self, best: bool, step_copy: bool = False) -> None:
        checkpoint.save_run(self, best, step_copy)

    # ----------------------------------------------------------------- the steps
    def finish_pending_epoch(self) -> Optional[Dict[str, float]]:
        """After a resume: the end (validation, log, checkpoint) of an epoch whose training was done
        when a stop cut its validation short; its record, or None where there is no such epoch."""
        if self.state.pending_epoch is None:
            return None
        train, seconds = self.state.pending_epoch
        self.state.pending_epoch = None
        return self.end_epoch(train, time.perf_counter(), seconds)

    def end_epoch(
        self, train: Dict[str, float], start: float, seconds: float, extra: Optional[Dict[str, object]] = None
    ) -> Dict[str, float]:
        """The epoch's record from its training totals: hooks, validation, the log, metrics.jsonl and
        the checkpoint; the epoch counter moves on. ``extra`` joins the record first."""
        cfg, lrs = self.cfg, self.state.epoch_lrs
        record: Dict[str, Any] = {
            "epoch": self.state.epoch + 1,
            **{f"train_{k}": v for k, v in train.items()},
            # the mean lr the epoch's steps trained at (the optimizer's holds the next step's)
            "lr": sum(lrs) / len(lrs) if lrs else self.optimizer.param_groups[0]["lr"],
            "seconds": seconds,
            "img_per_s": train.get("images", 0) / max(seconds, 1e-9),
            "classes": self.num_classes,
            "train_set_images": self.data.num_train,  # the data's, where --limit-train-batches trains fewer
            **(extra or {}),
        }
        if self.epoch_ended is not None:  # the last epoch's checkpoint and logging, this epoch's loader start
            record["between_epochs_s"] = start - self.epoch_ended
        if self.validates and self.state.epoch == 0 and self.teacher is not None:
            # the teacher's top-1 after the first epoch, not before it: the first step comes sooner, and
            # its probe has checked it on a few validation batches already (kd.teacher.frozen)
            top1 = self.teacher.validate(self.stop)
            if top1 is None:  # stopped: as below
                self.state.pending_epoch = (train, seconds)
                raise self.interrupt()
            record["teacher_top1"] = top1
            record["teacher_top5"] = self.teacher.top5
            self.val_bad_files.update(self.teacher.unreadable_files)  # named by the teacher's line
        if self.validates and ((self.state.epoch + 1) % cfg.eval_every == 0 or self.state.epoch == cfg.epochs - 1):
            val, unreadable = self._validate(self.side, self.eval_forward, self.precision, train, seconds)
            record.update(val)
            if self.ema is not None:
                precision = self.precision.for_float32_copy()
                ema, _ = self._validate(self.ema.module, self.ema.forward, precision, train, seconds)
                record.update({f"{k}_ema": ema[k] for k in EMA_RECORD})
            self._unreadable_val(unreadable, int(val["val_images"]))
        if self.device.type == "cuda":
            record["gpu_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        best = record.get("val_top1", -1.0) > self.state.best_top1
        if best:
            self.state.best_epoch = self.state.epoch + 1
        self.state.best_top1 = max(self.state.best_top1, record.get("val_top1", -1.0))
        record["best_top1"] = self.state.best_top1
        if self.first_step is not None:
            record.update(self.first_step)
            self.first_step = None
        self.epoch_ended = time.perf_counter()
        self.logger.epoch(record)
        self.logger.info(format_record(record, cfg.epochs))
        stalled = self.learning.see(record)
        if stalled:
            self.logger.info(stalled)
        self.state.epoch += 1
        self.state.batch_in_epoch = 0
        self.state.epoch_lrs = []
        self.save(best)
        return record

    def _validate(self, module: nn.Module, forward, precision, train: Dict[str, float], seconds: float):
        """``module`` (the student, or its moving average) through ``forward`` on the val split:
        :func:`kd.utils.accuracy.validate_student`'s (record, unreadable files). A stop ends the
        epoch here: its training is kept, and a resume validates it."""
        stop = lambda: self.stop.requested  # noqa: E731
        result = validate_student(module, forward, self.data.val, self.backend, precision, stop)
        if result is None:
            self.state.pending_epoch = (train, seconds)
            raise self.interrupt()
        return result

    def _unreadable_val(self, unreadable: List[str], images: int) -> None:
        """The val files a validation could not read (every process's): named once in the log, and
        counted with the unreadable training files under --max-bad-images (a KDError over it)."""
        new = [path for path in unreadable if path not in self.val_bad_files]
        for path in new:
            self.logger.info(f"unreadable val image {path}")
        if new:
            self.logger.info(unreadable_note(len(unreadable), images))
        self.val_bad_files.update(new)
        self._check_bad_images()

    def gather_bad_files(self, gathered: List[List[str]]) -> None:
        """Each process's unreadable files since the last check (``gathered``, by rank) into the run's
        count; the main process names those the others met (its own it named as it met them)."""
        for rank, paths in enumerate(gathered):
            for path in paths:
                if rank != self.backend.rank and path not in self.state.bad_files:
                    self.logger.info(f"skipped unreadable image {path} (process {rank})")
            self.state.bad_files.update(paths)
        self.new_bad_files.clear()

    def _check_bad_images(self) -> None:
        """KDError where the distinct unreadable files (training's and validation's) pass --max-bad-images."""
        bad = len(self.state.bad_files | self.val_bad_files)  # distinct files: one bad file is met every epoch
        if bad > self.cfg.max_bad_images:
            raise KDError(
                f"{bad} unreadable images, more than --max-bad-images {self.cfg.max_bad_images}; "
                f"see the log for their names"
            )

    def finish(self) -> None:
        """The end of training: a run whose last steps had a non-finite loss fails (steps skipped on
        their gradients alone, a float16 overflow say, fail only at --max-nonfinite-steps); the logs close."""
        meter = self.meter
        ended_nonfinite = ((meter.streak > 0) & (meter.sources.reshape(-1)[:-1] > 0).any()).float()
        self.backend.all_reduce_sum(ended_nonfinite)
        if ended_nonfinite.item() > 0:  # a run is not done on weights that the last steps could not train
            raise NonFinite(
                self._nonfinite_message(f"in its last {int(self.meter.streak.item())} step(s)", self.state.epoch)
            )
        self.logger.close()

    def step(self, batch: Batch, targets: Optional[Targets] = None) -> StepOutput:
        """One training step on ``batch``: student forward and loss against the teacher's ``targets``
        (:class:`kd.teacher.source.TeacherSource`; None for a student alone), and the precision's
        backward / sync / unscale / clip / optimizer step (skipped on non-finite gradients), then the
        schedule. Reads nothing back from the device."""
        precision = self.precision
        progress = self.state.epoch + self.state.batch_in_epoch / max(self.steps_in_epoch, 1)
        prepare = lambda images: precision.input_cast(images if self.renorm is None else self.renorm(images))  # noqa: E731
        inputs = step_inputs(batch, targets, self.loss, self.t_layers, prepare, progress, self.state.global_step)
        self.buffers.save()
        with precision.autocast():
            parts = self.model(inputs)
        parts = {k: v.float().mean() for k, v in parts.items()}
        task, distill = parts.pop(TASK_PART, None), parts.pop(DISTILL_PART, None)  # DOT's parts (--dot)
        self.loss_terms = self.loss_terms or sorted(k for k in parts if k not in ("loss", LOGITS_SUM))
        buffers_finite = self.buffers.check()
        flags = nonfinite_flags(parts, targets.logits if targets is not None else None, self.loss_terms, buffers_finite)
        # The step's policy: a step whose loss or buffers are not finite is skipped whatever its
        # gradients say. Its gradients are made NaN (x1.0 otherwise: bit for bit the same) before
        # any sync, so every process and every skip rule below (loss scaler, kd's own check, a
        # fused optimizer's) refuses it alike; the loss scale does not back off for it.
        good = torch.isfinite(parts["loss"])
        if buffers_finite is not None:
            good = good & buffers_finite
        refused = torch.where(good, 1.0, float("nan"))
        backend = self.backend
        skipped = apply_gradients(
            precision,
            (parts["loss"] if distill is None else task) * refused,
            self.optimizer,
            self.params,
            lambda: backend.sync_gradients(self.model),
            self.cfg.grad_clip,
            keep_scale=~good,
            apart=None if distill is None else distill * refused,
            reduce_apart=lambda grads: dot.average(grads, backend.world_size, backend.all_reduce_sum),
        )
        self.buffers.restore(skipped)  # a skipped step leaves BatchNorm's statistics as they were
        if self.ema is not None:  # and the moving average too
            self.ema.update(self.state.global_step + 1, skipped)
        flags = torch.cat([flags, (skipped & good).float().reshape(1)])  # skipped on its gradients alone
        self.step_lr = self.optimizer.param_groups[0]["lr"]  # the lr this step trained at (logged)
        self.state.epoch_lrs.append(self.step_lr)
        self.scheduler.step()
        self.loss.after_step()
        self.state.global_step += 1
        self.state.batch_in_epoch += 1
        return StepOutput(parts, skipped, flags, len(batch))

    def begin_epoch(self, steps: int) -> None:
        """Train mode, fresh interval meter and progress bar for an epoch of ``steps`` steps."""
        self.steps_in_epoch = steps
        self.side.train()
        self.buffers.refresh()  # the buffers as they are now (after casts, a resume)
        if self.ema is not None:
            self.ema.refresh()
        self._interval = Meter(self.device)
        self._bar = self.logger.progress(steps, f"epoch {self.state.epoch + 1}/{self.cfg.epochs}")
        self._bar.update(self.state.batch_in_epoch)
        self._t_interval = time.perf_counter()

    def after_step(self, out: StepOutput, batch: Batch, asked: float, waited: float) -> bool:
        """The loop's rules after a step: meters, logging, the non-finite and unreadable-image limits
        (a KDError), step checkpoints. True when a stop signal asks every process to stop here."""
        cfg, backend, meter = self.cfg, self.backend, self.meter
        with torch.no_grad():
            for m in (meter, self._interval):
                m.add(out.parts, out.images, out.skipped, out.flags)
        self.new_bad_files.update(p for p in batch.bad if p not in self.state.bad_files)
        self._bar.update(1)
        if self.first_step is None and self.state.global_step == self.resumed_step + 1:
            self.first_step = first_step_record(self.clock, asked, waited, self.device, self.logger.info)
        end_of_epoch = self.state.batch_in_epoch == self.steps_in_epoch
        stop_check = self.stop.requested if backend.world_size == 1 else self.state.global_step % self.stop_every == 0
        if self.state.global_step % cfg.log_every == 0 or end_of_epoch or stop_check:
            # counts are summed over the processes; the streak limit is each process's own (how many
            # processes reached it, so that the limit does not shrink with their number)
            too_long = (meter.worst >= cfg.max_nonfinite_steps).float()
            new_bad = float(len(self.new_bad_files))
            stats = self._interval.reduce(backend, extra=[float(self.stop.requested), too_long, new_bad])
            stop_all, too_long_anywhere, new_bad_anywhere = stats.pop("_extra")
            if new_bad_anywhere > 0:  # rare: the unreadable files met for the first time, from every process
                self.gather_bad_files(backend.all_gather_object(sorted(self.new_bad_files)))
            self._log_interval(stats, time.perf_counter() - self._t_interval, self._bar)
            self._interval = Meter(self.device)
            self._t_interval = time.perf_counter()
            if too_long_anywhere > 0:
                raise NonFinite(self._nonfinite_message(f"for {cfg.max_nonfinite_steps} consecutive steps"))
            self._check_bad_images()
            if stop_all > 0 and not end_of_epoch:
                return True
        if cfg.save_every_steps and self.state.global_step % cfg.save_every_steps == 0 and not end_of_epoch:
            self.save(best=False, step_copy=True)
        return False

    def interrupt(self) -> Interrupted:
        """A stop asked for by a signal: this step's checkpoint, and the exception that says so."""
        self._bar.close()
        self.save(best=False)
        return Interrupted(self.stop.signame or "a signal", self.state.global_step, self.out)

    def end_train_epoch(self, first_wait: Optional[float]) -> Dict[str, float]:
        """The epoch's training totals over every process (a collective)."""
        self._bar.close()
        meter = self.meter
        totals = meter.reduce(self.backend)
        totals.update(data_wait_s=meter.wait, first_batch_s=first_wait or 0.0, bad_images=len(self.state.bad_files))
        meter.next_epoch()
        return totals

    def _nonfinite_message(self, how_long: str, epoch: Optional[int] = None) -> str:
        """The error for a run whose loss stayed non-finite (a collective); ``epoch`` is 1-based."""
        sources = self.meter.sources.clone()
        self.backend.all_reduce_sum(sources)
        teacher = (self.cfg.teacher, self.teacher.dtype_name) if self.teacher else None
        return nonfinite_message(
            how_long,
            sources.tolist(),
            self.loss_terms,
            epoch or self.state.epoch + 1,
            self.state.global_step,
            teacher,
            RunFolder(self.out).last,
        )

    def _log_interval(self, stats: Dict[str, float], elapsed: float, bar) -> None:
        scale = self.precision.loss_scale()
        extra = {
            "lr": self.step_lr,  # the last step's
            "bad_images": len(self.state.bad_files | self.new_bad_files),
            **({"loss_scale": float(scale)} if scale is not None else {}),
            **({"gpu_mem_gb": torch.cuda.memory_allocated(self.device) / 2**30} if self.device.type == "cuda" else {}),
        }
        self.logger.interval(stats, extra, elapsed, self.state.global_step, bar)

    def log_data_configs(self) -> None:
        """Each model's normalisation and evaluation transform, and where it came from."""
        cfg = self.cfg
        for role, name, data, weights in (
            ("student", cfg.student, cfg.student_data, cfg.student_weights),
            ("teacher", cfg.teacher, cfg.teacher_data, cfg.teacher_weights),
        ):
            if data:
                config = DataConfig.from_dict(data)
                if role == "student":  # the run's crops as they are; --val-resize, val_interpolation where given
                    given = (cfg.val_resize, cfg.val_interpolation)
                    line = f"train {cfg.image_size}; " + config.describe(cfg.image_size, *given)
                else:  # the crops at its own size, its own evaluation
                    line = f"{config.training_line(cfg.image_size)}; " + config.describe(cfg.image_size, own=True)
                note = models.pretrained_note(name, weights, f"--{role}-weights")
                self.logger.info(f"{role} {name}: {line}" + (f"; {note}" if note else ""))

    @property
    def teacher(self) -> Optional[Teacher]:
        """The live teacher this student learns from (its top-1, its precision), once the run built it."""
        return self.shared.teacher if self.needs_teacher else None

    @property
    def saved_config(self):
        """The config its config.yaml and checkpoints record: its own, with what the teacher source it
        learns from fixed (the teacher's precision as probed, or a store's teacher)."""
        taught = self.shared.taught if self.needs_teacher else {}
        return dataclasses.replace(self.cfg, **taught) if taught else self.cfg

    @property
    def notes(self) -> List[str]:
        """What kd chose for this student (comments in config.yaml): its own, then its teacher source's."""
        return self.own_notes + (self.shared.notes if self.needs_teacher else [])


def stop_in_setup(stop: StopFlag, backend) -> None:
    """Before the first step: a stop asked for during set-up, in any process, ends the run here with
    nothing written (a fresh run's folder is removed by :func:`kd.run.launch.train`). A collective:
    every process decides alike."""
    flag = torch.tensor(float(stop.requested), device=backend.device)
    backend.all_reduce_sum(flag)
    if flag.item() > 0:
        raise in_setup(stop.signame)
