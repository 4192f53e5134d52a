"""Processes and run folders: one process in place, or one per device through torch's launcher.

Who starts the processes, as the environment tells:

* nobody: ``kd train`` runs in place (one process), or starts one process per ``--gpus`` entry
  (``CUDA_VISIBLE_DEVICES`` and the count both come from that list), ``--nproc`` processes on
  the CPU, or ``--nproc`` processes sharing fewer GPUs (``--gpus 0 --nproc 2``: over gloo), itself,
  through torch's elastic launcher (``torch.distributed.launcher.api.elastic_launch``, c10d
  rendezvous on 127.0.0.1 with a free port chosen by the system);
* ``torchrun`` or the deprecated ``python -m torch.distributed.launch`` (``--local_rank`` /
  ``--local-rank``), on one or several nodes: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are read as they are;
* Slurm's ``srun`` with several tasks (one per GPU): ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``,
  ``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE`` and the step's node list become torchrun's
  variables (``MASTER_ADDR``/``MASTER_PORT`` from the environment when set, else the first node
  and a port derived from the job id; :func:`kd.run.placement.slurm_env`), and kd starts no process
  of its own.

Each process reads its place once, as a :class:`kd.run.placement.Placement`. A ``KDError`` in any
worker reaches the user as one line and exit code 2 from the parent.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Type

from kd.errors import KDError
from kd.runfolder import RunFolder, why_unwritable
from kd.runlock import describe_holder, locked
from kd.utils.placement import Placement, slurm_env
from kd.utils.signals import Interrupted, held_for_children, launcher_handlers

if TYPE_CHECKING:  # imported where used: a launcher process builds no Trainer
    from kd.run.loop import Trainer


def prepare_out(cfg, resume: Optional[str], overwrite: bool) -> Optional[Path]:
    """Check ``--out`` before any work, writing nothing; returns the checkpoint to resume from, if any.

    A folder that holds a run is refused unless ``--resume`` or ``--overwrite`` is given, so
    nothing already written is lost by mistake. Every process of a launch checks, so none waits
    for one that refused. The folder is made (and an overwritten run removed) only once the run
    has set up without error (:meth:`kd.runfolder.RunFolder.start`), so a failed start leaves the disk as it was.
    """
    out = Path(cfg.out)
    if resume and overwrite:
        raise KDError("--resume and --overwrite contradict each other; give one")
    if resume:
        path = RunFolder(out).last if resume == "last" else Path(resume)
        if not path.is_file():
            raise KDError(f"nothing to resume: {path} does not exist")
        return path
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
    return None


def preflight(cfg) -> None:
    """Cheap checks of names and paths, before any process, model or loader is made."""
    import torch

    from kd import models
    from kd.losses import LOSSES
    from kd.version import torch_too_old

    reason = torch_too_old(torch.__version__)
    if reason:
        raise KDError(reason)

    if not cfg.teach:
        models.check_name(cfg.student)
        LOSSES.get("ce" if cfg.no_teacher else cfg.kd_loss)
    if not cfg.no_teacher and not cfg.soft_labels:
        models.check_name(cfg.teacher)
    if cfg.soft_labels:
        from kd.teacher.store import read_manifest

        read_manifest(Path(cfg.soft_labels))  # a missing or unreadable store fails before any work
    from kd.data.folder import check_data

    check_data(cfg.data)


def train(cfg, resume: Optional[str] = None, overwrite: bool = False, students=None):
    """Run ``cfg`` to the end; returns the last epoch's metrics (those of the main process).
    ``students`` (a :class:`kd.run.plan.Students`, ``cfg`` its first) trains several students at once.

    One writer per run folder: the process that launches the run (this one: kd's launcher parent,
    the one process, or rank 0 of those torchrun or srun started) holds the lock of every folder
    the run writes (:class:`kd.runlock.FolderLock`) from before any work until the run ends."""
    main = Placement.from_environment(None).rank == 0
    with locked(_folders(cfg, students)) if main else contextlib.nullcontext() as locks:
        for lock in locks or ():
            if lock.taken_over:
                print(
                    f"kd: {lock.root} was locked by a run that ended without releasing it "
                    f"({describe_holder(lock.taken_over)}); taken over",
                    file=sys.stderr,
                    flush=True,
                )
        return _train(cfg, resume, overwrite, students)


def _folders(cfg, students) -> List[Path]:
    """The folders a run writes: its --out, or several students' folder and each student's."""
    if students is None:
        return [Path(cfg.out)]
    return [Path(students.out), *(Path(c.out) for c in students.cfgs)]


def _train(cfg, resume: Optional[str], overwrite: bool, students):
    import backends

    backend_cls = backends.get(cfg.backend)
    os.environ.update(slurm_env(os.environ))  # torchrun's variables, which torch's env:// rendezvous reads
    place = Placement.from_environment(cfg.gpus)
    if place.launched:
        if place.world_size > 1 and not backend_cls.multiprocess:
            raise KDError(
                f"{place.world_size} processes were started (torchrun / srun), but --backend {cfg.backend} "
                f"runs in one; use --backend torch_ddp or apex_ddp, or start one process"
            )
        _check_available(cfg, backend_cls)
        resume_from = _preflight_all(cfg, resume, overwrite, students)
        return run_worker(cfg, _out(cfg, students), resume_from, place, students)
    nproc = backend_cls.num_processes(cfg)  # refuses requests that cannot be met, before any work
    _check_available(cfg, backend_cls)
    resume_from = _preflight_all(cfg, resume, overwrite, students)
    folders = [Path(c.out) for c in students.cfgs] + [Path(students.out)] if students is not None else [Path(cfg.out)]
    if cfg.teach:
        folders = []  # a store keeps the epochs it completed (kd teach continues them)
    existed = {folder for folder in folders if folder.exists()}
    try:
        if nproc == 1:
            return run_worker(cfg, _out(cfg, students), resume_from, place, students)
        return launch_local(cfg, nproc, resume_from, students)
    except (Interrupted, KeyboardInterrupt):
        if resume_from is None:  # a stop before the first checkpoint leaves the disk as it was
            for folder in folders:
                RunFolder(folder).discard_unstarted(keep_folder=folder in existed)
        raise


def _out(cfg, students) -> Path:
    return Path(students.out) if students is not None else Path(cfg.out)


def _preflight_all(cfg, resume: Optional[str], overwrite: bool, students) -> Optional[Path]:
    """:func:`preflight` and :func:`prepare_out` for the run, or for each of its students; for
    ``kd teach``, the checks of its store (:func:`kd.teacher.store.check_out`)."""
    if cfg.teach:
        from kd.teacher.store import check_out

        preflight(cfg)
        check_out(Path(cfg.out))
        return None
    if students is None:
        preflight(cfg)
        return prepare_out(cfg, resume, overwrite)
    for student in students.cfgs:
        preflight(student)
    return prepare_students_out(students, resume, overwrite)


def prepare_students_out(students, resume: Optional[str], overwrite: bool) -> Optional[Path]:
    """:func:`prepare_out` for every folder of ``students`` (a :class:`kd.run.loop.Students`);
    ``students.out`` when resuming."""
    from kd.run.students import STUDENTS_FILE, is_students_folder, stopped_students

    if resume not in (None, "last"):
        raise KDError(
            f"--resume {resume}: several students resume from their own last.pt; give --out {students.out} --resume"
        )
    if not resume and not overwrite and is_students_folder(students.out):
        raise KDError(
            f"--out {students.out} already holds students ({STUDENTS_FILE}); "
            f"continue them with --resume or replace them with --overwrite"
        )
    stopped = stopped_students(students.out) if resume else {}
    for name, cfg in zip(students.names, students.cfgs):
        if name not in stopped:  # a student stopped on a non-finite loss is not resumed
            prepare_out(cfg, resume, overwrite)
    return students.out if resume else None


def _check_available(cfg, backend_cls) -> None:
    reason = backend_cls.unavailable()
    if reason:
        raise KDError(f"--backend {cfg.backend} cannot run here: {reason}")


# ----------------------------------------------------------------------------- local launch
def visible_devices(cfg, nproc: int) -> Optional[str]:
    """``CUDA_VISIBLE_DEVICES`` for the workers: the ``--gpus`` entries (indices into what this
    process sees), or the first ``nproc`` GPUs (all of them, shared, for more processes); None on the CPU."""
    from backends.base import check_gpu_indices, resolve_device

    if resolve_device(cfg).type != "cuda":
        return None
    import torch

    current = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = (
        [d.strip() for d in current.split(",") if d.strip()]
        if current
        else [str(i) for i in range(torch.cuda.device_count())]
    )
    indices = cfg.gpus or list(range(min(nproc, len(ids))))
    if len(indices) > nproc:
        raise KDError(f"--gpus lists {len(indices)} GPU(s) but {nproc} processes were asked for")
    check_gpu_indices(indices, len(ids))
    return ",".join(ids[i] for i in indices)


def launch_local(cfg, nproc: int, resume_from: Optional[Path], students=None):
    """Start ``nproc`` workers on this machine through torch's elastic launcher; rank 0's result."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    signal_exception: Type[BaseException]
    try:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        signal_exception = SignalException
    except ImportError:  # pragma: no cover - older torch
        signal_exception = KeyboardInterrupt

    visible = visible_devices(cfg, nproc)
    error_dir = tempfile.mkdtemp(prefix="kd-launch-")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"kd-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        local_addr="127.0.0.1",
        max_restarts=cfg.max_restarts,
        start_method="spawn",
    )
    previous = logging.root.manager.disable
    logging.disable(logging.ERROR)  # the agent's own failure report; kd reports the cause below
    try:
        # the workers take a stop signal once kd's handler is in place; the agent's handlers, which
        # it leaves installed, go once it is done
        with launcher_handlers(), held_for_children():
            results = elastic_launch(config, worker)(
                cfg, str(_out(cfg, students)), resume_from, error_dir, visible, students, os.getpid()
            )
    except (ChildFailedError, signal_exception) as exc:
        out = _out(cfg, students)
        failures = exc.failures if isinstance(exc, ChildFailedError) else None
        killed = failures is not None and rank_killed(failures, cfg, out, students)
        if killed:  # before a stop's message: the agent stopped the other ranks because of it
            raise RankFailed(*killed) from None
        error = first_error(error_dir)
        if failures is not None and error is not None:  # a rank's error: the agent stopped the others
            raise KDError(error) from None
        crashes = sorted(Path(error_dir).glob("crash*.txt"))
        if failures is not None and crashes:
            sys.stderr.write(crashes[0].read_text(encoding="utf-8").split("\n", 1)[-1])  # its traceback, above
            raise RankFailed(*rank_failed(failures, cfg, out, students, error_dir)) from None
        stopped = Path(error_dir, "interrupted.txt")
        if stopped.exists():  # the workers stopped on a signal after writing their checkpoint
            from kd.utils.signals import Interrupted

            signame, message = stopped.read_text(encoding="utf-8").split("\n", 1)
            raise Interrupted(signame, message=message) from None
        if error is not None:
            raise KDError(error) from None
        if failures is None:  # the launcher's own signal, after the workers' last check
            raise _stopped_launcher(exc, error_dir, cfg, out, students) from None
        raise RankFailed(*rank_failed(failures, cfg, out, students, error_dir)) from None
    finally:
        logging.disable(previous)
        shutil.rmtree(error_dir, ignore_errors=True)
    return results.get(0)


