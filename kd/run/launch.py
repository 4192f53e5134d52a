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
  and a port derived from the job id; :func:`kd.utils.placement.slurm_env`), and kd starts no process
  of its own.

Each process reads its place once, as a :class:`kd.utils.placement.Placement`. A ``KDError`` in any
worker reaches the user as one line and exit code 2 from the parent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Optional, Type

from kd.errors import WRITE_ONLY_ERRNOS, KDError, cannot_write
from kd.run.log import wall_clock
from kd.runfolder import RunFolder
from kd.runlock import describe_holder, locked
from kd.utils.placement import Placement, slurm_env
from kd.utils.signals import Interrupted, held_for_children, launcher_handlers

if TYPE_CHECKING:  # what runs comes from the command (kd.run.jobs)
    from kd.run.jobs import Job


def train(job: Job, overwrite: bool = False):
    """Run ``job`` (:mod:`kd.run.jobs`: students to train, or a store to teach) to the end; returns
    the main process's last epoch record. A run whose resumed students have trained their epochs
    already says so on stderr and returns None.

    One writer per run folder: the process that launches the run (this one: kd's launcher parent,
    the one process, or rank 0 of those torchrun or srun started) holds the lock of every folder
    the run writes (:class:`kd.runlock.FolderLock`) from before any work until the run ends."""
    main = Placement.from_environment(None).rank == 0
    with locked(job.folders()) if main else contextlib.nullcontext() as locks:
        for lock in locks or ():
            if lock.taken_over:
                print(
                    f"kd: {lock.root} was locked by a run that ended without releasing it "
                    f"({describe_holder(lock.taken_over)}); taken over",
                    file=sys.stderr,
                    flush=True,
                )
        for line in job.repairs() if main and not overwrite else ():
            print(line, file=sys.stderr, flush=True)
        finished = None if overwrite else job.finished()
        if finished:
            if main:
                print(finished, file=sys.stderr, flush=True)
            return None
        with wall_clock(job.folders() if main else ()):
            return _train(job, overwrite)


def _train(job: Job, overwrite: bool):
    import backends

    cfg = job.cfg
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
        job.check(overwrite)
        return run_worker(job, place)
    nproc = processes_here(cfg, backend_cls)
    job.check(overwrite)
    folders = job.unstarted()
    existed = {folder for folder in folders if folder.exists()}
    try:
        if nproc == 1:
            return run_worker(job, place)
        return launch_local(job, nproc)
    except (Interrupted, KeyboardInterrupt):
        for folder in folders:  # a stop before the first checkpoint leaves the disk as it was
            RunFolder(folder).discard_unstarted(keep_folder=folder in existed)
        raise


def processes_here(cfg, backend_cls) -> int:
    """The processes ``backend_cls`` starts for ``cfg`` on this machine; a KDError, before any
    work, where the request cannot be met or the backend cannot run here at all."""
    nproc = backend_cls.num_processes(cfg)
    _check_available(cfg, backend_cls)
    return nproc


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


