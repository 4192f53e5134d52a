"""What each process of a launch runs, as the command chose it: students trained together
(:class:`TrainJob`, ``kd train``) or a teacher's outputs written to a soft-label store
(:class:`TeachJob`, ``kd teach``); ``kd bench`` times either (``timed_after``). The launcher
(:mod:`kd.run.launch`) starts the processes and hands each the job; it never asks which it is.

A job is plain data (it travels to spawned processes by pickle); what it runs is imported when it runs.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

from kd.errors import KDError
from kd.run.students import STUDENTS_FILE, Students, is_students_folder
from kd.runfolder import RunFolder, why_unwritable
from kd.utils import model_names
from kd.utils.placement import why_no_cuda


def preflight(cfg, student: bool = True) -> None:
    """The checks of names that need torch and the model libraries (torch's version, the models,
    the KD method, a soft-label store), before any process, model or loader is made; the paths
    that need none come first (:func:`check_inputs`)."""
    import torch

    from kd import models
    from kd.losses import LOSSES
    from kd.version import torch_too_old

    reason = torch_too_old(torch.__version__)
    if reason:
        raise KDError(reason)
    if student:
        from kd.run.optim import check_optimizer

        models.check_name(cfg.student)
        LOSSES.get("ce" if cfg.no_teacher else cfg.kd_loss)
        check_optimizer(cfg)
        if cfg.drop_path is not None:
            models.check_drop_path(cfg.student, cfg.drop_path)
    if not cfg.no_teacher and not cfg.soft_labels:
        models.check_name(cfg.teacher)
    if cfg.soft_labels:
        from kd.teacher.store import read_manifest

        read_manifest(Path(cfg.soft_labels))  # a missing or unreadable store fails before any work


def _roles(cfg, student: bool) -> List[str]:
    """The models a run builds: its student (where ``student``), and its teacher unless it has none."""
    return (["student"] if student else []) + ([] if cfg.no_teacher or cfg.soft_labels else ["teacher"])


def check_before_torch(cfg, student: bool = True) -> None:
    """What :func:`preflight` checks, where it can be answered without torch: the model names
    against the libraries' lists kept from an earlier command (:mod:`kd.utils.model_names`), weights
    files that do not exist, and CUDA asked for where this machine can have none."""
    for role in _roles(cfg, student):
        model_names.check_early(getattr(cfg, role))
        weights = getattr(cfg, f"{role}_weights")
        if model_names.from_file(weights) and not Path(weights).is_file():
            raise KDError(
                f"--{role}-weights: weights file {weights} does not exist (expected pretrained, none or a file path)"
            )
    wants_cuda = cfg.device == "cuda" or (cfg.device == "auto" and cfg.gpus)
    why = why_no_cuda() if wants_cuda else None
    if why:
        asked = f"--gpus {','.join(map(str, cfg.gpus))}" if cfg.gpus else "--device cuda"
        raise KDError(f"{asked} asks for a CUDA GPU, but none can be usable here ({why}); use --device cpu")


def say_tagged_weights(cfgs: Sequence[Any], student: bool = True) -> None:
    """One warning line for each tagged timm name (``timm:NAME.TAG``) whose weights a file gives:
    the file's weights are loaded into the model the tag configures, as timm does."""
    lines = []
    for cfg in cfgs:
        for role in _roles(cfg, student):
            name, weights = getattr(cfg, role), getattr(cfg, f"{role}_weights")
            if model_names.file_for_tag(name, weights):
                tag = model_names.timm_parts(name)[1]
                lines.append(
                    f"kd: warning: --{role} {name} names timm's {tag} weights, but --{role}-weights {weights} "
                    f"are loaded into it (the tag chooses only its configuration and data config)"
                )
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) != "0":
        return  # said by the first process of a multi-process start only
    for line in dict.fromkeys(lines):
        print(line, file=sys.stderr, flush=True)


def check_inputs(cfg) -> None:
    """The checks that need no torch, made before it is imported: the data folder's layout."""
    from kd.data.layout import check_data

    check_data(cfg.data)


def check_out(out: Path, resuming: bool, overwrite: bool) -> None:
    """``--out`` checked before any work, writing nothing. A folder that holds a run is refused
    unless the run resumes or ``--overwrite`` is given, so nothing already written is lost by
    mistake. The folder is made (and an overwritten run removed) only once the run has set up
    without error (:meth:`kd.runfolder.RunFolder.start`), so a failed start leaves the disk as it was."""
    if resuming:
        return
    if out.exists() and not out.is_dir():
        raise KDError(f"--out {out} exists and is not a folder")
    held = RunFolder(out).held()
    if held and not overwrite:
        raise KDError(
            f"--out {out} already holds a run ({', '.join(held)}); "
            f"continue it with --resume or replace it with --overwrite"
        )
    why = why_unwritable(out)
    if why:
        raise KDError(f"--out {out} cannot be written: {why}")


