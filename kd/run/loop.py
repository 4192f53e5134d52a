"""The training loop: one input pipeline and one teacher forward per batch, for every student of
the run (its *lanes*, :class:`kd.run.lane.Lane`). A run of one student is the one-lane case; a run
of several (``kd train --kd-loss kd,dkd,dist,lskd``, planned by :mod:`kd.run.plan`) steps each
student on the same batches and teacher outputs, each with its own generators, and a student
whose loss stays non-finite stops alone. ``kd teach``'s run (:class:`Teaching`) is the case with
no lane: the same pipeline and teacher forward, its outputs written to a soft-label store
(:mod:`kd.teacher.store`) that later runs read in the teacher's place."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from kd import config as kd_config
from kd import models
from kd.data.loader import Batch, val_transform
from kd.data.pipeline import build as build_data
from kd.data.pipeline import build_val, choose_loader
from kd.errors import KDError, NonFinite
from kd.precision import make_precision
from kd.run import checkpoint
from kd.run.build import build_lane, seeded
from kd.run.lane import Lane, stop_in_setup
from kd.run.log import SetupClock, command_start
from kd.run.runtime import resolve as resolve_runtime
from kd.run.step import StepHook, StepOutput, check_batch
from kd.run.students import Students, stopped_students, write_students
from kd.runfolder import RunFolder, nearest_folder
from kd.teacher import store as kd_store
from kd.teacher.frozen import Teacher
from kd.teacher.probe import PROBE_BATCHES
from kd.teacher.store import SoftLabels, wanted_manifest
from kd.utils.signals import Interrupted, StopFlag


@dataclass
class Shared:
    """What the students of a run share: the data pipeline, the teacher's model (built by the first
    student that needs it, right after that student, as its own run builds it), the stop flag and
    the set-up's clock."""

    data: Any
    teacher_model: Any
    stop: StopFlag
    clock: SetupClock


@contextlib.contextmanager
def own_generators(lane: Lane):
    """``lane``'s own random generators in place for its calls (its dropout masks, and its checkpoint's
    generator state), as if it trained alone."""
    outer = checkpoint.rng_state()
    checkpoint.set_rng_state(lane.rng)
    try:
        yield
    finally:
        lane.rng = checkpoint.rng_state()
        checkpoint.set_rng_state(outer)


def prepare_teacher(
    lane: Lane, model: torch.nn.Module, layers: List[str], hooks: Sequence[StepHook], backend, notes: List[str]
) -> Teacher:
    """``model`` on this run's device and memory format, shown to ``hooks``, then prepared
    (:class:`kd.teacher.frozen.Teacher`: fused, its precision chosen on this run's validation data)
    with feature taps on ``layers``; what kd chose goes to ``notes``."""
    model = model.to(lane.device, memory_format=lane.memory_format)  # type: ignore[call-overload]  # valid at run time; torch's overloads list the two apart
    with lane.precision.other_model_context():  # (apex O1: its casts off, as for the teacher's forward)
        for hook in hooks:
            hook.on_teacher(lane, model)
    cfg = lane.cfg
    teacher_data = models.DataConfig.from_dict(cfg.teacher_data or {})
    evaluation = (teacher_data.val_resize(cfg.image_size), teacher_data.interpolation)
    val, owns_val = lane.data.val, False
    if lane.data.val_samples and evaluation != val_transform(cfg):  # its own crops for its own top-1
        own = dataclasses.replace(cfg, val_resize=evaluation[0], val_interpolation=evaluation[1])
        num_replicas, rank = backend.data_shard()
        val = build_val(
            own, lane.data.val_samples, num_replicas, rank, backend.local_batch(cfg.batch_size), lane.device,
            lane.runtime.channels_last,
        )  # fmt: skip
        owns_val = True
        lane.logger.info(f"teacher {cfg.teacher}: validated on its own crops ({evaluation[1]}, resize {evaluation[0]})")
    renorm = models.renormaliser(getattr(lane.data.train, "norm", None), cfg.teacher_data)
    return Teacher(
        model, layers, cfg, backend, lane.runtime, lane.precision, val, lane.logger.info, notes, renorm, owns_val
    )


