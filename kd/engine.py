"""The training loop and evaluation. It asks the backend and the precision object; it never
branches on which backend or opt level is in use."""
from __future__ import annotations

import copy
import dataclasses
import signal
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch import nn

import kd
from kd import checkpoint, models
from kd import teacher as kd_teacher
from kd import config as kd_config
from kd import data as kd_data
from kd.errors import KDError
from kd.data.folder import default_val_resize
from kd.features import check_layers, layer_names, tap
from kd.cpu import slow_precision_warning
from kd.fuse import fuse_teacher
from kd.launch import start_run_folder
from kd.logging import NullLogger, RunLogger, command_start
from kd.losses import DistillInputs, build_loss, split_layers
from kd.optim import build_optimizer, build_scheduler


LOGITS_SUM = "_student_logits_sum"


class StudentSide(nn.Module):
    """The trainable side: the student and the loss with its connectors.

    The backend wraps this one module, so connector gradients are synchronised with the
    student's; the forward returns the loss parts, so DataParallel replicas compute them too.
    """

    def __init__(self, student: nn.Module, loss: nn.Module, layers: List[str]):
        super().__init__()
        self.student = student
        self.loss = loss
        self.layers = layers

    def forward(self, images, labels, teacher_logits=None, teacher_feats=None, progress: float = 0.0):
        feats: Dict[str, torch.Tensor] = {}
        with tap(self.student, self.layers, feats):
            logits = self.student(images)
        feats = {k: feats[k] for k in self.layers}  # spec order: the losses pair by position
        parts = self.loss(DistillInputs(logits, labels, teacher_logits, feats, teacher_feats or {}, progress))
        parts[LOGITS_SUM] = logits.detach().float().sum()  # finite iff every logit is: names a non-finite loss's source
        return parts


class TeacherSide(nn.Module):
    """The frozen teacher: logits cast to float32 for the KD softmax, plus tapped features."""

    def __init__(self, teacher: nn.Module, layers: List[str]):
        super().__init__()
        self.teacher = teacher
        self.layers = layers

    def forward(self, images):
        feats: Dict[str, torch.Tensor] = {}
        with tap(self.teacher, self.layers, feats):
            logits = self.teacher(images)
        feats = {k: feats[k] for k in self.layers}
        return logits.float(), feats


@torch.no_grad()
def calibrate_batchnorm(model: nn.Module, loader, batches: int = 3) -> None:
    """Benchmarks only: BatchNorm statistics of a random-init teacher estimated on the input.

    A random-init network in eval mode (running mean 0, variance 1) lets activations grow
    layer by layer until float16 overflows, which would make an fp16 benchmark measure
    skipped steps. Estimating the statistics on a few batches keeps them in range.
    """
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the calibration batches
    model.train()
    loader.set_epoch(0)
    for _, batch in zip(range(batches), loader):
        model(batch.images)
    for m, momentum in zip(bns, momenta):
        m.momentum = momentum
    model.eval()