def launch_local(job: Job, nproc: int):
    """Start ``nproc`` workers on this machine through torch's elastic launcher; rank 0's result."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    signal_exception: Type[BaseException]
    try:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        signal_exception = SignalException
    except ImportError:  # pragma: no cover - older torch
        signal_exception = KeyboardInterrupt

    from kd.run import checkpoint

    checkpoint.forget()  # the workers read the checkpoints they resume from; the files' old versions may go
    cfg = job.cfg
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
            results = elastic_launch(config, worker)(job, error_dir, visible, os.getpid())
    except (ChildFailedError, signal_exception) as exc:
        failures = exc.failures if isinstance(exc, ChildFailedError) else None
        killed = failures is not None and rank_killed(failures, job, error_dir)
        if killed:  # before a stop's message: the agent stopped the other ranks because of it
            raise RankFailed(*killed) from None
        error = first_error(error_dir)
        if failures is not None and error is not None:  # a rank's error: the agent stopped the others
            raise KDError(error) from None
        crashes = sorted(Path(error_dir).glob("crash*.txt"))
        if failures is not None and crashes:
            sys.stderr.write(crashes[0].read_text(encoding="utf-8").split("\n", 1)[-1])  # its traceback, above
            raise RankFailed(*rank_failed(failures, job, error_dir)) from None
        stopped = Path(error_dir, "interrupted.txt")
        if stopped.exists():  # the workers stopped on a signal after writing their checkpoint
            from kd.utils.signals import Interrupted

            signame, message = stopped.read_text(encoding="utf-8").split("\n", 1)
            raise Interrupted(signame, message=message) from None
        if error is not None:
            raise KDError(error) from None
        if failures is None:  # the launcher's own signal, after the workers' last check
            raise _stopped_launcher(exc, error_dir, job) from None
        raise RankFailed(*rank_failed(failures, job, error_dir)) from None
    finally:
        logging.disable(previous)
        shutil.rmtree(error_dir, ignore_errors=True)
    return results.get(0)


def worker(job: Job, error_dir: str, visible: Optional[str], launcher: Optional[int] = None):
    """The entrypoint of each process kd's launcher starts (module level, so it pickles); it dies
    with ``launcher``, the launching process (:mod:`kd.process_deaths`)."""
    from kd.process_deaths import die_with_parent
    from kd.utils.signals import Interrupted, exit_when_stopped, install_early, stopped_in_run

    if launcher is not None:
        die_with_parent(launcher)
    rank = Placement.from_environment(None).rank
    main = rank == 0
    Path(error_dir, f"pid{rank:05d}.txt").write_text(str(os.getpid()), encoding="utf-8")  # for its peers
    try:
        install_early(launched=True)  # first: the signals held while this process started arrive now
        result = _worker(job, visible)
    except Interrupted as exc:
        if main:
            Path(error_dir, "interrupted.txt").write_text(f"{exc.signame}\n{exc}", encoding="utf-8")
        raise SystemExit(143 if exc.signame == "SIGTERM" else 130) from None
    except KDError as exc:
        Path(error_dir, f"rank{rank:05d}.txt").write_text(str(exc), encoding="utf-8")
        raise SystemExit(2) from None
    except OSError as exc:
        if exc.errno not in WRITE_ONLY_ERRNOS:
            raise _crashed(exc, error_dir) from None
        Path(error_dir, f"rank{rank:05d}.txt").write_text(
            str(cannot_write(exc, then="continue with --resume")), encoding="utf-8"
        )
        raise SystemExit(2) from None
    except Exception as exc:  # a bug, or an error kd does not translate (out of memory): its traceback stays
        raise _crashed(exc, error_dir) from None
    # the run is complete: what the launcher says should a stop reach it before it has the results
    done = job.done()
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
    if peer_failed(error_dir, rank):  # its collective lost that peer: this error is not the run's cause
        wait_to_be_stopped()
    cause = (str(exc).strip().splitlines() or [""])[0][:300]
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    Path(error_dir, f"crash{rank:05d}.txt").write_text(f"{type(exc).__name__}: {cause}\n{trace}", encoding="utf-8")
    return SystemExit(1)


def peer_failed(error_dir: str, rank: int, within: float = 1.0) -> bool:
    """Whether another rank of this launch (its pid in ``error_dir``) has ended with a failure,
    watched for ``within`` seconds: a killed peer's connections close as it dies."""
    from kd.process_deaths import ended_in_failure

    pids = [int(p.read_text(encoding="utf-8")) for p in Path(error_dir).glob("pid*.txt") if p.stem != f"pid{rank:05d}"]
    deadline = time.monotonic() + within
    while not any(ended_in_failure(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_to_be_stopped(limit: float = 60.0) -> None:
    """Stay alive while the launcher sees a failed peer and stops this rank: the launcher reports
    the rank it sees end first, and that must be the peer. A stop signal ends the process as it
    comes, without a word; after ``limit`` seconds the caller goes on."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    time.sleep(limit)


def _worker(job: Job, visible: Optional[str]):
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    place = Placement.for_visible_gpus(visible) if visible is not None else Placement.from_environment(job.cfg.gpus)
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores instead of each process taking them all
        import torch

        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // max(place.local_world_size, 1)))
    if place.restart > 0:  # --max-restarts: the restarted group continues from the last checkpoint(s)
        job = job.restarted()
    return run_worker(job, place, signals_ready=True)


def _stopped_launcher(exc, error_dir: str, job: Job) -> Interrupted:
    """The stop of a launcher that took a signal (torch's ``SignalException``) when no worker wrote
    why it stopped: a run that had ended (its workers' ``finished.txt``), or one they left as it was."""
    signame = getattr(getattr(exc, "sigval", None), "name", "") or "a signal"
    finished = Path(error_dir, "finished.txt")
    if finished.exists():
        return Interrupted(signame, message=f"stopped by {signame} {finished.read_text(encoding='utf-8')}")
    return Interrupted(signame, message=f"stopped by {signame}; {job.how_to_continue()}")


class RankFailed(KDError):
    """A rank of kd's own launch ended without a message of kd's (killed, or crashed); ``code`` is
    ``exit_code`` is kd's: 128 + the signal that killed the rank (as a shell reports a killed
    process: 137 for SIGKILL, the out-of-memory killer's), else the rank's own exit code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def rank_killed(failures, job: Job, error_dir: str):
    """The lowest rank of ``failures`` (torch's ``ProcessFailure`` by rank) that a signal killed,
    as :class:`RankFailed`'s arguments; None where none was. A rank that wrote its error before the
    signal came (an abort in a library's threads as it exited, say) ended for that error: not killed."""
    said = {int(p.stem[len("rank") :]) for p in Path(error_dir).glob("rank*.txt")}
    killed = sorted(rank for rank, failure in failures.items() if failure.exitcode < 0 and rank not in said)
    return rank_failed({killed[0]: failures[killed[0]]}, job) if killed else None


def rank_failed(failures, job: Job, error_dir: Optional[str] = None):
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
        f"--max-restarts {job.cfg.max_restarts} was used up"
        if job.cfg.max_restarts
        else "--max-restarts N restarts the group on its own"
    )
    return f"rank {rank} of the run {what}, and the run stopped; {job.how_to_continue()} ({restarts})", exit_code


def first_error(error_dir: str) -> Optional[str]:
    """The message of the lowest rank that wrote one, if any."""
    files = sorted(Path(error_dir).glob("rank*.txt"))
    return files[0].read_text(encoding="utf-8") if files else None


def accept_legacy_local_rank(local_rank: Optional[int]) -> None:
    """``python -m torch.distributed.launch`` passes ``--local_rank N``; treat it as LOCAL_RANK."""
    if local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(local_rank))


def run_worker(job: Job, place: Optional[Placement] = None, signals_ready: bool = False) -> Dict[str, float]:
    """Everything one process does for ``job``, from backend set-up to teardown, where ``place`` (as
    the launcher found it) says; ``job.timed_after`` (``kd bench``) adds the step timer."""
    import backends
    from kd.utils.signals import StopFlag, install_early

    launched = bool(place and place.launched)
    # until here a stop signal ends the process at once (kd's own workers installed that at their
    # start); from the StopFlag on it sets the flag the run checks
    restore_signals = None if signals_ready else install_early(launched)
    backend = backends.get(job.cfg.backend)(job.cfg, place)
    stop: Optional[StopFlag] = None
    hooks = []
    if job.timed_after:
        from kd.run.timing import StepTimer

        hooks.append(StepTimer(job.timed_after, backend))
    try:
        stop = StopFlag(launched)  # before the process group: a signal inside its C++ set-up only sets the flag
        backend.setup()
        return job.run(backend, stop, hooks)
    finally:
        backend.teardown()
        if stop is not None:
            stop.restore()
        if restore_signals is not None:
            restore_signals()