def worker(
    cfg,
    out: str,
    resume_from: Optional[Path],
    error_dir: str,
    visible: Optional[str],
    students=None,
    launcher: Optional[int] = None,
):
    """The entrypoint of each process kd's launcher starts (module level, so it pickles); it dies
    with ``launcher``, the launching process (:mod:`kd.lifeline`)."""
    from kd.lifeline import die_with_parent
    from kd.utils.signals import Interrupted, exit_when_stopped, install_early, stopped_in_run

    if launcher is not None:
        die_with_parent(launcher)
    main = Placement.from_environment(None).rank == 0
    try:
        install_early(launched=True)  # first: the signals held while this process started arrive now
        result = _worker(cfg, out, resume_from, visible, students)
    except Interrupted as exc:
        if main:
            Path(error_dir, "interrupted.txt").write_text(f"{exc.signame}\n{exc}", encoding="utf-8")
        raise SystemExit(143 if exc.signame == "SIGTERM" else 130) from None
    except KDError as exc:
        rank = Placement.from_environment(None).rank
        Path(error_dir, f"rank{rank:05d}.txt").write_text(str(exc), encoding="utf-8")
        raise SystemExit(2) from None
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise _crashed(exc, error_dir) from None
        rank = Placement.from_environment(None).rank
        where = f" writing {exc.filename}" if exc.filename else ""
        Path(error_dir, f"rank{rank:05d}.txt").write_text(
            f"no space left on the device{where}; free space, then continue with --resume", encoding="utf-8"
        )
        raise SystemExit(2) from None
    except Exception as exc:  # a bug, or an error kd does not translate (out of memory): its traceback stays
        raise _crashed(exc, error_dir) from None
    # the run is complete: what the launcher says should a stop reach it before it has the results
    done = f"as the run ended; {out} holds it complete" if not cfg.teach else f"as kd teach ended; {out} is complete"
    if main:
        Path(error_dir, "finished.txt").write_text(done, encoding="utf-8")
    signame = stopped_in_run()
    if signame:  # a stop after the run's last check: the run ended, and the process ends as stopped
        if main:
            Path(error_dir, "interrupted.txt").write_text(f"{signame}\nstopped by {signame} {done}", encoding="utf-8")
        raise SystemExit(143 if signame == "SIGTERM" else 130)
    exit_when_stopped()  # while the launcher collects the result
    return result


