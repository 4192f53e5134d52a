"""Building a run: what :class:`kd.run.loop.Trainer` holds before its first step (data, precision,
student side, teacher, optimizer, schedule, counters), in the order that keeps a failed start
from leaving anything behind."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from kd import config as kd_config
from kd import models
from kd.data.loader import val_transform
from kd.errors import KDError
from kd.precision import make_precision
from kd.precision.cpu import slow_precision_warning
from kd.run import checkpoint
from kd.run.log import NullLogger, RunLogger, SetupClock
from kd.run.meter import Meter
from kd.run.optim import build_optimizer, build_scheduler
from kd.run.runtime import resolve as resolve_runtime
from kd.run.sides import StudentSide, build_models
from kd.run.signals import StopFlag, in_setup
from kd.run.step import BufferGuard, StepHook
from kd.runfolder import RunFolder
from kd.teacher.frozen import Teacher


class RunBuilder:
    """The set-up half of :class:`kd.run.lane.Lane` (whose other half runs its steps)."""

    clock: SetupClock

    def _build(self, cfg, backend, out: Path, resume_from: Optional[Path], shared, alone: bool = True) -> None:
        """Set up for ``cfg`` on the set-up ``backend``: one student in ``out``, resumed from
        ``resume_from`` where given; ``shared`` (:class:`kd.run.loop.Shared`) brings the data, the
        teacher's model and the stop flag of the run; ``alone``: the run's only student. A stop
        signal during set-up ends it at the next of a few points, every process alike, with nothing
        written."""
        self.stop = shared.stop
        self.first_step: Optional[Dict[str, float]] = None  # seconds to the first step, once taken
        self.loss_terms: List[str] = []  # the loss parts besides the total, in the order of the non-finite flags
        resumed = checkpoint.load(resume_from) if resume_from is not None else None  # a broken file fails first
        cfg = models.with_data_configs(cfg)  # each model's mean, std and eval transform, saved in config.yaml
        self.cfg = cfg
        self.backend = backend
        self.out = out
        self.resume_from = resume_from
        self.device = backend.device
        self.runtime = resolve_runtime(cfg, self.device)
        self.memory_format = self.runtime.memory_format
        prefix = "" if alone else f"[{self.out.name}] "
        self.logger = RunLogger(self.out, cfg.progress_bar, prefix) if backend.is_main else NullLogger()
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = cfg.cudnn_benchmark

        self.name = self.out.name  # the student's name beside others (kd.run.plan); its run folder's name
        self.rng: Dict[str, Any] = {}  # beside other students: its generators' state between its calls
        self.data = shared.data
        self._build_rest(cfg, backend, resumed, resume_from, shared, alone)

    def _build_rest(self, cfg, backend, resumed, resume_from, shared, alone: bool) -> None:
        dev = self.device
        self.stop_in_setup()
        self.num_classes = num_classes = cfg.num_classes or len(self.data.classes)
        if cfg.num_classes and cfg.data != "synthetic" and cfg.num_classes != len(self.data.classes):
            raise KDError(f"--num-classes {cfg.num_classes} but {cfg.data} has {len(self.data.classes)} class folders")

        # apex.amp holds one model per process: beside other students, apex_ddp's wish for it gives way
        self.precision = make_precision(cfg, dev, prefer_apex=backend.prefers_apex_amp and alone)
        said = [self.precision.describe()]  # logged once set-up has succeeded: a failed start stays one line
        warning = slow_precision_warning(cfg.opt, self.precision.dtype, dev)
        if warning:
            self.logger.info(warning)
        torch.manual_seed(cfg.seed)  # the same initial student on every process, and beside other students
        student, loss, teacher, s_layers, self.t_layers = build_models(cfg, num_classes, shared.teacher_model)
        if teacher is not None:
            shared.teacher_model = teacher  # built after this student, as its own run builds it
        self.needs_teacher = teacher is not None
        self.clock.mark("models")

        # Module.to(device, memory_format=...) is valid at run time; torch's overloads list the two apart
        self.side = StudentSide(student, loss, s_layers).to(dev, memory_format=self.memory_format)  # type: ignore[call-overload]
        self.side = backend.prepare_model(self.side)  # before the optimizer: sync-BN layers, parameter layout
        self.prepared_teacher: Optional[Teacher] = None
        # the loaders normalise for the (first) student; another student renormalises on the device
        self.renorm = models.renormaliser(getattr(self.data.train, "norm", None), cfg.student_data)
        self.notes: List[str] = []  # what kd chose for the user, kept as comments in config.yaml
        self.stop_in_setup()
        optimizer = build_optimizer(cfg, self.side.named_parameters(), fused_ok=self.precision.fused_optimizer_ok)
        self.side, self.optimizer = self.precision.prepare(self.side, optimizer)
        self.model = backend.wrap(self.side)
        torch.manual_seed(cfg.seed + backend.rank)  # each process its own dropout / drop-path masks
        said.append(backend.describe())  # after wrap: what the backend decided there (e.g. torch_ddp's detection)
        forward = backend.wrap_forward(self.side.student)
        renorm = self.renorm
        self.eval_forward = forward if renorm is None else (lambda images: forward(renorm(images)))
        # CUDA-graph modes: each step starts a new graph generation (the last step's outputs are dead)
        self.graph_step = self.runtime.compile and cfg.compile_mode in ("reduce-overhead", "max-autotune")
        if self.runtime.compile:
            said.append(
                f"torch.compile ({cfg.compile_mode}): the first step compiles the student "
                f"{'and the teacher ' if not cfg.no_teacher else ''}(a minute or more), the steps after run faster"
            )
            self.model = torch.compile(self.model, mode=cfg.compile_mode)
        self.params = [p for p in self.side.parameters() if p.requires_grad]
        self.buffers = BufferGuard(self.side)  # put back on a skipped step
        self.scheduler = build_scheduler(cfg, self.optimizer, len(self.data.train))
        self.clock.mark("optimizer")  # with the precision, the backend's wrap and torch.compile's
        self.step_lr = self.optimizer.param_groups[0]["lr"]  # the lr of the last step taken (logged)
        self.epoch_lr: Optional[float] = None  # the lr of this epoch's first step

        self.epoch = 0
        self.batch_in_epoch = 0
        self.global_step = 0
        self.best_top1 = -1.0
        self.bad_files: Set[str] = set()  # the unreadable files met so far, on every process
        self.new_bad_files: Set[str] = set()  # those this process met since the last check
        self.meter = Meter(dev)
        # an epoch trained whose validation a stop cut short: its training totals and seconds
        self.pending_epoch: Optional[Tuple[Dict[str, float], float]] = None
        self.steps_in_epoch = len(self.data.train)
        self.stop_every = min(cfg.log_every, 10)  # steps between stop checks across processes
        self.epoch_ended: Optional[float] = None
        if resumed is not None:
            checkpoint.restore_run(self, resumed)
            self.logger.resume_at(self.epoch)
            self.logger.info(f"resumed from {resume_from} at epoch {self.epoch + 1}")
        self._resumed_step = self.global_step
        for line in said:
            self.logger.info(line)
        self.log_data_configs()  # once set-up has succeeded: a failed start stays one line

    @property
    def position(self) -> Tuple[int, int]:
        """(epoch, batch in epoch) where training goes on: an epoch whose validation is pending counts as ended."""
        if self.pending_epoch is not None:
            return self.epoch + 1, 0
        return self.epoch, self.batch_in_epoch

    def stop_in_setup(self) -> None:
        """Before the first step: a stop asked for during set-up ends the run here, with nothing
        written (a fresh run's folder is removed by :func:`kd.run.launch.train`). A collective: every
        process decides alike."""
        if stop_anywhere(self.stop, self.backend, self.device):
            raise in_setup(self.stop.signame)

    @property
    def teacher(self):
        """The frozen teacher's module (wrapped forward-only), or None."""
        return self.prepared_teacher.module if self.prepared_teacher is not None else None

    def prepare_teacher(
        self, model: torch.nn.Module, layers: List[str], hooks: Sequence[StepHook], backend, notes: List[str]
    ) -> Teacher:
        """``model`` on this run's device and memory format, shown to ``hooks``, then prepared
        (:class:`kd.teacher.frozen.Teacher`: fused, its precision chosen on this run's validation data)
        with feature taps on ``layers``; what kd chose goes to ``notes``."""
        model = model.to(self.device, memory_format=self.memory_format)  # type: ignore[call-overload]  # as the student side above
        for hook in hooks:
            hook.on_teacher(self, model)
        from kd.data.pipeline import build_val

        cfg = self.cfg
        teacher_data = models.DataConfig.from_dict(cfg.teacher_data or {})
        evaluation = (teacher_data.val_resize(cfg.image_size), teacher_data.interpolation)
        val, owns_val = self.data.val, False
        if self.data.val_samples and evaluation != val_transform(cfg):  # its own crops for its own top-1
            own = dataclasses.replace(cfg, val_resize=evaluation[0], val_interpolation=evaluation[1])
            num_replicas, rank = backend.data_shard()
            val = build_val(
                own, self.data.val_samples, num_replicas, rank, backend.local_batch(cfg.batch_size), self.device,
                self.runtime.channels_last,
            )  # fmt: skip
            owns_val = True
            self.logger.info(
                f"teacher {cfg.teacher}: validated on its own crops ({evaluation[1]}, resize {evaluation[0]})"
            )
        renorm = models.renormaliser(getattr(self.data.train, "norm", None), cfg.teacher_data)
        return Teacher(
            model, layers, cfg, backend, self.runtime, self.precision, val, self.logger.info, notes, renorm, owns_val
        )

    def log_data_configs(self) -> None:
        """Each model's normalisation and evaluation transform, and where it came from."""
        cfg = self.cfg
        for role, name, data in (
            ("student", cfg.student, cfg.student_data),
            ("teacher", cfg.teacher, cfg.teacher_data),
        ):
            if data:
                self.logger.info(f"{role} {name}: {models.DataConfig.from_dict(data).describe(cfg.image_size)}")

    def use_teacher(self, teacher: Teacher) -> None:
        """The prepared teacher this student learns from (its own, or one shared with other students)."""
        self.prepared_teacher = teacher
        self.cfg = dataclasses.replace(self.cfg, teacher_precision=teacher.dtype_name)

    def start_folder(self) -> None:
        """Once set-up has succeeded, the main process starts the run folder (a failed start leaves no
        run behind) and writes config.yaml."""
        if self.backend.is_main:
            if self.resume_from is None:
                RunFolder(self.out).start()
            else:
                self.out.mkdir(parents=True, exist_ok=True)
            kd_config.save(self.cfg, RunFolder(self.out).config, notes=self.notes)


def stop_anywhere(stop: StopFlag, backend, device: torch.device) -> bool:
    """Whether a stop signal reached any process (a collective)."""
    flag = torch.tensor(float(stop.requested), device=device)
    backend.all_reduce_sum(flag)
    return flag.item() > 0