def start_folder(lane: Lane) -> None:
    """Once set-up has succeeded, the main process starts ``lane``'s run folder (a failed start leaves no
    run behind) and writes config.yaml."""
    if lane.backend.is_main:
        if lane.resume_from is None:
            RunFolder(lane.out).start()
        else:
            lane.out.mkdir(parents=True, exist_ok=True)
        kd_config.save(lane.cfg, RunFolder(lane.out).config, notes=lane.notes)


class Trainer:
    """One process's part of a run: its students' lanes, fed by one data pipeline and one teacher
    forward per batch, each with its own step, rules, log and checkpoints."""

    def __init__(
        self,
        students,
        backend,
        resume_from: Optional[Path] = None,
        hooks: Sequence[StepHook] = (),
        validate: bool = True,
        stop: Optional[StopFlag] = None,
    ):
        """``students``: a :class:`Students`, or one student's config. ``resume_from``: the checkpoint
        of one student; for several, any path (each resumes from its own ``last.pt``). ``hooks`` see
        each step (with the step's output where one student trains) and each epoch's record before
        it is logged (``kd bench``'s timer); ``validate=False`` skips the validation passes (timed
        benchmark runs); ``stop`` the process's :class:`kd.run.signals.StopFlag` (its own where
        not given)."""
        clock = SetupClock(command_start(default=time.time()))  # every student's first step counts from here
        clock.mark("launch")  # interpreter, imports, launcher, process group, device
        students = students if isinstance(students, Students) else Students.alone(students)
        cfg = models.with_data_configs(students.cfgs[0])  # the loaders normalise for the first student
        several = len(students.names) > 1
        if several and resolve_runtime(cfg, backend.device).cuda_graphs:
            raise KDError(
                f"compile_mode {cfg.compile_mode} (CUDA graphs) cannot share the teacher's outputs between "
                f"students; use compile_mode default or max-autotune-no-cudagraphs"
            )
        self.students = students
        self.backend = backend
        self.hooks = list(hooks)
        self.validates = validate
        self.global_step = 0
        # students a non-finite loss stopped (in an earlier part of this run too): not resumed
        self.failed: Dict[str, str] = stopped_students(students.out) if resume_from and students.grouped else {}
        if self.failed and all(name in self.failed for name in students.names):
            raise KDError(f"every student of {students.out} stopped on a non-finite loss; nothing to resume")
        resumes = {  # each student's checkpoint: one that cannot be resumed fails before the data is read
            name: (RunFolder(students.folder(name)).last if students.grouped else resume_from) if resume_from else None
            for name in students.names
            if name not in self.failed
        }
        for path in resumes.values():
            if path is not None:
                checkpoint.load(path, mmap=True)
        self.owns_stop = stop is None
        self.stop = stop if stop is not None else StopFlag(backend.placement.launched)
        self.lanes: List[Lane] = []
        self.teacher: Optional[Teacher] = None
        self.soft: Optional[SoftLabels] = None  # a soft-label store in the teacher's place (--soft-labels)
        self.data: Any = None  # the run's data pipeline, once built
        try:
            stop_in_setup(self.stop, self.backend)
            runtime = resolve_runtime(cfg, backend.device)
            num_replicas, rank = backend.data_shard()
            self.data = build_data(
                cfg, num_replicas, rank, backend.local_batch(cfg.batch_size), backend.device, runtime.channels_last
            )
            if cfg.soft_labels:  # checked before any student is built: a store for another run stays one line
                classes = cfg.num_classes or len(self.data.classes)
                wanted = wanted_manifest(cfg, self.data.train_samples, classes)
                self.soft = SoftLabels(Path(cfg.soft_labels), wanted, cfg.epochs, cfg.teacher)
            clock.mark("data")
            shared = Shared(self.data, None, self.stop, clock)
            for name, lane_cfg in zip(students.names, students.cfgs):
                if name in self.failed:
                    continue
                grouped = students.grouped
                lane = build_lane(
                    lane_cfg,
                    backend.fork() if grouped else backend,
                    students.folder(name),
                    resumes[name],
                    shared,
                    validate,
                    not grouped,
                )
                lane.name = name
                if grouped:
                    lane.rng = checkpoint.rng_state()
                self.lanes.append(lane)
            if several and self.lanes[0].precision.one_per_process:
                raise KDError("apex.amp holds one model per process; several students need --amp-impl native")
            self._prepare_teacher(shared)
            positions = {lane.position for lane in self.lanes}
            if len(positions) > 1:
                where = ", ".join(
                    f"{lane.name}: epoch {lane.epoch + 1} step {lane.batch_in_epoch}" for lane in self.lanes
                )
                raise KDError(
                    f"the students' checkpoints are at different places ({where}); resume each alone "
                    f"with kd train --out {students.out}/NAME --resume"
                )
            self.global_step = self.lanes[0].global_step
            for lane in self.lanes[1:]:
                lane.logger.bar_enabled = False  # one progress bar for all
            self.lanes[0].logger.info(self.data.train.describe())  # after set-up: a failed start stays one line
            cache = getattr(self.data.val, "describe_cache", None)
            if cache is not None:
                self.lanes[0].logger.info(f"val: {cache()}")
            stop_in_setup(self.stop, self.backend)  # the last point at which a stop writes nothing
            if backend.is_main and students.grouped:
                write_students(students.out, students.names, self.failed)
            for lane in self.lanes:
                start_folder(lane)
        except BaseException:
            self.close()
            raise
        clock.mark("folder")
        self.active = list(self.lanes)

    @property
    def lane(self) -> Lane:
        """The run's one student (for a run of one; tests and benchmarks reach its parts here)."""
        if len(self.lanes) != 1:
            raise AttributeError(f"a run of {len(self.lanes)} students has no one lane")
        return self.lanes[0]

    def _prepare_teacher(self, shared: Shared) -> None:
        """One teacher for every student that needs one, tapping the layers of them all; or the
        soft-label store that stands in for its forward."""
        taught = [lane for lane in self.lanes if lane.needs_teacher]
        if not taught:
            return
        if self.soft is not None:
            teacher, line = self.soft.manifest["teacher"], self.soft.describe()
            for lane in taught:  # config.yaml names the teacher whose outputs it trained on
                lane.cfg = dataclasses.replace(
                    lane.cfg, teacher=teacher, teacher_weights=self.soft.manifest["teacher_weights"]
                )
                lane.logger.info(line)
                lane.notes.append(line)
            shared.clock.mark("teacher")
            return
        model, shared.teacher_model = shared.teacher_model, None
        layers = list(dict.fromkeys(layer for lane in taught for layer in lane.t_layers))
        notes: List[str] = []
        self.teacher = prepare_teacher(taught[0], model, layers, self.hooks, self.backend, notes)
        for lane in taught:
            lane.use_teacher(self.teacher)
            lane.notes.extend(notes)
        stop_in_setup(self.stop, self.backend)
        shared.clock.mark("teacher")  # on the device, fused, its precision probed

    def close(self) -> None:
        """Every student's logs, the data pipeline's workers and the signal handlers: nothing outlives the run."""
        for lane in self.lanes:
            lane.close()
        if self.teacher is not None:
            self.teacher.close()
        if self.soft is not None:
            self.soft.close()
        if self.owns_stop:
            self.stop.restore()
        if self.data is not None:
            self.data.close()

    def _run(self, lane: Lane, call):
        """``call()`` for ``lane``. Beside other students, with its own generators, and a non-finite
        loss stops that student only (the decision is a collective, so every process stops it at the
        same step); a run of one student stops."""
        if not self.students.grouped:
            return call()
        try:
            with own_generators(lane):
                return call()
        except NonFinite as exc:
            lane.logger.info(f"stopped: {exc}")
            lane.logger.close()
            self.failed[lane.name] = str(exc)
            self.active.remove(lane)
            if self.backend.is_main:  # a resume continues the others
                write_students(self.students.out, self.students.names, self.failed)
            return None

    def fit(self) -> Dict[str, float]:
        """Every student's epochs; the first student's last record, or a KDError naming the students
        stopped by a non-finite loss once the others are done."""
        stop_in_setup(self.stop, self.backend)
        records: Dict[str, Dict[str, float]] = {}
        for lane in list(self.active):  # students whose last validation a stop cut short
            record = self._run(lane, lane.finish_pending_epoch)
            if record is not None:
                records[lane.name] = record
        while self.active and self.active[0].epoch < self.active[0].cfg.epochs:
            start = time.perf_counter()
            totals = self.train_epoch()
            seconds = time.perf_counter() - start
            extra: Dict[str, object] = {}
            for hook in self.hooks:
                hook.on_epoch_end(self, extra)
            stopped = False
            for lane in list(self.active):
                try:
                    record = self._run(
                        lane,
                        lambda lane=lane, totals=totals, start=start, seconds=seconds, extra=extra: lane.end_epoch(
                            totals[lane.name], start, seconds, extra
                        ),
                    )
                except Interrupted:  # its validation was stopped, its epoch saved: the others' next
                    if not self.students.grouped:
                        raise
                    stopped = True
                    continue
                if record is not None:
                    records[lane.name] = record
            if stopped:
                self._raise_interrupted()
        for lane in list(self.active):
            self._run(lane, lane.finish)
        if self.failed:
            done = ", ".join(lane.name for lane in self.active) or "none"
            raise KDError(
                "; ".join(f"student {name} stopped: {why}" for name, why in self.failed.items())
                + f" (completed: {done})"
            )
        return records.get(self.lanes[0].name, {})

    def train_epoch(self) -> Dict[str, Dict[str, float]]:
        """One epoch of shared batches: the teacher's forward once, then each student's step and rules."""
        lead = self.active[0]
        loader = self.data.train
        loader.set_epoch(lead.epoch, lead.batch_in_epoch)
        steps = len(loader) + lead.batch_in_epoch
        for lane in self.active:
            lane.begin_epoch(steps)
        it = iter(loader)
        try:
            first_wait = None
            while self.active:
                t0 = time.perf_counter()
                batch = next(it, None)
                waited = time.perf_counter() - t0
                first_wait = waited if first_wait is None else first_wait
                for lane in self.active:
                    lane.meter.wait += waited
                if batch is None:
                    break
                check_batch(batch, self.active[0].logger.info)
                teacher_out: Optional[Tuple[torch.Tensor, Dict[str, torch.Tensor]]] = None
                if self.soft is not None:  # the stored logits of this epoch's crops
                    teacher_out = (self.soft.logits(lead.epoch, batch.indices, self.backend.device), {})
                elif self.teacher is not None and len(self.active) > 1:  # once for all the students
                    teacher_out = self.teacher.forward(batch.images)  # as probed: not the students' cast
                # (one student runs the teacher in its own step: under CUDA graphs the step's new graph
                # generation must begin before the teacher's forward, or it overwrites its outputs)
                stop = False
                outs: List[StepOutput] = []
                for lane in list(self.active):

                    def one(lane=lane, batch=batch, teacher_out=teacher_out, t0=t0, waited=waited, outs=outs):
                        out = lane.step(batch, teacher_out if lane.needs_teacher else None)
                        outs.append(out)
                        return lane.after_step(out, batch, t0, waited)

                    stop = bool(self._run(lane, one)) or stop
                self.global_step += 1
                self._after_step(batch, outs)
                if stop:
                    self._interrupt()
            return {
                lane.name: self._run(lane, lambda lane=lane: lane.end_train_epoch(first_wait))
                for lane in list(self.active)
            }
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def _after_step(self, batch: Batch, outs: List[StepOutput]) -> None:
        """The hooks: the step's output where one student trains, its size where several do."""
        out = outs[0] if len(self.lanes) == 1 and outs else StepOutput({}, None, None, len(batch))
        for hook in self.hooks:
            hook.on_step(self, out)

    def _interrupt(self) -> None:
        """A stop signal: every student's checkpoint of this step, then Interrupted."""
        if not self.students.grouped:
            raise self.lanes[0].interrupt()
        for lane in self.active:
            with own_generators(lane):
                lane.interrupt()
        self._raise_interrupted()

    def _raise_interrupted(self) -> None:
        out = self.students.out
        raise Interrupted(
            self.stop.signame or "a signal",
            message=f"stopped by {self.stop.signame} at step {self.global_step}; "
            f"every student's checkpoint written below {out}; "
            f"continue with: kd train --out {out} --resume",
        )


