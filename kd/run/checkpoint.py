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

from kd.errors import KDError, write_fix, write_reason
from kd.run.state import TrainState
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
def restore_run(lane, state: dict) -> None:
    """Put ``state`` (a :func:`run_state`) back into ``lane``: weights, optimizer, schedule, scaler,
    its :class:`kd.run.state.TrainState` and this rank's generators."""
    side_state = {f"student.{k}": v for k, v in state["student"].items()}
    side_state.update({f"loss.{k}": v for k, v in state.get("loss", {}).items()})
    lane.precision.load_model_state(lane.side, side_state)
    lane.optimizer.load_state_dict(state["optimizer"])
    lane.scheduler.load_state_dict(state["scheduler"])
    lane.precision.load_state_dict(state.get("precision", {}))
    if lane.ema is not None:
        if not isinstance(state.get("state_dict_ema"), dict):
            raise KDError("the checkpoint holds no moving average (state_dict_ema) for --model-ema")
        lane.ema.load_state_dict(state["state_dict_ema"])
    pending = state.get("pending_epoch")
    lane.state = TrainState(
        epoch=state["epoch"],
        batch_in_epoch=state.get("batch_in_epoch", 0),
        global_step=state["global_step"],
        best_top1=state["best_top1"],
        best_epoch=state.get("best_epoch"),
        bad_files=set(state.get("bad_files", [])),
        pending_epoch=(pending["train"], pending["seconds"]) if pending else None,
    )
    if state.get("meter") and lane.backend.is_main:
        lane.meter.load_state_dict(state["meter"])
    # the lr of each step of an epoch stopped mid-way: its logged mean covers the whole epoch
    lane.epoch_lrs = list(state.get("epoch_lrs") or []) if lane.state.batch_in_epoch else []
    rng = state.get("rng", {}).get(str(lane.backend.rank))
    if rng is not None:
        set_rng_state(rng)


def run_state(lane, rng: Optional[Dict[str, Any]] = None, meter: Optional[dict] = None) -> dict:
    """``lane``'s full state for ``last.pt``: float32 weights, optimizer, schedule, scaler, its
    training state (position in the epoch, counters), the run's config, and (from
    :func:`save_run`) every rank's generators and a mid-epoch meter."""
    side = lane.precision.model_state(lane.side)
    student = {k[len("student.") :]: v for k, v in side.items() if k.startswith("student.")}
    at = lane.state
    return {
        "format": FORMAT_VERSION,
        "kd_version": __version__,
        "student": student,
        # the same tensors (stored once) where timm's load_checkpoint and most scripts look
        "state_dict": student,
        "loss": {k[len("loss.") :]: v for k, v in side.items() if k.startswith("loss.")},
        # --model-ema's average, float32, where timm's load_checkpoint(use_ema=True) looks
        **({"state_dict_ema": lane.ema.state_dict()} if lane.ema is not None else {}),
        "optimizer": lane.optimizer.state_dict(),
        "scheduler": lane.scheduler.state_dict(),
        "precision": lane.precision.state_dict(),
        "epoch": at.epoch,
        "batch_in_epoch": at.batch_in_epoch,
        "global_step": at.global_step,
        "best_top1": at.best_top1,
        "best_epoch": at.best_epoch,  # what best.pt holds: a copy of last.pt as that epoch ended
        "bad_images": len(at.bad_files),
        "bad_files": sorted(at.bad_files),
        # an epoch trained whose validation a stop cut short
        "pending_epoch": {"train": at.pending_epoch[0], "seconds": at.pending_epoch[1]} if at.pending_epoch else None,
        "meter": meter,
        "epoch_lrs": list(lane.epoch_lrs) if at.batch_in_epoch else [],
        "rng": rng or {},
        "student_name": lane.cfg.student,
        "num_classes": lane.num_classes,
        "classes": list(lane.data.classes),
        "config": lane.cfg.to_dict(),
    }


