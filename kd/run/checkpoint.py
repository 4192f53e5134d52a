"""A run's checkpoints: a lane's full state (float32 weights, optimizer, schedule, scaler, position,
counters, every rank's generators), written by the main process, read back on resume.

A checkpoint is the dict of the lane's stateful parts (:attr:`kd.run.lane.Lane.stateful`, each
saved under its key by its ``state_dict``, as Lightning Fabric saves its state), its
:class:`kd.run.state.TrainState`'s fields at the top level, and a header that says what the run is
(``student_name``, ``num_classes``, ``classes``, ``config``), which ``kd eval``, ``kd export`` and a
teacher's loading read without the parts.

The files are written and read by :mod:`kd.utils.checkpoint_io`: atomically, each with its SHA-256
beside it, checked before it is read, loaded with ``weights_only=True``.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from kd.errors import KDError, write_fix, write_reason
from kd.runfolder import RunFolder
from kd.utils.checkpoint_io import copy_atomic, read, remove, save_atomic, verify
from kd.version import __version__

FORMAT_VERSION = 1
#: a second name of a part's state, the same tensors stored once: where timm's load_checkpoint and most scripts look
ALIASES = {"state_dict": "student"}
#: the parts a checkpoint must hold, in words (an older kd's may lack the others: they keep their fresh state)
REQUIRED = {
    "student": "student's weights (student)",
    "optimizer": "optimizer's state (optimizer)",
    "scheduler": "schedule (scheduler)",
    "state_dict_ema": "moving average (state_dict_ema) for --model-ema",
}

#: checkpoints read in this process, by path and identity: each file is read once (a resume's
#: config, its finished epochs, its best.pt's repair and its restore read the same state)
_read: Dict[Tuple[str, int, int, int], Any] = {}


def read_once(path: Path) -> Any:
    """What the file ``path`` holds (unchecked: :func:`load` checks), its tensors memory-mapped, read
    from the disk only where used; read once in this process while the file stays as it is."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _read:
        _read[key] = read(path, "cannot load checkpoint", mmap=True)
    return _read[key]


def forget() -> None:
    """Let go of the checkpoints read (their memory maps keep the files' replaced versions on the disk)."""
    _read.clear()


def load(path: Path) -> Dict[str, Any]:
    """A kd checkpoint, checked against its SHA-256, refusing anything that needs arbitrary code to
    unpickle (:func:`read_once`)."""
    path = Path(path)
    if not path.is_file():
        raise KDError(f"nothing to resume: {path} does not exist")
    verify(path)
    obj = read_once(path)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_VERSION or "student" not in obj:
        raise KDError(f"{path} is not a kd checkpoint")
    return obj


def finished_epochs(path: Path, epochs: int) -> Optional[int]:
    """The epochs the run of checkpoint ``path`` trained where that is ``epochs`` or more (nothing left
    to resume), else None."""
    state = load(path)
    done = int(state.get("epoch", 0))
    return done if done >= epochs and not state.get("pending_epoch") else None


# ----------------------------------------------------------------- a lane's state
def in_memory(value: Any) -> Any:
    """``value`` with each tensor copied out of its memory map (a part may keep what it loads)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: in_memory(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(in_memory(v) for v in value)
    return value


def restore_run(lane, state: dict) -> None:
    """Put ``state`` (a :func:`run_state`) back into ``lane``: its training state and each of its
    stateful parts, in the order it declares them."""
    lane.state.load_state_dict(state)
    for key, part in lane.stateful.items():
        if state.get(key) is not None:
            part.load_state_dict(in_memory(state[key]))
        elif key in REQUIRED:
            raise KDError(f"the checkpoint holds no {REQUIRED[key]}")
        elif key == "loss" and part.state_dict():  # trained modules of the method's own: never fresh ones
            raise KDError(f"the checkpoint holds no state of --kd-loss {lane.cfg.kd_loss}'s own modules (loss)")


def every_process(lane) -> Dict[str, Any]:
    """The state of ``lane``'s parts marked ``collective`` (every process's generators, an epoch's
    sums): a collective every process calls, for :func:`run_state` on the main process."""
    return {k: part.state_dict() for k, part in lane.stateful.items() if getattr(part, "collective", False)}


def run_state(lane, gathered: Optional[Dict[str, Any]] = None) -> dict:
    """``lane``'s full state for ``last.pt``: the header, its training state, and each stateful
    part's ``state_dict`` under its key (those that span processes from ``gathered``,
    :func:`every_process`'s)."""
    gathered = gathered or {}
    state: Dict[str, Any] = {"format": FORMAT_VERSION, "kd_version": __version__}
    for key, part in lane.stateful.items():
        state[key] = gathered[key] if key in gathered else part.state_dict()
    state.update({alias: state[key] for alias, key in ALIASES.items()})
    state.update(lane.state.state_dict())
    state.update(
        student_name=lane.cfg.student,
        num_classes=lane.num_classes,
        classes=list(lane.data.classes),
        config=lane.saved_config.to_dict(),
    )
    return state


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
    # the unreadable files each process met since the last check
    lane.gather_bad_files(lane.backend.all_gather_object(sorted(lane.new_bad_files)))
    gathered = every_process(lane)
    if lane.backend.is_main and lane.meter.streak.item() > 0:
        lane.logger.info("not checkpointing: the last step was skipped (not finite); the previous checkpoint stays")
    elif lane.backend.is_main:
        run = RunFolder(lane.out)
        folder, path = run.checkpoints, run.last
        state = run_state(lane, gathered)
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
    best_epoch = read_once(run.last).get("best_epoch")
    if best_epoch is None:  # an earlier kd's checkpoint: nothing to compare
        return None
    if not run.best.is_file():
        return f"missing: last.pt records epoch {best_epoch} as the best"
    held = read_once(run.best).get("epoch")
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
    state = read_once(run.last)
    if state.get("epoch") != state.get("best_epoch") or state.get("batch_in_epoch") or state.get("pending_epoch"):
        return None  # last.pt has moved on: verify names the stale best.pt; nothing here can rebuild it
    copy_atomic(run.last, run.best)
    return f"kd: {run.best} {why}: copied again from last.pt"