def _crashed(exc: BaseException, error_dir: str) -> SystemExit:
    """A rank's error that is no user error of kd's: its one line and its traceback for the
    launcher, which shows them where this rank's error is the run's cause (:func:`rank_failed`; a
    rank that failed because another was killed says nothing), and exit code 1."""
    import traceback

    rank = Placement.from_environment(None).rank
    cause = (str(exc).strip().splitlines() or [""])[0][:300]
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    Path(error_dir, f"crash{rank:05d}.txt").write_text(f"{type(exc).__name__}: {cause}\n{trace}", encoding="utf-8")
    return SystemExit(1)


def _worker(cfg, out: str, resume_from: Optional[Path], visible: Optional[str], students):
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    place = Placement.for_visible_gpus(visible) if visible is not None else Placement.from_environment(cfg.gpus)
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores instead of each process taking them all
        import torch

        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // max(place.local_world_size, 1)))
    if students is not None:
        from kd.run.students import stopped_students

        stopped = stopped_students(Path(out))
        last = [RunFolder(s.out).last for n, s in zip(students.names, students.cfgs) if n not in stopped]
    else:
        last = [RunFolder(out).last]
    if place.restart > 0 and all(path.is_file() for path in last):
        # --max-restarts: the restarted group continues from the last checkpoint(s)
        resume_from = Path(out) if students is not None else last[0]
    return run_worker(cfg, Path(out), resume_from, place, students, signals_ready=True)