class Teaching:
    """Writes ``cfg.out``'s store: ``cfg.epochs`` epochs of the teacher's logits on the run's crops."""

    def __init__(self, cfg, backend, stop: StopFlag, hooks: Sequence[StepHook] = ()):
        """``hooks``: kd bench's step timer (``timing_warmup``), shown the teacher and each batch."""
        self.cfg = cfg
        self.backend = backend
        self.stop = stop
        self.hooks = list(hooks)
        self.global_step = 0  # batches taught by this process in this run (the hooks' step count)
        self.root = Path(cfg.out)
        self.data: Any = None
        self.teacher: Any = None
        self.lane: Optional[Lane] = None

    def run(self) -> Dict[str, Any]:
        cfg, backend = self.cfg, self.backend
        clock = SetupClock(command_start(default=time.time()))
        try:
            stop_in_setup(self.stop, backend)
            num_replicas, rank = backend.data_shard()
            cfg = models.with_data_configs(cfg)
            if cfg.student_data is None:  # no student: the loaders normalise as the teacher wants
                cfg = dataclasses.replace(cfg, student_data=cfg.teacher_data)
            self.cfg = cfg
            self.data = build_data(
                cfg,
                num_replicas,
                rank,
                backend.local_batch(cfg.batch_size),
                backend.device,
                resolve_runtime(cfg, backend.device).channels_last,
            )
            classes = cfg.num_classes or len(self.data.classes)
            if backend.placement.world_size > backend.placement.local_world_size:
                raise KDError(
                    "kd teach writes its store through memory maps, which hosts do not share coherently; "
                    "run it on one host (its processes may use every GPU there)"
                )
            shared = Shared(self.data, None, self.stop, clock)
            # under kd bench's timer (hooks) no validation, as in training: the teacher's top-1 is not timed
            self.lane = lane = Lane(cfg, backend, self.root, None, shared, validate=not self.hooks, alone=True)
            lane.precision = make_precision(cfg, backend.device, prefer_apex=False)
            settings = self._settings(classes)  # a store for another teaching fails before the teacher is built
            with seeded(cfg.seed + 1):  # as kd train builds it: a teacher without weights is the same one
                model = models.freeze(models.build(cfg.teacher, classes, cfg.teacher_weights))
            self.teacher = prepare_teacher(lane, model, [], self.hooks, backend, [])
            self._choose_dtype(settings)  # an explicit float16 that cannot hold the logits fails before any write
            self._check_space(settings)
            stop_in_setup(self.stop, backend)
            manifest = self._write_manifest(settings)
        except BaseException:
            self.close()
            raise
        log = lane.logger.info
        log(self.data.train.describe())
        first = manifest["epochs_done"]
        if first >= cfg.epochs:
            log(f"kd teach: {self.root} already holds {first} epoch(s); nothing to do")
            return {"epochs": float(first)}
        if first:
            log(f"kd teach: {self.root} holds {first} epoch(s); continuing at epoch {first + 1}")
        per_epoch = kd_store.epoch_bytes(manifest["samples"], classes, manifest["k"], manifest["dtype"])
        log(
            f"kd teach: {cfg.epochs - first} epoch(s) of {manifest['samples']:,} samples, "
            f"{kd_store.human(per_epoch)} an epoch ({kd_store.human(per_epoch * (cfg.epochs - first))} in all)"
        )
        start = time.perf_counter()
        images = 0
        for epoch in range(first, cfg.epochs):
            taught, files, largest = self._epoch(epoch, manifest)
            images += taught
            if backend.is_main:  # the epoch's files, their checksums and its check, with the epoch
                manifest["epoch_files"].append(files)
                manifest["epoch_largest_logit"].append(largest)
                manifest["epochs_done"] = epoch + 1
                kd_store.write_manifest(self.root, manifest)
            log(f"kd teach: epoch {epoch + 1}/{cfg.epochs} written")
        seconds = time.perf_counter() - start
        rate = images * backend.world_size / max(seconds, 1e-9)
        record: Dict[str, Any] = {
            "epochs": cfg.epochs,
            "img_per_s": rate,
            "seconds": seconds,
            "batches": self.global_step,
        }
        for hook in self.hooks:  # kd bench's timer ends with the teaching, before the teacher's validation
            hook.on_epoch_end(self, record)
        if self.lane.validates and manifest.get("teacher_val_top1") is None:
            top1 = self.teacher.validate(self.stop)
            if top1 is not None and backend.is_main:
                manifest["teacher_val_top1"] = top1
                kd_store.write_manifest(self.root, manifest)
        if backend.is_main:  # the store keeps what each teaching cost, for its break-even against live runs
            device = backend.device
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            try:
                kd_store.log_teaching(
                    self.root, {"epochs_from": first, **record, "processes": backend.world_size, "device": name}
                )
            except OSError as exc:
                raise kd_store.disk_error(self.root, exc) from None
        log(f"kd teach: done, {self.root}: {cfg.epochs} epoch(s), {rate:,.0f} img/s")
        return record

    def _settings(self, classes: int) -> Dict[str, Any]:
        """The store's manifest for this run; where the store exists, checked against it (a store
        for other crops, another teacher or another k is refused) and continued."""
        cfg = self.cfg
        wanted = kd_store.wanted_manifest(cfg, self.data.train_samples, classes)
        k = classes if cfg.soft_label_k is None or cfg.soft_label_k >= classes else cfg.soft_label_k
        settings = {
            **wanted,
            "format": kd_store.FORMAT,
            "teacher": cfg.teacher,
            "teacher_weights": cfg.teacher_weights,
            "teacher_weights_sha256": kd_store.file_sha256(cfg.teacher_weights),
            "teacher_data": cfg.teacher_data,
            "data": cfg.data if cfg.data == "synthetic" else str(Path(cfg.data).absolute()),
            # its crops agree with the other loader's to rounding
            "loader": "synthetic" if cfg.data == "synthetic" else choose_loader(cfg.loader, self.backend.device)[0],
            "k": k,
            "dtype": cfg.soft_label_dtype,  # auto: chosen once the teacher is built (_choose_dtype)
            "epochs": cfg.epochs,
            "epochs_done": 0,
            "epoch_files": [],  # per complete epoch: its files' sizes and sha256
            "epoch_largest_logit": [],  # per complete epoch: its largest |logit| (every row checked finite)
        }
        if kd_store.is_store(self.root):
            have = kd_store.read_manifest(self.root, "--out")
            why = kd_store.mismatch(have, wanted)
            keys = ["teacher", "teacher_weights_sha256", "k"] + (["dtype"] if cfg.soft_label_dtype != "auto" else [])
            if settings["teacher_weights_sha256"] is None:  # named weights (pretrained, torchvision:...): by name
                keys.append("teacher_weights")
            for key in keys:
                if why is None and have.get(key) != settings[key]:
                    why = f"its {key} is {have.get(key)}, this run's {settings[key]}"
            if why:
                raise KDError(f"--out {self.root} holds a store for another teaching: {why}; give another --out")
            for key in ("dtype", "epochs_done", "epoch_files", "epoch_largest_logit", "teacher_val_top1"):
                settings[key] = have.get(key)
            settings["continued"] = True
        return settings

    def _choose_dtype(self, settings: Dict[str, Any]) -> None:
        """``settings``' dtype from the teacher's largest |logit| on its probe batches (the first
        validation batches of every process, as its precision probe): float16 where auto finds it
        small enough, refused where float16 cannot hold it (:func:`kd.teacher.store.choose_dtype`)."""
        backend, teacher = self.backend, self.teacher
        num_replicas, rank = backend.data_shard()
        largest = torch.zeros(max(num_replicas, 1), device=backend.device)  # a slot per process: a max by a sum
        images = torch.zeros((), device=backend.device)
        with torch.no_grad():
            for index, batch in enumerate(teacher.val):
                if index >= PROBE_BATCHES:
                    break
                if len(batch):
                    logits = teacher.forward(batch.images)[0]
                    largest[rank] = torch.maximum(largest[rank], logits.abs().max().float())
                    images += len(batch)
        backend.all_reduce_sum(largest)
        backend.all_reduce_sum(images)
        top = float(largest.max().item()) if not torch.isnan(largest).any() else math.nan
        asked, how = self.cfg.soft_label_dtype, "as given"
        if settings.pop("continued", False):
            asked, how = settings["dtype"], "the store's"
        settings["dtype"], line = kd_store.choose_dtype(asked, top, int(images.item()), self.cfg.teacher, how)
        self.lane.logger.info(line)  # type: ignore[union-attr]  # built before the teacher

    def _check_space(self, settings: Dict[str, Any]) -> None:
        """The store's epochs still to write fit the disk, or are refused before any is written."""
        folder = nearest_folder(self.root)
        epochs = max(self.cfg.epochs - settings["epochs_done"], 0)
        block = os.statvfs(folder).f_frsize if hasattr(os, "statvfs") else 4096
        needed = kd_store.disk_bytes(
            settings["samples"], settings["classes"], settings["k"], settings["dtype"], epochs, block
        )
        free = shutil.disk_usage(folder).free
        # the main process's measure for every process (each measuring its own could split them at a barrier)
        flag = torch.tensor(float(needed > free) if self.backend.is_main else 0.0, device=self.backend.device)
        self.backend.all_reduce_sum(flag)
        if flag.item() > 0:
            raise KDError(
                f"--out {self.root}: the store needs {kd_store.human(needed)} more and the disk has "
                f"{kd_store.human(free)} free; free space, give fewer --epochs or a smaller --top-k"
            )

    def _write_manifest(self, settings: Dict[str, Any]) -> Dict[str, Any]:
        """The manifest written by the main process, then read by every process."""
        settings["teacher_precision"] = self.teacher.dtype_name
        if self.backend.is_main:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise kd_store.disk_error(self.root, exc) from None
            kd_store.write_manifest(self.root, settings)
        self.backend.barrier()
        return kd_store.read_manifest(self.root, "--out")

    def _epoch(self, epoch: int, manifest: Dict[str, Any]) -> Tuple[int, Dict[str, Any], float]:
        """One epoch's rows of this process: (the images it fed the teacher, the epoch's files with
        their checksums (rank 0's; empty elsewhere), the epoch's largest |logit|). A batch that is
        not finite as stored stops kd teach in every process, the epoch not committed."""
        backend, loader = self.backend, self.data.train
        if backend.is_main:
            writer = kd_store.EpochWriter(self.root, epoch, manifest, create=True, device=backend.device)
        backend.barrier()
        if not backend.is_main:
            writer = kd_store.EpochWriter(self.root, epoch, manifest, create=False, device=backend.device)
        loader.set_epoch(epoch)
        lane = self.lane
        assert lane is not None
        bar = lane.logger.progress(len(loader), f"teach {epoch + 1}/{self.cfg.epochs}")
        images = bad = 0
        with torch.no_grad():
            for i, batch in enumerate(loader):
                stop, bad_anywhere, nonfinite = self._stop_asked(i, bad, writer)
                if nonfinite:
                    bar.close()
                    self._refuse_nonfinite(epoch, writer, manifest["dtype"])
                if bad_anywhere > self.cfg.max_bad_images:  # every process decides alike
                    raise KDError(f"more than --max-bad-images {self.cfg.max_bad_images} unreadable images")
                if stop:
                    writer.flush()
                    bar.close()
                    raise Interrupted(
                        self.stop.signame or "a signal",
                        message=f"stopped by {self.stop.signame} in epoch {epoch + 1}; "
                        f"{self.root} keeps {epoch} complete epoch(s); run the same kd teach again to continue",
                    )
                check_batch(batch, lane.logger.info)  # an unreadable image: named, its row left unwritten
                bad += len(batch.bad)
                logits = self.teacher.forward(batch.images)[0]
                writer.write(batch.indices, logits.float())
                images += len(batch)
                bar.update(1)
                self.global_step += 1
                for hook in self.hooks:
                    hook.on_step(self, StepOutput({}, None, None, len(batch)))
        bar.close()
        unchecked = writer.nonfinite.clone()
        backend.all_reduce_sum(unchecked)  # the batches since the last check, in every process
        if unchecked.item():
            self._refuse_nonfinite(epoch, writer, manifest["dtype"])
        largest = self._largest(writer)
        writer.flush()
        backend.barrier()
        return images, writer.commit() if backend.is_main else {}, largest

    def _largest(self, writer: kd_store.EpochWriter) -> float:
        """The epoch's largest |logit| so far over every process (a collective: all call it alike)."""
        num_replicas, rank = self.backend.data_shard()
        slots = torch.zeros(max(num_replicas, 1), device=self.backend.device)
        slots[rank] = writer.largest
        self.backend.all_reduce_sum(slots)
        return math.nan if torch.isnan(slots).any() else float(slots.max().item())

    def _refuse_nonfinite(self, epoch: int, writer: kd_store.EpochWriter, dtype: str) -> None:
        """Every process: the epoch's partial files removed (rank 0), one line saying why."""
        largest = self._largest(writer)
        if self.backend.is_main:
            writer.discard()
        keeps = f"the epoch is not written and {self.root} keeps its {epoch} complete epoch(s)"
        if dtype == "float16" and math.isfinite(largest):
            raise KDError(
                f"kd teach: epoch {epoch + 1}: the teacher's logits pass float16's range (its largest |logit| "
                f"{largest:.4g}, float16's largest {kd_store.FLOAT16_MAX:.0f}); {keeps}; teach again into a new "
                f"--out with --logits-dtype float32"
            )
        raise KDError(
            f"kd teach: epoch {epoch + 1}: the teacher gave non-finite logits (its largest |logit| {largest:.4g}); "
            f"{keeps}; check --teacher-weights, or give --teacher-precision float32"
        )

    def _stop_asked(self, i: int, bad: int, writer: kd_store.EpochWriter) -> Tuple[bool, float, bool]:
        """(a stop signal in any process, the unreadable images of every process so far, a row not
        finite as stored in any process): every batch alone (the rows' copy to the store has
        synchronised already); every tenth batch as a collective with several processes (each has
        the same number of batches, so all ask at the same ones and decide alike)."""
        if self.backend.world_size == 1:
            return self.stop.requested, float(bad), bool(writer.nonfinite.item())
        if i % 10:
            return False, 0.0, False
        flags = torch.tensor([float(self.stop.requested), float(bad)], device=self.backend.device)
        flags = torch.cat([flags, writer.nonfinite.float().reshape(1)])
        self.backend.all_reduce_sum(flags)
        return bool(flags[0].item() > 0), float(flags[1].item()), bool(flags[2].item() > 0)

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()
        if self.teacher is not None:
            self.teacher.close()
        if self.data is not None:
            self.data.close()