@dataclass(frozen=True)
class TrainJob:
    """``kd train``: ``students`` trained together, each continuing from its checkpoint where it
    names one; ``timed_after`` > 0 (``kd bench``): the steps after that many are timed, and
    nothing is validated."""

    students: Students
    timed_after: int = 0

    @property
    def cfg(self):
        """The config the launch reads (backend, devices, processes): the first student's, which all share."""
        return self.students.first

    @property
    def out(self) -> Path:
        return self.students.out

    def folders(self) -> List[Path]:
        """The folders the run writes (one writer each: :mod:`kd.runlock`)."""
        return self.students.folders()

    def unstarted(self) -> List[Path]:
        """The folders a stop before the first checkpoint leaves as they were (a fresh run's)."""
        return [] if self.students.resuming else self.folders()

    def check_early(self, overwrite: bool) -> None:
        """Before torch is imported: a fresh run's names, devices, data folders and the folders it
        writes (a resumed run's, once its checkpoints said it has epochs left to train: :meth:`check`)."""
        if not self.students.resuming:
            for _, cfg in self.students.training():
                check_before_torch(cfg)
            self.check_paths(overwrite)
            say_tagged_weights([cfg for _, cfg in self.students.training()])

    def check(self, overwrite: bool) -> None:
        """Every student's names and paths, and each folder, before any work."""
        for _, cfg in self.students.training():
            preflight(cfg)
        self.check_paths(overwrite)

    def check_paths(self, overwrite: bool) -> None:
        """Each student's data folder, and each folder the run writes."""
        students = self.students
        for _, cfg in students.training():
            check_inputs(cfg)
        if students.grouped and not students.resuming and not overwrite and is_students_folder(students.out):
            raise KDError(
                f"--out {students.out} already holds students ({STUDENTS_FILE}); "
                f"continue them with --resume or replace them with --overwrite"
            )
        for _, cfg in students.training():
            check_out(Path(cfg.out), students.resuming, overwrite)

    def repairs(self) -> List[str]:
        """Before a resumed run goes on: each student's best.pt copied again from last.pt where a kill
        between their writes left it older than the best epoch (a line for each)."""
        from kd.run.checkpoint import repair_best

        if not self.students.resuming:
            return []
        lines = []
        for cfg in self.students.cfgs:
            try:
                line = repair_best(RunFolder(cfg.out))
            except KDError:  # a damaged last.pt: the resume from another checkpoint goes on (kd verify names it)
                continue
            if line:
                lines.append(line)
        return lines

    def finished(self) -> Optional[str]:
        """The line that says so where every resumed student has trained its epochs already, else None."""
        return self.students.finished()

    def restarted(self) -> TrainJob:
        """The job of a restarted process group (``--max-restarts``): from the last checkpoints, where written."""
        again = self.students.from_last_checkpoints()
        return TrainJob(again, self.timed_after) if again is not None else self

    def run(self, backend, stop, hooks: Sequence[Any]) -> Dict[str, float]:
        from kd.run.loop import Trainer

        trainer = Trainer(self.students, backend, hooks=hooks, validate=not self.timed_after, stop=stop)
        try:
            return trainer.fit()
        finally:
            trainer.close()

    def how_to_continue(self) -> str:
        if any(RunFolder(c.out).last.is_file() for c in self.students.cfgs):
            return f"continue from its last checkpoint with: kd train --out {self.out} --resume"
        return "it had written no checkpoint; start it again"

    def done(self) -> str:
        return f"as the run ended; {self.out} holds it complete"


@dataclass(frozen=True)
class TeachJob:
    """``kd teach``: ``cfg.epochs`` epochs of the teacher's outputs on the run's crops written to
    the store ``cfg.out`` (continued where it holds some); ``timed_after`` as for :class:`TrainJob`."""

    cfg: Any
    timed_after: int = 0

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)

    def folders(self) -> List[Path]:
        return [self.out]

    def unstarted(self) -> List[Path]:
        return []  # a store keeps the epochs it completed (kd teach continues them)

    def check_early(self, overwrite: bool) -> None:
        """Before torch is imported: the names, devices and data folder."""
        check_before_torch(self.cfg, student=False)
        check_inputs(self.cfg)
        say_tagged_weights([self.cfg], student=False)

    def check(self, overwrite: bool) -> None:
        from kd.teacher.store import check_out as check_store

        preflight(self.cfg, student=False)
        check_inputs(self.cfg)
        check_store(self.out)

    def repairs(self) -> List[str]:
        return []  # a store has no best.pt

    def finished(self) -> Optional[str]:
        return None  # a store that holds its epochs says so itself (and validates its teacher if it had not)

    def restarted(self) -> TeachJob:
        return self  # a store continues from its complete epochs

    def run(self, backend, stop, hooks: Sequence[Any]) -> Dict[str, Any]:
        from kd.run.teach import Teaching

        teaching = Teaching(self.cfg, backend, stop, hooks, validate=not self.timed_after)
        try:
            return teaching.run()
        finally:
            teaching.close()

    def how_to_continue(self) -> str:
        return "run the same kd teach again to continue"

    def done(self) -> str:
        return f"as kd teach ended; {self.out} is complete"


#: what a launch runs
Job = Union[TrainJob, TeachJob]
