"""The training loop: one input pipeline and one teacher source per batch, for every student of
the run (its *lanes*, :class:`kd.run.lane.Lane`). A run is :class:`kd.run.students.Students`, one
or several: each student steps on the same batches and the same teacher targets, each with its own
generators, and a student whose loss stays non-finite stops alone. The targets come from a
:class:`kd.teacher.source.TeacherSource` (the live frozen teacher, or a soft-label store), asked
once per batch; the loop never knows which."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

import torch

from kd import config as kd_config
from kd.data.loader import Batch, val_transform
from kd.data.model_data import with_data_configs
from kd.data.pipeline import build as build_data
from kd.errors import KDError, NonFinite, writing
from kd.losses import LOSSES
from kd.run import checkpoint, provenance
from kd.run.build import build_lane
from kd.run.lane import Lane, stop_in_setup
from kd.run.log import SetupClock, command_start, open_part
from kd.run.mixup import build as build_mixer
from kd.run.runtime import resolve as resolve_runtime
from kd.run.step import StepHook, StepOutput, check_batch, stand_in
from kd.runfolder import RunFolder
from kd.teacher.frozen import Teacher, build_teacher
from kd.teacher.store import SoftLabels, wanted_manifest
from kd.utils import weight_files
from kd.utils.signals import Interrupted, StopFlag

if TYPE_CHECKING:  # the run's description, built by the command
    from kd.run.students import Students
    from kd.teacher.source import Targets, TeacherSource


@dataclass
class Shared:
    """What the students of a run share: the data pipeline, the teacher's model (built by the first
    student that needs it, right after that student, as its own run builds it), the stop flag and
    the set-up's clock; then the teacher source the run builds after its students (it taps the
    layers of them all), as the students that learn from it see it."""

    data: Any
    teacher_model: Any
    stop: StopFlag
    clock: SetupClock
    #: the live frozen teacher, once built (None for a store, or where no student learns from one)
    teacher: Optional[Teacher] = None
    #: what the teacher source fixes in the config of a student that learns from it: the teacher's
    #: precision as probed, or a store's teacher and weights
    taught: Dict[str, Any] = field(default_factory=dict)
    #: what kd chose for the teacher source (lines of those students' config.yaml)
    notes: List[str] = field(default_factory=list)


def check_classes(students: Students, resumed: Dict[str, Any], classes: Sequence[str]) -> None:
    """The data's class names must be those each kd checkpoint the run reads was trained on: a
    resumed student's, a kd-trained teacher's, and a student's starting weights of as many classes."""
    first = students.first
    if first.data == "synthetic":  # made-up images: no class names to hold
        return
    for name, cfg in students.training():  # a resumed student's first: the run the user asked to continue
        if name in resumed:
            path, state = resumed[name]
            weight_files.check_classes(state.get("classes"), classes, path, cfg.data)
    if not first.no_teacher and first.teacher_weights:
        weight_files.check_classes(
            weight_files.run_classes(first.teacher_weights), classes, first.teacher_weights, first.data
        )
    for _, cfg in students.training():
        kept = weight_files.run_classes(cfg.student_weights)
        if kept and len(kept) == len(classes):  # other classes in number: a new head, built as asked
            weight_files.check_classes(kept, classes, cfg.student_weights, cfg.data)


def check_evaluation(students: Students) -> None:
    """One val loader crops for every student, at the first one's resize and interpolation (its data config
    or --val-resize and val_interpolation): a KDError where another student's own would differ, since its
    log and top-1 would name crops it was not validated on."""
    training = list(students.training())
    if len(training) < 2:  # one student: its own crops
        return
    crops = [(name, val_transform(with_data_configs(cfg))) for name, cfg in training]
    if len({crop for _, crop in crops}) > 1:
        theirs = "; ".join(f"{name}: resize {size}, {mode}" for name, (size, mode) in crops)
        raise KDError(
            f"the students of one run are validated on one set of crops, and theirs differ: {theirs}; give "
            "--val-resize and --set val_interpolation=... to validate them alike, or train them in separate runs"
        )