def accuracy_counts(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[correct@1, correct@5] for a batch, on the device."""
    k = min(5, logits.shape[1])
    top = logits.topk(k, dim=1).indices
    hit = top.eq(labels.view(-1, 1))
    return torch.stack([hit[:, :1].any(dim=1).sum(), hit.any(dim=1).sum()]).float()


@torch.no_grad()
def evaluate(forward, loader, backend, precision, limit: Optional[int] = None) -> Dict[str, float]:
    """top-1/top-5 (percent), loss and non-finite count of ``forward(images) -> logits`` over the
    val split (its first ``limit`` batches per process, where given).

    ``precision`` gives ``autocast()`` and ``input_cast()`` (a run's or a teacher's precision).
    Exact across processes: the val sampler shards without padding and the counts are summed.
    The caller puts the model in eval mode.
    """
    sums = torch.zeros(5, device=backend.device)  # correct1, correct5, n, loss*n, rows with non-finite logits
    for index, batch in enumerate(loader):
        if limit is not None and index >= limit:
            break
        if len(batch) == 0:
            continue
        with precision.autocast():
            logits = forward(precision.input_cast(batch.images))
        logits = logits.float()
        sums[:2] += accuracy_counts(logits, batch.labels)
        sums[2] += len(batch)
        sums[3] += torch.nn.functional.cross_entropy(logits, batch.labels, reduction="sum")
        sums[4] += (~torch.isfinite(logits).all(dim=1)).sum()
    backend.all_reduce_sum(sums)
    c1, c5, n, loss, nonfinite = sums.tolist()
    n = max(n, 1.0)
    return {"top1": 100.0 * c1 / n, "top5": 100.0 * c5 / n, "loss": loss / n, "count": int(sums[2].item()),
            "nonfinite": int(nonfinite)}


class Trainer:
    """One process's part of a run: built from a config, a set-up backend and the run folder."""

    def __init__(self, cfg, backend, out: Path, resume_from: Optional[Path] = None):
        self.started = command_start(default=time.time())
        self.first_step: Optional[Dict[str, float]] = None  # seconds to the first step, once taken
        self.loss_terms: List[str] = []  # the loss parts besides the total, in the order of the non-finite flags
        resumed = checkpoint.load(resume_from) if resume_from is not None else None  # a broken file fails first
        self.cfg = cfg
        self.backend = backend
        self.out = Path(out)
        self.device = backend.device
        dev = self.device
        channels_last = cfg.channels_last if cfg.channels_last is not None else dev.type == "cuda"
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.logger = RunLogger(self.out, cfg.progress_bar) if backend.is_main else NullLogger()
        if dev.type == "cuda":
            torch.backends.cudnn.benchmark = cfg.cudnn_benchmark

        torch.manual_seed(cfg.seed)  # the same initial student on every process
        num_replicas, rank = backend.data_shard()
        self.data = kd_data.build(cfg, num_replicas, rank, backend.local_batch(cfg.batch_size), dev, channels_last)
        num_classes = cfg.num_classes or len(self.data.classes)
        if cfg.num_classes and cfg.data != "synthetic" and cfg.num_classes != len(self.data.classes):
            raise KDError(f"--num-classes {cfg.num_classes} but {cfg.data} has {len(self.data.classes)} class folders")
        self.num_classes = num_classes

        self.precision = backend.precision()
        self.logger.info(self.precision.describe())
        warning = slow_precision_warning(cfg.opt, self.precision.dtype, dev)
        if warning:
            self.logger.info(warning)
        loss_args = cfg.loss_kwargs()
        if cfg.no_teacher:  # KD hyper-parameters (from a recipe, say) mean nothing without a teacher
            from kd.losses.kd import CrossEntropy

            loss_args = {k: v for k, v in loss_args.items() if k in CrossEntropy.defaults}
        loss = build_loss("ce" if cfg.no_teacher else cfg.kd_loss, num_classes, loss_args)
        student = models.build(cfg.student, num_classes, cfg.student_weights)
        teacher = None
        if loss.needs_teacher:
            teacher = models.freeze(models.build(cfg.teacher, num_classes, cfg.teacher_weights))
        s_layers, t_layers = self._feature_layers(loss, student, teacher)

        self.side = StudentSide(student, loss, s_layers).to(dev, memory_format=self.memory_format)
        self.side = backend.prepare_model(self.side)  # before the optimizer: sync-BN layers, parameter layout
        self.teacher = None
        self.teacher_precision: Optional[kd_teacher.TeacherPrecision] = None
        self.notes: List[str] = []  # what kd chose for the user, kept as comments in config.yaml
        if teacher is not None:
            teacher = teacher.to(dev, memory_format=self.memory_format)
            if cfg.timing_warmup and cfg.teacher_weights == "none":
                calibrate_batchnorm(teacher, self.data.train)
            teacher = self._prepare_teacher(teacher, t_layers)
            self.teacher = backend.wrap_forward(TeacherSide(teacher, t_layers))
            self.cfg = cfg = dataclasses.replace(cfg, teacher_precision=kd_teacher.dtype_name(self.teacher_precision.dtype))
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
        self.scheduler = build_scheduler(cfg, self.optimizer, len(self.data.train))

        self.epoch = 0
        self.batch_in_epoch = 0
        self.global_step = 0
        self.best_top1 = -1.0
        self.bad_images = 0
        self.meter = Meter(dev)
        self._meter_state = None
        self.stop = StopFlag()
        self.timer = StepTimer(cfg.timing_warmup, backend)
        self.stop_every = min(cfg.log_every, 10)  # steps between stop checks across processes
        if resumed is not None:
            self._restore(resumed)
            self.logger.info(f"resumed from {resume_from} at epoch {self.epoch + 1}")
        self._resumed_step = self.global_step
        self.logger.info(self.data.train.describe())  # after set-up, so a failed start stays one line
        if backend.is_main:  # written once set-up has succeeded, so a failed start leaves no run behind
            if resume_from is None:
                start_run_folder(self.out)
            else:
                self.out.mkdir(parents=True, exist_ok=True)
            kd_config.save(cfg, self.out / "config.yaml", notes=self.notes)
        self._setup_seconds = time.time() - self.started

    def close(self) -> None:
        """Signal handlers back, logs closed, loader workers and threads stopped: nothing outlives the run."""
        self.stop.restore()
        self.logger.close()
        self.data.close()

    # ----------------------------------------------------------------- set-up helpers
    def _feature_layers(self, loss, student, teacher):
        """(student layers, teacher layers) to tap; builds the loss's connectors from a dry run."""
        if not loss.uses_features:
            return [], []
        specs = self.cfg.feature_layers or loss.default_layers(layer_names(student), layer_names(teacher))
        s_layers, t_layers = split_layers(specs)
        check_layers(student, s_layers, f"student {self.cfg.student}")
        check_layers(teacher, t_layers, f"teacher {self.cfg.teacher}")
        probe = torch.zeros(2, 3, self.cfg.image_size, self.cfg.image_size)
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

    def _prepare_teacher(self, teacher: nn.Module, layers: List[str]) -> nn.Module:
        """The frozen teacher, fused for inference (kd.fuse) where asked, in the precision that
        :func:`kd.teacher.choose` finds it runs well in (sets ``self.teacher_precision``).

        The choice runs the teacher on a few validation batches; where the device refuses a
        fused call there (a cuDNN without runtime fusion, say), the plain teacher is used and
        the log says why.
        """
        fuse = self.cfg.fuse_teacher if self.cfg.fuse_teacher is not None else self.device.type == "cuda"
        if fuse:
            fused, note = fuse_teacher(copy.deepcopy(teacher), keep=layers)
            try:
                chosen = self._choose_teacher_precision(fused.to(memory_format=self.memory_format), layers)
            except RuntimeError as exc:
                self.logger.info(f"teacher: not fused, the fused model failed on {self.device} "
                                 f"({str(exc).splitlines()[0][:160]})")
            else:
                self.logger.info(f"teacher: {note}")
                return chosen
        return self._choose_teacher_precision(teacher, layers)

    def _choose_teacher_precision(self, teacher: nn.Module, layers: List[str]) -> nn.Module:
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

    def _restore(self, state: dict) -> None:
        side_state = {f"student.{k}": v for k, v in state["student"].items()}
        side_state.update({f"loss.{k}": v for k, v in state.get("loss", {}).items()})
        self.precision.load_model_state(self.side, side_state)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state.get("precision", {}))
        self.epoch = state["epoch"]
        self.batch_in_epoch = state.get("batch_in_epoch", 0)
        self.global_step = state["global_step"]
        self.best_top1 = state["best_top1"]
        self.bad_images = state.get("bad_images", 0)
        if state.get("meter") and self.backend.is_main:
            self.meter.load_state_dict(state["meter"])
        rng = state.get("rng", {}).get(str(self.backend.rank))
        if rng is not None:
            checkpoint.set_rng_state(rng)

    def state(self) -> dict:
        side = self.precision.model_state(self.side)
        return {
            "format": checkpoint.FORMAT_VERSION,
            "kd_version": kd.__version__,
            "student": {k[len("student."):]: v for k, v in side.items() if k.startswith("student.")},
            "loss": {k[len("loss."):]: v for k, v in side.items() if k.startswith("loss.")},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "precision": self.precision.state_dict(),
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "global_step": self.global_step,
            "best_top1": self.best_top1,
            "bad_images": self.bad_images,
            "meter": self._meter_state,
            "rng": self._rng_states,
            "student_name": self.cfg.student,
            "num_classes": self.num_classes,
            "config": self.cfg.to_dict(),
        }

    def save(self, best: bool, step_copy: bool = False) -> None:
        """Checkpoint on the main process: last.pt (and best.pt, or a step_N.pt copy), atomically.

        A state reached through a non-finite loss is not saved, so the last good one stays.
        A failed write (disk full) keeps the previous file and stops the run with a clear error.
        """
        self.backend.sync_buffers(self.side)
        # every process's generators (each draws its own dropout masks), restored rank by rank
        self._rng_states = {str(rank): rng for rank, rng in enumerate(self.backend.all_gather_object(checkpoint.rng_state()))}
        # a mid-epoch checkpoint holds the epoch's sums over every process; rank 0 alone restores them
        self._meter_state = self.meter.global_state(self.backend) if self.batch_in_epoch else None
        if self.backend.is_main and self.meter.streak.item() > 0:
            self.logger.info("not checkpointing: the last loss was not finite; the previous checkpoint stays")
        elif self.backend.is_main:
            folder = self.out / "checkpoints"
            path = folder / "last.pt"
            try:
                checkpoint.save_atomic(self.state(), path)
                if best:
                    checkpoint.copy_atomic(path, folder / "best.pt")
                if step_copy:
                    checkpoint.copy_atomic(path, folder / f"step_{self.global_step:08d}.pt")
                    for old in sorted(folder.glob("step_*.pt"))[:-self.cfg.keep_last]:
                        old.unlink()
            except OSError as exc:
                raise KDError(f"could not write a checkpoint to {folder}: {exc.strerror or exc}; "
                              f"the previous checkpoint is intact") from None
        self.backend.barrier()

    # ----------------------------------------------------------------- the loop
    def _graph_step_begin(self) -> None:
        """Under CUDA graphs (compile_mode), a new call may overwrite the last call's outputs."""
        if self.graph_step:
            torch.compiler.cudagraph_mark_step_begin()

    def _teacher_logits(self, images: torch.Tensor) -> torch.Tensor:
        self._graph_step_begin()
        return self.teacher(images)[0]

    def teacher_forward(self, images: torch.Tensor):
        """The frozen teacher's float32 logits and tapped features for a batch, in its own precision."""
        precision = self.teacher_precision
        with torch.no_grad(), precision.autocast():
            return self.teacher(precision.input_cast(images))

    def fit(self) -> Dict[str, float]:
        cfg = self.cfg
        record: Dict[str, float] = {}
        if self.teacher is not None and self.epoch == 0 and self.batch_in_epoch == 0 and not cfg.timing_warmup:
            teacher_val = evaluate(self._teacher_logits, self.data.val, self.backend, self.teacher_precision)
            self.teacher_top1 = teacher_val["top1"]
            self.logger.info(f"teacher {cfg.teacher}: val top-1 {teacher_val['top1']:.2f} "
                             f"(in {kd_teacher.dtype_name(self.teacher_precision.dtype)})")
            note = teacher_preprocessing_note(cfg)
            if note:
                self.logger.info(note)
        else:
            self.teacher_top1 = None
        previous_end = None
        while self.epoch < cfg.epochs:
            start = time.perf_counter()
            train = self.train_epoch()
            seconds = time.perf_counter() - start
            last = self.epoch == cfg.epochs - 1
            record = {"epoch": self.epoch + 1, **{f"train_{k}": v for k, v in train.items()},
                      "lr": self.optimizer.param_groups[0]["lr"], "seconds": seconds}
            record["img_per_s"] = train.get("images", 0) / max(seconds, 1e-9)
            if previous_end is not None:  # the last epoch's checkpoint and logging, this epoch's loader start
                record["between_epochs_s"] = start - previous_end
            if self.timer.images:
                record.update(self.timer.result(self.backend))
            if ((self.epoch + 1) % cfg.eval_every == 0 or last) and not cfg.timing_warmup:
                self.side.eval()
                self.backend.sync_buffers(self.side)  # evaluate the model the checkpoint holds
                t_val = time.perf_counter()
                val = evaluate(self.eval_forward, self.data.val, self.backend, self.precision)
                record.update(val_top1=val["top1"], val_top5=val["top5"], val_loss=val["loss"],
                              val_s=time.perf_counter() - t_val)
            if self.teacher_top1 is not None:
                record["teacher_top1"] = self.teacher_top1
                self.teacher_top1 = None
            if torch.cuda.is_available() and self.device.type == "cuda":
                record["gpu_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            best = record.get("val_top1", -1.0) > self.best_top1
            if best:
                self.best_top1 = record["val_top1"]
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

    def train_epoch(self) -> Dict[str, float]:
        loader = self.data.train
        loader.set_epoch(self.epoch, self.batch_in_epoch)
        it = iter(loader)
        try:
            return self._train_steps(it, len(loader) + self.batch_in_epoch)
        finally:
            close = getattr(it, "close", None)  # a generator stopped early (error, signal): its thread stops now
            if close is not None:
                close()

    def _train_steps(self, it, steps: int) -> Dict[str, float]:
        cfg, backend, precision = self.cfg, self.backend, self.precision
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
            self._graph_step_begin()
            images = precision.input_cast(batch.images)
            progress = self.epoch + self.batch_in_epoch / max(steps, 1)
            t_logits = t_feats = None
            if self.teacher is not None:
                t_logits, t_feats = self.teacher_forward(images)
            with precision.autocast():
                parts = self.model(images, batch.labels, t_logits, t_feats, progress)
            parts = {k: v.float().mean() for k, v in parts.items()}
            flags = self._nonfinite_flags(parts, t_logits)
            was_skipped = precision.step(parts["loss"], self.optimizer, self.params,
                                         lambda: backend.sync_gradients(self.model), cfg.grad_clip)
            self.scheduler.step()
            self.global_step += 1
            self.batch_in_epoch += 1
            self.timer.step(self.global_step, len(batch))
            with torch.no_grad():
                for m in (meter, interval):
                    m.add(parts, len(batch), was_skipped, len(batch.bad), flags)
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
        """1 for each source (the teacher's logits, the student's, each loss term) not finite in this step, on the device."""
        if not self.loss_terms:
            self.loss_terms = sorted(k for k in parts if k not in ("loss", LOGITS_SUM))
        teacher = t_logits.sum() if t_logits is not None else torch.zeros((), device=self.device)
        values = torch.stack([teacher, parts.pop(LOGITS_SUM), *[parts[k] for k in self.loss_terms]])
        return (~torch.isfinite(values)).float()

    def _nonfinite_message(self, how_long: str, epoch: Optional[int] = None) -> str:
        """The error for a run whose loss stayed non-finite: where it came from and what to do (a collective).
        ``epoch`` (1-based) defaults to the current one."""
        sources = self.meter.sources.clone()
        self.backend.all_reduce_sum(sources)
        names = ["the teacher's logits", "the student's logits"] + [f"the loss term {k!r}" for k in self.loss_terms]
        found = [name for name, hit in zip(names, sources.tolist()) if hit > 0]
        if found and found[0] == "the teacher's logits":
            hint = (f"the teacher {self.cfg.teacher} runs in {kd_teacher.dtype_name(self.teacher_precision.dtype)}: "
                    f"try --teacher-precision float32, and check --teacher-weights")
        elif found and found[0] == "the student's logits":
            hint = "lower --lr, add --warmup-epochs or --grad-clip, or use --opt O0 or --amp-dtype bfloat16"
        else:
            hint = "check the method's hyper-parameters (--loss-arg) and lower --lr"
        source = f"{' and '.join(found)} {'was' if len(found) == 1 else 'were'} not finite" if found else "source unknown"
        last = self.out / "checkpoints" / "last.pt"
        kept = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint was written"
        return (f"the loss was not finite {how_long} (epoch {epoch or self.epoch + 1}, step {self.global_step}): {source}; "
                f"those steps were skipped and the run stopped, {kept}; {hint}")

    def _log_interval(self, stats: Dict[str, float], elapsed: float, bar) -> None:
        scalars = {k: v for k, v in stats.items() if k not in ("images", "bad")}
        scalars.update(lr=self.optimizer.param_groups[0]["lr"], img_per_s=stats["images"] / max(elapsed, 1e-9),
                       bad_images=self.bad_images + self.meter.bad)
        scale = self.precision.loss_scale()
        if scale is not None:
            scalars["loss_scale"] = float(scale)
        if self.device.type == "cuda":
            scalars["gpu_mem_gb"] = torch.cuda.memory_allocated(self.device) / 2**30
        self.logger.scalars("train", scalars, self.global_step)
        bar.set_postfix_str(f"loss {scalars['loss']:.4f} lr {scalars['lr']:.4g} img/s {scalars['img_per_s']:.0f}")


class StepTimer:
    """Times the steps after ``warmup`` (for ``kd bench``), with device syncs only at its ends."""

    def __init__(self, warmup: int, backend):
        self.warmup = warmup
        self.backend = backend
        self.start = None
        self.images = 0
        self.steps = 0

    def _sync(self) -> None:
        if self.backend.device.type == "cuda":
            torch.cuda.synchronize(self.backend.device)

    def step(self, global_step: int, n: int) -> None:
        if not self.warmup or global_step < self.warmup:
            return
        if global_step == self.warmup:
            self._sync()
            self.backend.barrier()
            for dev in self.backend.memory_devices():
                torch.cuda.reset_peak_memory_stats(dev)
            self.start = time.perf_counter()
            return
        self.images += n
        self.steps += 1

    def result(self, backend) -> Dict[str, object]:
        self._sync()
        backend.barrier()
        seconds = time.perf_counter() - self.start
        images = torch.tensor(float(self.images), device=backend.device)
        backend.all_reduce_sum(images)
        mem = [0.0] * backend.world_size
        mine = [torch.cuda.max_memory_allocated(d) / 2**30 for d in backend.memory_devices()]
        slots = torch.zeros(backend.world_size, max(len(mine), 1), device=backend.device)
        if mine:
            slots[backend.rank, :len(mine)] = torch.tensor(mine)
        backend.all_reduce_sum(slots)
        mem = [round(v, 3) for row in slots.tolist() for v in row if v > 0]
        return {"timed_steps": self.steps, "timed_seconds": seconds,
                "timed_img_per_s": images.item() / max(seconds, 1e-9),
                "s_per_20_iters": 20 * seconds / max(self.steps, 1), "peak_mem_gb": mem}


class Interrupted(Exception):
    """A stop asked for by a signal, after the checkpoint of that exact step was written."""

    def __init__(self, signame: str, step: int = 0, out: Optional[Path] = None, message: Optional[str] = None):
        self.signame = signame
        super().__init__(message or f"stopped by {signame} at step {step}; checkpoint written to "
                         f"{out / 'checkpoints' / 'last.pt'}; continue with: kd train --out {out} --resume")


class StopFlag:
    """SIGTERM / SIGINT set a flag; the loop stops at the next step boundary it checks."""

    def __init__(self):
        self.requested = False
        self.signame = ""
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.requested = True
        self.signame = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class Meter:
    """Sums of the loss parts and counters, kept on the device and read only when reduced."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sums: Dict[str, torch.Tensor] = {}
        self.count = torch.zeros((), device=device)  # images
        self.finite = torch.zeros((), device=device)  # images of steps with a finite loss: the means' weight
        self.skipped = torch.zeros((), device=device)
        self.streak = torch.zeros((), device=device)
        self.worst = torch.zeros((), device=device)
        self.sources = torch.zeros((), device=device)  # non-finite flags seen during the current streak
        self.bad = 0
        self.wait = 0.0

    def add(self, parts: Dict[str, torch.Tensor], n: int, skipped: torch.Tensor, bad: int,
            flags: Optional[torch.Tensor] = None) -> None:
        """One step: its loss parts (0-dim), images, skipped flag, unreadable images and non-finite flags."""
        finite = torch.isfinite(parts["loss"].detach())
        for k, v in parts.items():  # the means are over the steps with a finite loss
            self.sums[k] = self.sums.get(k, 0.0) + torch.where(finite, v.detach() * n, 0.0)
        self.count += n
        self.finite += finite * n
        self.skipped += skipped.float()
        self.streak = torch.where(finite, torch.zeros_like(self.streak), self.streak + 1)
        self.worst = torch.maximum(self.worst, self.streak)
        if flags is not None:
            self.sources = torch.where(finite, torch.zeros_like(flags), torch.maximum(self.sources, flags))
        self.bad += bad

    def reduce(self, backend, extra=()) -> Dict[str, float]:
        """Means of the parts over every process, and summed counters (one collective)."""
        keys = sorted(self.sums)
        tail = [self.count, self.finite, self.skipped, torch.tensor(float(self.bad), device=self.device)]
        tail += [torch.as_tensor(x, dtype=torch.float32, device=self.device) for x in extra]
        vec = torch.stack([self.sums[k] for k in keys] + tail)
        backend.all_reduce_sum(vec)
        values = vec.tolist()
        count, finite, skipped, bad = values[len(keys):len(keys) + 4]
        out = {k: values[i] / finite if finite else float("nan") for i, k in enumerate(keys)}
        out.update(images=count, skipped_steps=skipped, bad=bad)
        if extra:
            out["_extra"] = values[len(keys) + 4:]
        return out

    def global_state(self, backend) -> dict:
        """:meth:`state_dict` with the sums and counters added up over every process (a collective)."""
        keys = sorted(self.sums)
        vec = torch.stack([self.sums[k] for k in keys] + [self.count, self.finite, self.skipped,
                                                          torch.tensor(float(self.bad), device=self.device)])
        backend.all_reduce_sum(vec)
        state = self.state_dict()
        state["sums"] = {k: vec[i].cpu() for i, k in enumerate(keys)}
        state["count"], state["finite"], state["skipped"] = (vec[len(keys) + i].cpu() for i in range(3))
        state["bad"] = int(vec[len(keys) + 3].item())
        return state

    def state_dict(self) -> dict:
        return {"sums": {k: v.cpu() for k, v in self.sums.items()}, "count": self.count.cpu(),
                "finite": self.finite.cpu(), "skipped": self.skipped.cpu(), "streak": self.streak.cpu(),
                "worst": self.worst.cpu(), "sources": self.sources.cpu(), "bad": self.bad, "wait": self.wait}

    def load_state_dict(self, state: dict) -> None:
        self.sums = {k: v.to(self.device) for k, v in state["sums"].items()}
        self.count = state["count"].to(self.device)
        self.finite = state.get("finite", state["count"]).to(self.device)
        self.sources = state.get("sources", torch.zeros(())).to(self.device)
        self.skipped = state["skipped"].to(self.device)
        self.streak = state["streak"].to(self.device)
        self.worst = state["worst"].to(self.device)
        self.bad = state["bad"]
        self.wait = state["wait"]


def teacher_preprocessing_note(cfg) -> Optional[str]:
    """Where a kd-trained teacher was validated at other sizes than this run: why its top-1 differs."""
    from kd.evaluate import run_settings  # kd.evaluate imports this module

    trained = run_settings(cfg.teacher_weights).get("config") or {}
    if not trained.get("image_size"):
        return None
    theirs = (trained["image_size"], trained.get("val_resize") or default_val_resize(trained["image_size"]))
    ours = (cfg.image_size, cfg.val_resize or default_val_resize(cfg.image_size))
    if theirs == ours:
        return None
    return (f"teacher {cfg.teacher}: trained and validated at image size {theirs[0]}, val resize {theirs[1]}; this run "
            f"validates at {ours[0]}, {ours[1]}, so its top-1 here differs from its own run's")


def format_record(record: Dict[str, float], epochs: int) -> str:
    parts = [f"epoch {record['epoch']}/{epochs}", f"loss {record.get('train_loss', float('nan')):.4f}"]
    if "val_top1" in record:
        parts.append(f"val top-1 {record['val_top1']:.2f} top-5 {record['val_top5']:.2f}")
    parts.append(f"{record['img_per_s']:.0f} img/s")
    parts.append(f"{record['seconds']:.1f}s")
    return " | ".join(parts)


def run_worker(cfg, out: Path, resume_from: Optional[Path] = None) -> Dict[str, float]:
    """Everything one process does for a run, from backend set-up to teardown."""
    import backends

    backend = backends.get(cfg.backend)(cfg)
    backend.setup()
    trainer = None
    try:
        trainer = Trainer(cfg, backend, out, resume_from)
        return trainer.fit()
    finally:
        if trainer is not None:
            trainer.close()
        backend.teardown()

