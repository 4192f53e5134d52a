"""A run's checkpoints: a lane's full state (float32 weights, optimizer, schedule, scaler, position,
counters, every rank's generators), written by the main process, read back on resume.

The files are written and read by :mod:`kd.utils.checkpoint_io`: atomically, each with its SHA-256
beside it, checked before it is read, loaded with ``weights_only=True``.
"""

from __future__ import annotations

import errno
import random
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, cast

import numpy as np
import torch

from kd.errors import KDError
from kd.runfolder import RunFolder
from kd.utils.checkpoint_io import copy_atomic, read, remove, save_atomic, verify
from kd.version import __version__

FORMAT_VERSION = 1


def rng_state() -> Dict[str, Any]:
    """This process's generators: torch's, Python's, NumPy's and its own current GPU's (not every visible GPU's)."""
    # get_state() is the legacy tuple (name, keys, pos, has_gauss, cached_gaussian); numpy's stubs
    # also allow the dict form, which only get_state(legacy=False) returns
    np_state = cast(Tuple[str, np.ndarray, int, int, float], np.random.get_state())
    state = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]),
        "python_pos": random.getstate()[2],
        "numpy": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore :func:`rng_state`; the GPU state goes to the current GPU. An older checkpoint's list of
    every GPU's state gives the entry of the current GPU, where it has one."""
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    cuda = state.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return
    if isinstance(cuda, (list, tuple)):
        index = torch.cuda.current_device()
        cuda = cuda[index] if index < len(cuda) else None
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def load(path: Path, mmap: bool = False) -> Dict[str, Any]:
    """A kd checkpoint, refusing anything that needs arbitrary code to unpickle; ``mmap``: its
    tensors memory-mapped, read only where used (a check that it can be resumed costs little)."""
    path = Path(path)
    if not path.is_file():
        raise KDError(f"nothing to resume: {path} does not exist")
    verify(path)
    obj = read(path, "cannot load checkpoint", mmap=mmap)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_VERSION or "student" not in obj:
        raise KDError(f"{path} is not a kd checkpoint")
    return obj


def finished_epochs(path: Path, epochs: int) -> Optional[int]:
    """The epochs the run of checkpoint ``path`` trained where that is ``epochs`` or more (nothing left
    to resume), else None."""
    verify(path)
    state = read(path, "cannot load checkpoint", mmap=True)  # memory-mapped: the run reads it again
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise KDError(f"{path} is not a kd checkpoint")
    done = int(state.get("epoch", 0))
    return done if done >= epochs and not state.get("pending_epoch") else None


# ----------------------------------------------------------------- a trainer's state
def restore_run(t, state: dict) -> None:
    """Put ``state`` (a :func:`run_state`) back into the trainer ``t``: weights, optimizer, schedule,
    scaler, position, counters and this rank's generators."""
    side_state = {f"student.{k}": v for k, v in state["student"].items()}
    side_state.update({f"loss.{k}": v for k, v in state.get("loss", {}).items()})
    t.precision.load_model_state(t.side, side_state)
    t.optimizer.load_state_dict(state["optimizer"])
    t.scheduler.load_state_dict(state["scheduler"])
    t.precision.load_state_dict(state.get("precision", {}))
    t.epoch = state["epoch"]
    t.batch_in_epoch = state.get("batch_in_epoch", 0)
    t.global_step = state["global_step"]
    t.best_top1 = state["best_top1"]
    t.bad_files = set(state.get("bad_files", []))
    pending = state.get("pending_epoch")
    t.pending_epoch = (pending["train"], pending["seconds"]) if pending else None
    if state.get("meter") and t.backend.is_main:
        t.meter.load_state_dict(state["meter"])
    rng = state.get("rng", {}).get(str(t.backend.rank))
    if rng is not None:
        set_rng_state(rng)