def start_folder(lane: Lane, resumed: bool) -> None:
    """Once set-up has succeeded, the main process starts ``lane``'s run folder (a failed start leaves no
    run behind; a resumed one is kept) and writes config.yaml and provenance.json."""
    if lane.backend.is_main:
        with writing(None, "run again" + (" with --resume" if resumed else "")):
            if not resumed:
                RunFolder(lane.out).start()
            else:
                lane.out.mkdir(parents=True, exist_ok=True)
            kd_config.save(lane.saved_config, RunFolder(lane.out).config, notes=lane.notes)
            provenance.write(lane.out, lane.saved_config, lane.backend, resumed)
        open_part(lane.out, lane.clock.started)


class Trainer:
    """One process's part of a run: its students' lanes, fed by one data pipeline and one teacher
    source per batch, each with its own step, rules, log and checkpoints."""

    def __init__(
        self,
        students: Students,
        backend,
        hooks: Sequence[StepHook] = (),
        validate: bool = True,
        stop: Optional[StopFlag] = None,
    ):
        """``students``: the run (each continuing from the checkpoint it names). ``hooks`` see each
        step (with the first student's step output) and each epoch's record before it is logged
        (``kd bench``'s timer); ``validate=False`` skips the validation passes (timed benchmark
        runs); ``stop`` the process's :class:`kd.utils.signals.StopFlag` (its own where not given)."""
        clock = SetupClock(command_start(default=time.time()))  # every student's first step counts from here
        clock.mark("launch")  # interpreter, imports, launcher, process group, device
        cfg = with_data_configs(students.first)  # the loaders normalise for the first student
        check_evaluation(students)  # and validate at its crops
        runtime = resolve_runtime(cfg, backend.device)
        alone = len(students.names) == 1
        self.students = students
        self.backend = backend
        self.hooks = list(hooks)
        self.validates = validate
        self.global_step = 0
        self.graph_steps = runtime.cuda_graphs  # each step starts a new CUDA graph generation
        # students a non-finite loss stopped (in an earlier part of this run too): not resumed
        self.failed: Dict[str, str] = dict(students.stopped)
        # each checkpoint read once, before the data: one that cannot be resumed fails first
        resumed = {}
        for name, _ in students.training():
            path = students.checkpoint(name)
            if path is not None:
                resumed[name] = (path, checkpoint.load(path))
        self.owns_stop = stop is None
        self.stop = stop if stop is not None else StopFlag(backend.placement.launched)
        self.lanes: List[Lane] = []
        self.source: Optional[TeacherSource] = None  # the teacher's outputs: live, or a soft-label store
        self.data: Any = None  # the run's data pipeline, once built
        self.mixer = None  # --mixup, --cutmix: each batch mixed before the teacher sees it
        try:
            stop_in_setup(self.stop, self.backend)
            num_replicas, rank = backend.data_shard()
            views = max(LOSSES.card(c.kd_loss).views for _, c in students.training())  # 2: a strong view too
            self.data = build_data(
                cfg, num_replicas, rank, backend.local_batch(cfg.batch_size), backend.device, runtime.channels_last,
                views=views,
            )  # fmt: skip
            check_classes(students, resumed, self.data.classes)
            self.mixer = build_mixer(cfg, cfg.num_classes or len(self.data.classes), rank)
            if cfg.soft_labels:  # checked before any student is built: a store for another run stays one line
                classes = cfg.num_classes or len(self.data.classes)
                wanted = wanted_manifest(cfg, self.data.train_samples, classes)
                self.source = SoftLabels(Path(cfg.soft_labels), wanted, cfg.epochs, cfg.teacher, backend.device)
            clock.mark("data")
            shared = Shared(self.data, None, self.stop, clock)
            for name, lane_cfg in students.training():
                lane = build_lane(
                    name, lane_cfg, backend.fork(), students.folder(name), resumed.get(name), shared, validate, alone,
                    first=not self.lanes,
                )  # fmt: skip
                self.lanes.append(lane)
            checkpoint.forget()  # each restored: their memory maps go
            if not alone:
                self._refuse_several(cfg)
            self._teacher_source(shared)
            positions = {lane.state.position for lane in self.lanes}
            if len(positions) > 1:
                where = ", ".join(
                    f"{lane.name}: epoch {lane.state.epoch + 1} step {lane.state.batch_in_epoch}" for lane in self.lanes
                )
                raise KDError(
                    f"the students' checkpoints are at different places ({where}); resume each alone "
                    f"with kd train --out {students.out}/NAME --resume"
                )
            self.global_step = self.lanes[0].state.global_step
            self.lanes[0].logger.info(self.data.train.describe())  # after set-up: a failed start stays one line
            cache = getattr(self.data.val, "describe_cache", None)
            if cache is not None:
                self.lanes[0].logger.info(f"val: {cache()}")
            stop_in_setup(self.stop, self.backend)  # the last point at which a stop writes nothing
            if backend.is_main:
                students.record(self.failed)
            for lane in self.lanes:
                start_folder(lane, lane.name in resumed)
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

    @property
    def teacher(self) -> Optional[Teacher]:
        """The live frozen teacher, where the run has one (not a store)."""
        return self.source if isinstance(self.source, Teacher) else None

    def _teacher_source(self, shared: Shared) -> None:
        """One teacher for every student that needs one, tapping the layers of them all; or the
        soft-label store that stands in for its forward."""
        taught = [lane for lane in self.lanes if lane.needs_teacher]
        if not taught:
            return
        if isinstance(self.source, SoftLabels):
            manifest, line = self.source.manifest, self.source.describe()
            # config.yaml names the teacher whose outputs it trained on
            shared.taught.update(teacher=manifest["teacher"], teacher_weights=manifest["teacher_weights"])
            shared.notes.append(line)
            for lane in taught:
                lane.logger.info(line)
            shared.clock.mark("teacher")
            return
        model, shared.teacher_model = shared.teacher_model, None
        layers = list(dict.fromkeys(layer for lane in taught for layer in lane.t_layers))
        first = taught[0]
        runtime = resolve_runtime(first.cfg, self.backend.device)
        teacher = build_teacher(
            model, layers, first.cfg, self.backend, self.data, first.precision, first.logger.info, runtime, self.hooks,
            shared.notes,
        )  # fmt: skip
        self.source = shared.teacher = teacher
        shared.taught["teacher_precision"] = teacher.dtype_name
        stop_in_setup(self.stop, self.backend)
        shared.clock.mark("teacher")  # on the device, fused, its precision probed

    def close(self) -> None:
        """Every student's logs, the data pipeline's workers and the signal handlers: nothing outlives the run."""
        checkpoint.forget()
        for lane in self.lanes:
            lane.close()
        if self.source is not None:
            self.source.close()
        if self.owns_stop:
            self.stop.restore()
        if self.data is not None:
            self.data.close()

    def _refuse_several(self, cfg) -> None:
        """What cannot serve several students of one process: CUDA graphs (each call overwrites the
        teacher's outputs the others read) and apex.amp (one model per process)."""
        if resolve_runtime(cfg, self.backend.device).cuda_graphs:
            raise KDError(
                f"compile_mode {cfg.compile_mode} (CUDA graphs) cannot share the teacher's outputs between "
                f"students; use compile_mode default or max-autotune-no-cudagraphs"
            )
        if self.lanes[0].precision.one_per_process:
            raise KDError("apex.amp holds one model per process; several students need --amp-impl native")

    def _run(self, lane: Lane, call):
        """``call()`` for ``lane``. Beside other students, with its own generators, and a non-finite
        loss stops that student only (the decision is a collective, so every process stops it at the
        same step); a run of one student stops."""
        if not self.students.grouped:
            return call()
        try:
            with lane.generators.own():
                return call()
        except NonFinite as exc:
            lane.logger.info(f"stopped: {exc}")
            lane.logger.close()
            self.failed[lane.name] = str(exc)
            self.active.remove(lane)
            if self.backend.is_main:  # a resume continues the others
                self.students.record(self.failed)
            return None

    def fit(self) -> Dict[str, float]:
        """Every student's epochs; the first student's last record, or a KDError naming the students
        stopped by a non-finite loss once the others are done."""
        stop_in_setup(self.stop, self.backend)
        records: Dict[str, Dict[str, float]] = {}
        for lane in list(self.active):  # an epoch whose validation a stop cut short
            record = self._run(lane, lane.finish_pending_epoch)
            if record is not None:
                records[lane.name] = record
        while self.active and self.active[0].state.epoch < self.active[0].cfg.epochs:
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
                    stopped = True
                    continue
                if record is not None:
                    records[lane.name] = record
            if stopped:
                raise self._interrupted()
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
        """One epoch of shared batches: the teacher's targets once, then each student's step and rules."""
        lead = self.active[0]
        loader = self.data.train
        loader.set_epoch(lead.state.epoch, lead.state.batch_in_epoch)
        if self.source is not None:
            self.source.set_epoch(lead.state.epoch)
        steps = len(loader) + lead.state.batch_in_epoch
        for lane in self.active:
            lane.begin_epoch(steps)
        it = iter(loader)
        last: Optional[Batch] = None  # the last batch with a readable image
        ahead: List[Batch] = []  # a batch drawn early to stand in for an unreadable one, trained on at its own step
        try:
            first_wait = None
            while self.active:
                t0 = time.perf_counter()
                batch = ahead.pop() if ahead else next(it, None)
                waited = time.perf_counter() - t0
                first_wait = waited if first_wait is None else first_wait
                for lane in self.active:
                    lane.meter.wait += waited
                if batch is None:
                    break
                check_batch(batch, self.active[0].logger.info, empty_ok=True)
                if len(batch) == 0:  # every process steps alike: a readable batch stands in
                    batch = stand_in(batch, last, it, ahead, self.active[0].logger.info)
                last = batch
                batch = self.mixed(batch)
                targets = self.targets(batch)
                stop = False
                outs: List[StepOutput] = []
                for lane in list(self.active):

                    def one(lane=lane, batch=batch, targets=targets, t0=t0, waited=waited, outs=outs):
                        out = lane.step(batch, targets if lane.needs_teacher else None)
                        outs.append(out)
                        return lane.after_step(out, batch, t0, waited)

                    stop = bool(self._run(lane, one)) or stop
                self.global_step += 1
                for hook in self.hooks:
                    hook.on_step(self, outs[0] if outs else StepOutput({}, None, None, len(batch)))
                if stop:
                    for lane in self.active:  # every student's checkpoint of this step
                        self._run(lane, lane.interrupt)
                    raise self._interrupted()
            return {
                lane.name: self._run(lane, lambda lane=lane: lane.end_train_epoch(first_wait))
                for lane in list(self.active)
            }
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def mixed(self, batch: Batch) -> Batch:
        """``batch`` as the teacher and every student see it: mixed where --mixup or --cutmix is on,
        by a draw of this step's (epoch, step in epoch), whatever ran before in this process."""
        if self.mixer is None:
            return batch
        state = self.active[0].state
        return self.mixer(batch, state.epoch, state.batch_in_epoch)

    def targets(self, batch) -> Optional[Targets]:
        """The teacher's targets for ``batch``, once for every student (None where no student learns
        from a teacher). Under CUDA graphs a new graph generation begins first, so that the
        teacher's outputs live through the students' steps."""
        if self.graph_steps:
            torch.compiler.cudagraph_mark_step_begin()
        return self.source.targets(batch) if self.source is not None else None

    def step(self, batch) -> List[StepOutput]:
        """The public step: the teacher's targets for ``batch``, then one training step of each
        student (:meth:`kd.run.lane.Lane.step`), without the loop's rules, logging or checkpoints;
        their outputs, in the students' order."""
        batch = self.mixed(batch)
        targets = self.targets(batch)
        return [
            self._run(lane, lambda lane=lane: lane.step(batch, targets if lane.needs_teacher else None))
            for lane in self.active
        ]

    def _interrupted(self) -> Interrupted:
        """A stop signal's end of the run, its checkpoints written: where it stopped and how to go on."""
        signame, out = self.stop.signame or "a signal", self.students.out
        return Interrupted(
            signame,
            message=f"stopped by {signame} at step {self.global_step}; {self.students.written()}; "
            f"continue with: kd train --out {out} --resume",
        )
