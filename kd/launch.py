"""Processes and run folders: one process in place, or one per device through torch's launcher.

Started by ``kd train`` itself, by ``torchrun``, by the deprecated
``torch.distributed.launch`` or by Slurm's ``srun``; the environment says which.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from kd.errors import KDError

RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "tb")


def in_launched_process() -> bool:
    """True inside a process that torchrun / torch.distributed.launch / kd's launcher started."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def prepare_out(cfg, resume: Optional[str], overwrite: bool) -> Optional[Path]:
    """Check ``--out`` before any work; returns the checkpoint to resume from, if any.

    A folder that holds a run is refused unless ``--resume`` or ``--overwrite`` is given, so
    nothing already written is lost by mistake.
    """
    out = Path(cfg.out)
    if resume and overwrite:
        raise KDError("--resume and --overwrite contradict each other; give one")
    if resume:
        path = out / "checkpoints" / "last.pt" if resume == "last" else Path(resume)
        if not path.is_file():
            raise KDError(f"nothing to resume: {path} does not exist")
        return path
    if out.exists() and not out.is_dir():
        raise KDError(f"--out {out} exists and is not a folder")
    held = [name for name in RUN_FILES if (out / name).exists()]
    if held and not overwrite:
        raise KDError(f"--out {out} already holds a run ({', '.join(held)}); "
                      f"continue it with --resume or replace it with --overwrite")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".kd-write-test"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise KDError(f"--out {out} is not writable: {exc.strerror}") from None
    if overwrite:
        for name in held:
            target = out / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
    return None


def preflight(cfg) -> None:
    """Cheap checks of names and paths, before any process, model or loader is made."""
    from kd import models
    from kd.losses import LOSSES

    models.check_name(cfg.student)
    if not cfg.no_teacher:
        models.check_name(cfg.teacher)
    LOSSES.get("ce" if cfg.no_teacher else cfg.kd_loss)
    if cfg.data != "synthetic":
        for split in ("train", "val"):
            if not (Path(cfg.data) / split).is_dir():
                what = "does not exist" if not Path(cfg.data).is_dir() else f"has no {split}/ subfolder"
                raise KDError(f"data folder {cfg.data} {what} (expected DIR/train/<class>/*.jpg and DIR/val/<class>/*.jpg)")


def train(cfg, resume: Optional[str] = None, overwrite: bool = False):
    """Run ``cfg`` to the end; returns the last epoch's metrics (on the main process)."""
    import backends
    from kd.engine import run_worker

    backend_cls = backends.get(cfg.backend)
    reason = backend_cls.unavailable()
    if reason:
        raise KDError(f"--backend {cfg.backend} cannot run here: {reason}")
    launched = in_launched_process()
    is_main = not launched or os.environ.get("RANK", "0") == "0"
    resume_from = None
    preflight(cfg)
    if is_main:
        resume_from = prepare_out(cfg, resume, overwrite)
    elif resume:
        resume_from = Path(cfg.out) / "checkpoints" / "last.pt" if resume == "last" else Path(resume)
    nproc = backend_cls.num_processes(cfg)
    if launched or nproc == 1 and not backend_cls.multiprocess:
        return run_worker(cfg, Path(cfg.out), resume_from)
    raise KDError(f"--backend {cfg.backend} needs the multi-process launcher, which is not built yet")


def accept_legacy_local_rank(local_rank: Optional[int]) -> None:
    """``python -m torch.distributed.launch`` passes ``--local_rank N``; treat it as LOCAL_RANK."""
    if local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