def write_failure(exc: OSError, folder: Path) -> str:
    """What stopped a write to ``folder``, in words (a full disk with the space it has)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            return f"{write_reason(exc)} ({shutil.disk_usage(folder).free / 2**20:.1f} MiB free)"
        except OSError:
            pass
    return write_reason(exc)


def nonfinite_keys(state: Dict[str, torch.Tensor]) -> list:
    """The names of the floating tensors of ``state`` that hold inf or NaN (one host read)."""
    names = [k for k, v in state.items() if v.is_floating_point()]
    if not names:
        return []
    bad = torch.stack([~torch.isfinite(state[k]).all() for k in names]).tolist()
    return [k for k, b in zip(names, bad) if b]


def save_run(lane, best: bool, step_copy: bool = False) -> None:
    """Checkpoint on the main process: last.pt (and best.pt, or a step_N.pt copy), atomically.

    A state reached through a non-finite loss is not saved, so the last good one stays.
    A failed write (disk full) keeps the previous file and stops the run with a clear error.
    """
    lane.backend.sync_buffers(lane.side)
    # every process's generators (each draws its own dropout masks), restored rank by rank, and the
    # unreadable files each met since the last check
    gathered = lane.backend.all_gather_object((rng_state(), sorted(lane.new_bad_files)))
    rng = {str(rank): state for rank, (state, _) in enumerate(gathered)}
    lane.gather_bad_files([paths for _, paths in gathered])
    # a mid-epoch checkpoint holds the epoch's sums over every process; rank 0 alone restores them
    meter = lane.meter.global_state(lane.backend) if lane.state.batch_in_epoch else None
    if lane.backend.is_main and lane.meter.streak.item() > 0:
        lane.logger.info("not checkpointing: the last step was skipped (not finite); the previous checkpoint stays")
    elif lane.backend.is_main:
        run = RunFolder(lane.out)
        folder, path = run.checkpoints, run.last
        state = run_state(lane, rng, meter)
        broken = nonfinite_keys(state["student"]) + nonfinite_keys(state["loss"])
        broken += [f"state_dict_ema.{k}" for k in nonfinite_keys(state.get("state_dict_ema", {}))]
        if broken:  # never a checkpoint that cannot evaluate (the step's policy should make this impossible)
            lane.logger.info(f"not checkpointing: {', '.join(broken[:3])} not finite; the previous checkpoint stays")
            lane.backend.barrier()
            return
        try:
            with lane.stop.critical():  # a forced stop (a second Ctrl-C) waits for the files
                save_atomic(state, path)
                if best:
                    copy_atomic(path, run.best)
                if step_copy:  # the oldest go first, so a kill at any moment leaves at most --keep-last copies
                    kept = sorted(folder.glob("step_*.pt"))
                    for old in kept[: max(0, len(kept) - (lane.cfg.keep_last - 1))]:
                        remove(old)
                    copy_atomic(path, folder / f"step_{lane.state.global_step:08d}.pt")
        except OSError as exc:  # (save_atomic turns torch.save's short write on a full disk into one)
            todo = write_fix(exc)
            intact = (
                f"the previous checkpoint is intact: {todo}, then continue with --resume"
                if path.is_file()
                else f"no checkpoint was written yet: {todo}, then start again"
            )
            raise KDError(f"could not write a checkpoint to {folder}: {write_failure(exc, folder)}; {intact}") from None
    lane.backend.barrier()


# ----------------------------------------------------------------- best.pt against last.pt
def stale_best(run: RunFolder) -> Optional[str]:
    """Why ``run``'s best.pt is not the checkpoint of the best epoch last.pt records (a kill between
    last.pt's write and best.pt's copy leaves it older), or None where it is (or nothing says)."""
    if not run.last.is_file():
        return None
    best_epoch = read(run.last, "cannot load checkpoint", mmap=True).get("best_epoch")
    if best_epoch is None:  # an earlier kd's checkpoint: nothing to compare
        return None
    if not run.best.is_file():
        return f"missing: last.pt records epoch {best_epoch} as the best"
    held = read(run.best, "cannot load checkpoint", mmap=True).get("epoch")
    if held != best_epoch:
        return f"holds epoch {held}, but the best epoch is {best_epoch} (last.pt)"
    return None


def repair_best(run: RunFolder) -> Optional[str]:
    """Copy last.pt to best.pt where best.pt is stale and last.pt is the best epoch's checkpoint (a
    kill between the two writes); the line that says so, or None where nothing was done."""
    why = stale_best(run)
    if why is None:
        return None
    verify(run.last)
    state = read(run.last, "cannot load checkpoint", mmap=True)
    if state.get("epoch") != state.get("best_epoch") or state.get("batch_in_epoch") or state.get("pending_epoch"):
        return None  # last.pt has moved on: verify names the stale best.pt; nothing here can rebuild it
    copy_atomic(run.last, run.best)
    return f"kd: {run.best} {why}: copied again from last.pt"