def _stopped_launcher(exc, error_dir: str, cfg, out: Path, students=None) -> Interrupted:
    """The stop of a launcher that took a signal (torch's ``SignalException``) when no worker wrote
    why it stopped: a run that had ended (its workers' ``finished.txt``), or one they left as it was."""
    signame = getattr(getattr(exc, "sigval", None), "name", "") or "a signal"
    finished = Path(error_dir, "finished.txt")
    if finished.exists():
        return Interrupted(signame, message=f"stopped by {signame} {finished.read_text(encoding='utf-8')}")
    if cfg.teach:
        where = "run the same kd teach again to continue"
    elif any(RunFolder(c.out).last.is_file() for c in (students.cfgs if students is not None else [cfg])):
        where = f"continue from its last checkpoint with: kd train --out {out} --resume"
    else:
        where = "it had written no checkpoint; start it again"
    return Interrupted(signame, message=f"stopped by {signame}; {where}")


class RankFailed(KDError):
    """A rank of kd's own launch ended without a message of kd's (killed, or crashed); ``code`` is
    ``exit_code`` is kd's: 128 + the signal that killed the rank (as a shell reports a killed
    process: 137 for SIGKILL, the out-of-memory killer's), else the rank's own exit code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def rank_killed(failures, cfg, out: Path, students=None):
    """The lowest rank of ``failures`` (torch's ``ProcessFailure`` by rank) that a signal killed,
    as :class:`RankFailed`'s arguments; None where none was."""
    killed = sorted(rank for rank, failure in failures.items() if failure.exitcode < 0)
    return rank_failed({killed[0]: failures[killed[0]]}, cfg, out, students) if killed else None


def rank_failed(failures, cfg, out: Path, students=None, error_dir: Optional[str] = None):
    """One line and an exit code for the lowest rank of ``failures`` (:class:`RankFailed`): what
    became of it (with the error it raised, where it wrote one to ``error_dir``), and how the run
    goes on (``--resume``, ``--max-restarts``)."""
    crashes = sorted(Path(error_dir).glob("crash*.txt")) if error_dir else []
    rank = int(crashes[0].stem[len("crash") :]) if crashes else min(failures)  # the cause, not the ranks stopped for it
    code = failures[rank].exitcode if rank in failures else 1
    crash = crashes[0] if crashes else None
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        what, exit_code = f"was killed by {name}", 128 - code
    else:
        what, exit_code = f"exited with code {code}", code if 0 < code < 256 else 1
        if crash is not None and crash.is_file():  # its traceback is in the log above
            what = f"failed with {crash.read_text(encoding='utf-8').splitlines()[0]} (its traceback above)"
    restarts = (
        f"--max-restarts {cfg.max_restarts} was used up"
        if cfg.max_restarts
        else "--max-restarts N restarts the group on its own"
    )
    if cfg.teach:
        where = "run the same kd teach again to continue"
    elif RunFolder(out).last.is_file() or (students and any(RunFolder(c.out).last.is_file() for c in students.cfgs)):
        where = f"continue from its last checkpoint with: kd train --out {out} --resume"
    else:
        where = "it had written no checkpoint; start it again"
    return f"rank {rank} of the run {what}, and the run stopped; {where} ({restarts})", exit_code


def first_error(error_dir: str) -> Optional[str]:
    """The message of the lowest rank that wrote one, if any."""
    files = sorted(Path(error_dir).glob("rank*.txt"))
    return files[0].read_text(encoding="utf-8") if files else None


def accept_legacy_local_rank(local_rank: Optional[int]) -> None:
    """``python -m torch.distributed.launch`` passes ``--local_rank N``; treat it as LOCAL_RANK."""
    if local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(local_rank))