def run_state(t, rng: Optional[Dict[str, Any]] = None, meter: Optional[dict] = None) -> dict:
    """The trainer ``t``'s full state for ``last.pt``: float32 weights, optimizer, schedule, scaler,
    position in the epoch, counters, the run's config, and (from :func:`save_run`) every rank's
    generators and a mid-epoch meter."""
    side = t.precision.model_state(t.side)
    student = {k[len("student.") :]: v for k, v in side.items() if k.startswith("student.")}
    return {
        "format": FORMAT_VERSION,
        "kd_version": __version__,
        "student": student,
        # the same tensors (stored once) where timm's load_checkpoint and most scripts look
        "state_dict": student,
        "loss": {k[len("loss.") :]: v for k, v in side.items() if k.startswith("loss.")},
        "optimizer": t.optimizer.state_dict(),
        "scheduler": t.scheduler.state_dict(),
        "precision": t.precision.state_dict(),
        "epoch": t.epoch,
        "batch_in_epoch": t.batch_in_epoch,
        "global_step": t.global_step,
        "best_top1": t.best_top1,
        "bad_images": len(t.bad_files),
        "bad_files": sorted(t.bad_files),
        # an epoch trained whose validation a stop cut short
        "pending_epoch": {"train": t.pending_epoch[0], "seconds": t.pending_epoch[1]} if t.pending_epoch else None,
        "meter": meter,
        "rng": rng or {},
        "student_name": t.cfg.student,
        "num_classes": t.num_classes,
        "classes": list(t.data.classes),
        "config": t.cfg.to_dict(),
    }


def write_failure(exc: BaseException, folder: Path) -> str:
    """What stopped a write to ``folder``, in words (a full disk with the space it has)."""
    if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        try:
            return f"no space left on the device ({shutil.disk_usage(folder).free / 2**20:.1f} MiB free)"
        except OSError:
            return "no space left on the device"
    return getattr(exc, "strerror", None) or str(exc).splitlines()[0]


def nonfinite_keys(state: Dict[str, torch.Tensor]) -> list:
    """The names of the floating tensors of ``state`` that hold inf or NaN (one host read)."""
    names = [k for k, v in state.items() if v.is_floating_point()]
    if not names:
        return []
    bad = torch.stack([~torch.isfinite(state[k]).all() for k in names]).tolist()
    return [k for k, b in zip(names, bad) if b]


def save_run(t, best: bool, step_copy: bool = False) -> None:
    """Checkpoint on the main process: last.pt (and best.pt, or a step_N.pt copy), atomically.

    A state reached through a non-finite loss is not saved, so the last good one stays.
    A failed write (disk full) keeps the previous file and stops the run with a clear error.
    """
    t.backend.sync_buffers(t.side)
    # every process's generators (each draws its own dropout masks), restored rank by rank, and the
    # unreadable files each met since the last check
    gathered = t.backend.all_gather_object((rng_state(), sorted(t.new_bad_files)))
    rng = {str(rank): state for rank, (state, _) in enumerate(gathered)}
    for _, paths in gathered:
        t.bad_files.update(paths)
    t.new_bad_files.clear()
    # a mid-epoch checkpoint holds the epoch's sums over every process; rank 0 alone restores them
    meter = t.meter.global_state(t.backend) if t.batch_in_epoch else None
    if t.backend.is_main and t.meter.streak.item() > 0:
        t.logger.info("not checkpointing: the last step was skipped (not finite); the previous checkpoint stays")
    elif t.backend.is_main:
        run = RunFolder(t.out)
        folder, path = run.checkpoints, run.last
        state = run_state(t, rng, meter)
        broken = nonfinite_keys(state["student"]) + nonfinite_keys(state["loss"])
        if broken:  # never a checkpoint that cannot evaluate (the step's policy should make this impossible)
            t.logger.info(f"not checkpointing: {', '.join(broken[:3])} not finite; the previous checkpoint stays")
            t.backend.barrier()
            return
        try:
            with t.stop.critical():  # a forced stop (a second Ctrl-C) waits for the files
                save_atomic(state, path)
                if best:
                    copy_atomic(path, run.best)
                if step_copy:  # the oldest go first, so a kill at any moment leaves at most --keep-last copies
                    kept = sorted(folder.glob("step_*.pt"))
                    for old in kept[: max(0, len(kept) - (t.cfg.keep_last - 1))]:
                        remove(old)
                    copy_atomic(path, folder / f"step_{t.global_step:08d}.pt")
        except OSError as exc:  # (save_atomic turns torch.save's short write on a full disk into one)
            todo = "free space, then " if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
            intact = (
                f"the previous checkpoint is intact: {todo}continue with --resume"
                if path.is_file()
                else f"no checkpoint was written yet: {todo}start again"
            )
            raise KDError(f"could not write a checkpoint to {folder}: {write_failure(exc, folder)}; {intact}") from None
    t.backend.barrier()
