"""The training loop of several students in one run (:mod:`kd.run.plan` plans them): one input
pipeline and one teacher forward per batch, each student a :class:`kd.run.loop.Trainer` of its own.
Apart from :mod:`kd.run.plan` so that :mod:`kd.run.launch`, which runs it, imports nothing that imports it back."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from kd import data as kd_data
from kd import models
from kd.errors import KDError, NonFinite
from kd.run import checkpoint
from kd.run.build import stop_anywhere
from kd.run.log import SetupClock, command_start
from kd.run.loop import Trainer
from kd.run.runtime import resolve as resolve_runtime
from kd.run.signals import Interrupted, StopFlag, in_setup
from kd.run.step import StepHook, StepOutput, check_batch
from kd.runfolder import RunFolder
from kd.teacher.frozen import Teacher

STUDENTS_FILE = "students.yaml"


@dataclass(frozen=True)
class Students:
    """The students of one run: their names (folders below ``out``) and their resolved configs."""

    out: Path
    names: Tuple[str, ...]
    cfgs: Tuple[Any, ...]


@dataclass
class Shared:
    """What the students of a run share: the data pipeline, the teacher's model (built by the first
    student that needs it, right after that student, as its own run builds it) and the stop flag."""

    data: Any
    teacher_model: Any
    stop: StopFlag


def is_students_folder(out: Path) -> bool:
    return (Path(out) / STUDENTS_FILE).is_file()


def stopped_students(out: Path) -> Dict[str, str]:
    """The students of the run in ``out`` that a non-finite loss stopped: name -> why."""
    path = Path(out) / STUDENTS_FILE
    if not path.is_file():
        return {}
    return dict((yaml.safe_load(path.read_text()) or {}).get("stopped") or {})


def write_students(out: Path, names: Sequence[str], stopped: Dict[str, str]) -> None:
    """``out``/students.yaml: the students, and those stopped (a resume continues the others)."""
    out.mkdir(parents=True, exist_ok=True)
    content = {"students": list(names), **({"stopped": dict(stopped)} if stopped else {})}
    tmp = out / f".{STUDENTS_FILE}.tmp"
    tmp.write_text(yaml.safe_dump(content))
    tmp.replace(out / STUDENTS_FILE)


@contextlib.contextmanager
def own_generators(lane: Trainer):
    """``lane``'s own random generators in place for its calls (its dropout masks, and its checkpoint's
    generator state), as if it trained alone."""
    outer = checkpoint.rng_state()
    checkpoint.set_rng_state(lane.rng)
    try:
        yield
    finally:
        lane.rng = checkpoint.rng_state()
        checkpoint.set_rng_state(outer)


class MultiTrainer:
    """One process's part of a run of several students (:class:`Students`): one data pipeline, one
    teacher forward per batch, each student's step, rules, log and checkpoints as its own run's."""

    def __init__(
        self,
        students: Students,
        backend,
        resume: bool = False,
        hooks: Sequence[StepHook] = (),
        validate: bool = True,
        stop: Optional[StopFlag] = None,
    ):
        """``resume``: every student continues from its own ``last.pt``; ``hooks`` see each shared step
        (with this object as trainer) and each epoch's shared record (``kd bench``'s timer); ``stop``
        the process's :class:`kd.run.signals.StopFlag` (one of its own where not given)."""
        clock = SetupClock(command_start(default=time.time()))  # every student's first step counts from here
        clock.mark("launch")
        cfg = models.with_data_configs(students.cfgs[0])  # the loaders normalise for the first student
        if resolve_runtime(cfg, backend.device).compile and cfg.compile_mode in ("reduce-overhead", "max-autotune"):
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
        self.failed: Dict[str, str] = stopped_students(students.out) if resume else {}
        if self.failed and all(name in self.failed for name in students.names):
            raise KDError(f"every student of {students.out} stopped on a non-finite loss; nothing to resume")
        runtime = resolve_runtime(cfg, backend.device)
        self.owns_stop = stop is None
        self.stop = stop if stop is not None else StopFlag(backend.placement.launched)
        num_replicas, rank = backend.data_shard()
        self.data = kd_data.build(
            cfg, num_replicas, rank, backend.local_batch(cfg.batch_size), backend.device, runtime.channels_last
        )
        clock.mark("data")
        shared = Shared(self.data, None, self.stop)
        self.lanes: List[Trainer] = []
        self.teacher: Optional[Teacher] = None
        try:
            for name, lane_cfg in zip(students.names, students.cfgs):
                if name in self.failed:
                    continue
                out = students.out / name
                lane = Trainer(
                    lane_cfg,
                    backend.fork(),
                    out,
                    RunFolder(out).last if resume else None,
                    validate=validate,
                    shared=shared,
                )
                lane.name, lane.rng = name, checkpoint.rng_state()
                self.lanes.append(lane)
            if len(self.lanes) > 1 and self.lanes[0].precision.one_per_process:
                raise KDError("apex.amp holds one model per process; several students need --amp-impl native")
            clock.mark("students")
            self._prepare_teacher(shared)
            clock.mark("teacher")
            positions = {lane.position for lane in self.lanes}
            if len(positions) > 1:
                where = ", ".join(
                    f"{lane.name}: epoch {lane.epoch + 1} step {lane.batch_in_epoch}" for lane in self.lanes
                )
                raise KDError(
                    f"the students' checkpoints are at different places ({where}); resume each alone "
                    f"with kd train --out {students.out}/NAME --resume"
                )
        except BaseException:
            self.close()
            raise
        self.global_step = self.lanes[0].global_step
        for lane in self.lanes[1:]:
            lane.logger.bar_enabled = False  # one progress bar for all
        self.lanes[0].logger.info(self.data.train.describe())
        cache = getattr(self.data.val, "describe_cache", None)
        if cache is not None:
            self.lanes[0].logger.info(f"val: {cache()}")
        if stop_anywhere(self.stop, backend, backend.device):  # a stop during set-up writes nothing
            self.close()
            raise in_setup(self.stop.signame)
        if backend.is_main:
            write_students(students.out, students.names, self.failed)
        for lane in self.lanes:
            lane.start_folder()
            lane.clock = clock
        clock.mark("folder")
        self.active = list(self.lanes)

    def _prepare_teacher(self, shared: Shared) -> None:
        """One teacher for every student that needs one, tapping the layers of them all."""
        taught = [lane for lane in self.lanes if lane.needs_teacher]
        if not taught:
            return
        model, shared.teacher_model = shared.teacher_model, None
        layers = list(dict.fromkeys(layer for lane in taught for layer in lane.t_layers))
        notes: List[str] = []
        self.teacher = taught[0].prepare_teacher(model, layers, self.hooks, self.backend, notes)
        for lane in taught:
            lane.use_teacher(self.teacher)
            lane.notes.extend(notes)

    def close(self) -> None:
        """Every student's logs, the data pipeline's workers and the signal handlers: nothing outlives the run."""
        for lane in self.lanes:
            lane.close()
        if self.teacher is not None:
            self.teacher.close()
        if self.owns_stop:
            self.stop.restore()
        self.data.close()

    def _run(self, lane: Trainer, call):
        """``call()`` with ``lane``'s generators; a non-finite loss stops that student only (the decision
        is a collective, so every process stops it at the same step)."""
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
        lead = self.lanes[0]
        lead.stop_in_setup()
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
                teacher_out = None
                if self.teacher is not None:
                    teacher_out = self.teacher.forward(batch.images)  # as probed: not the students' cast
                stop = False
                for lane in list(self.active):

                    def one(lane=lane, batch=batch, teacher_out=teacher_out, t0=t0, waited=waited):
                        out = lane.step(batch, teacher_out if lane.needs_teacher else None)
                        return lane.after_step(out, batch, t0, waited)

                    stop = bool(self._run(lane, one)) or stop
                self.global_step += 1
                for hook in self.hooks:
                    hook.on_step(self, StepOutput({}, None, None, len(batch)))
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

    def _interrupt(self) -> None:
        """A stop signal: every student's checkpoint of this step, then Interrupted."""
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