def run_worker(
    cfg,
    out: Path,
    resume_from: Optional[Path] = None,
    place: Optional[Placement] = None,
    students=None,
    signals_ready: bool = False,
) -> Dict[str, float]:
    """Everything one process does for a run, from backend set-up to teardown, where ``place`` (as the
    launcher found it) says. ``timing_warmup`` (``kd bench``) adds the step timer and skips validation.
    ``students``: several students at once (:mod:`kd.run.plan`), each resuming from its own last.pt
    where ``resume_from`` is given."""
    import backends
    from kd.run.loop import Trainer
    from kd.utils.signals import StopFlag, install_early

    launched = bool(place and place.launched)
    # until here a stop signal ends the process at once (kd's own workers installed that at their
    # start); from the StopFlag on it sets the flag the run checks
    restore_signals = None if signals_ready else install_early(launched)
    backend = backends.get(cfg.backend)(cfg, place)
    trainer: Optional[Trainer] = None
    stop: Optional[StopFlag] = None
    hooks = []
    if cfg.timing_warmup:
        from kd.run.timing import StepTimer

        hooks.append(StepTimer(cfg.timing_warmup, backend))
    try:
        stop = StopFlag(launched)  # before the process group: a signal inside its C++ set-up only sets the flag
        backend.setup()
        if cfg.teach:
            from kd.run.loop import Teaching

            teaching = Teaching(cfg, backend, stop, hooks)
            try:
                return teaching.run()
            finally:
                teaching.close()
        trainer = Trainer(
            students if students is not None else cfg, backend, resume_from, hooks=hooks, validate=not hooks, stop=stop
        )
        return trainer.fit()
    finally:
        if trainer is not None:
            trainer.close()
        backend.teardown()
        if stop is not None:
            stop.restore()
        if restore_signals is not None:
            restore_signals()
