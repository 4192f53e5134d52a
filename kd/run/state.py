"""The stateful parts of a student's run that a checkpoint saves and a resume restores
(:mod:`kd.run.checkpoint`), each with ``state_dict`` / ``load_state_dict``: where its training stands
(:class:`TrainState`), a module's float32 weights (:class:`Weights`), its random generators
(:class:`Generators`) and an epoch's sums stopped mid-way (:class:`EpochSums`).

A part marked ``collective`` spans the processes: its ``state_dict`` is a collective every process
calls; the others' are called on the main process alone, which writes the checkpoint.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple, cast

import numpy as np
import torch
from torch import nn


@dataclass
class TrainState:
    """Where a student's training stands, beyond its modules' and optimizer's state. A checkpoint
    holds its fields at its top level (where every kd wrote them)."""

    epoch: int = 0
    batch_in_epoch: int = 0
    global_step: int = 0
    best_top1: float = -1.0
    best_epoch: Optional[int] = None  # the epoch (counted from 1) best.pt holds
    bad_files: Set[str] = field(default_factory=set)  # the unreadable files met so far, on every process
    # an epoch trained whose validation a stop cut short: its training totals and seconds
    pending_epoch: Optional[Tuple[Dict[str, float], float]] = None
    epoch_lrs: List[float] = field(default_factory=list)  # the lr of each of this epoch's steps (its mean is logged)

    @property
    def position(self) -> Tuple[int, int]:
        """(epoch, batch in epoch) where training goes on: an epoch whose validation is pending counts as ended."""
        if self.pending_epoch is not None:
            return self.epoch + 1, 0
        return self.epoch, self.batch_in_epoch

    def state_dict(self) -> Dict[str, Any]:
        pending = self.pending_epoch
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "global_step": self.global_step,
            "best_top1": self.best_top1,
            "best_epoch": self.best_epoch,  # what best.pt holds: a copy of last.pt as that epoch ended
            "bad_images": len(self.bad_files),
            "bad_files": sorted(self.bad_files),
            "pending_epoch": {"train": pending[0], "seconds": pending[1]} if pending else None,
            # the lr of each step of an epoch stopped mid-way: its logged mean covers the whole epoch
            "epoch_lrs": list(self.epoch_lrs) if self.batch_in_epoch else [],
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """From a checkpoint's top level (an older kd's lacks the later keys)."""
        pending = state.get("pending_epoch")
        self.epoch = state["epoch"]
        self.batch_in_epoch = state.get("batch_in_epoch", 0)
        self.global_step = state["global_step"]
        self.best_top1 = state["best_top1"]
        self.best_epoch = state.get("best_epoch")
        self.bad_files = set(state.get("bad_files", []))
        self.pending_epoch = (pending["train"], pending["seconds"]) if pending else None
        self.epoch_lrs = list(state.get("epoch_lrs") or []) if self.batch_in_epoch else []


class Weights:
    """``module``'s weights as float32 tensors, its precision's master weights where it keeps them."""

    def __init__(self, precision, module: nn.Module):
        self.precision = precision
        self.module = module

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return self.precision.model_state(self.module)

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        self.precision.load_model_state(self.module, state)


# ----------------------------------------------------------------------------- generators
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


class Generators:
    """A student's random generators (its dropout and drop-path masks): the process's own as its
    build left them. Beside other students in one process, :meth:`own` puts them in place for
    each of its calls and keeps their state between. A checkpoint holds every process's, by rank."""

    collective = True

    def __init__(self, backend):
        self.backend = backend
        self.held = rng_state()

    def state_dict(self) -> Dict[str, Dict[str, Any]]:
        """Every process's generators by rank (a collective; called inside the student's own call)."""
        return {str(rank): state for rank, state in enumerate(self.backend.all_gather_object(rng_state()))}

    def load_state_dict(self, states: Dict[str, Dict[str, Any]]) -> None:
        """This process's entry of ``states``, where it has one, in place and held."""
        state = states.get(str(self.backend.rank))
        if state is not None:
            set_rng_state(state)
            self.held = rng_state()

    @contextlib.contextmanager
    def own(self) -> Iterator[None]:
        """These generators in place for a call, the process's own put back after."""
        outer = rng_state()
        set_rng_state(self.held)
        try:
            yield
        finally:
            self.held = rng_state()
            set_rng_state(outer)


class EpochSums:
    """The sums and counters of an epoch stopped mid-way (``meter``'s, added up over every process),
    restored on the main process alone (its reductions add the others' zeros); None at an epoch's end."""

    collective = True

    def __init__(self, meter, state: TrainState, backend):
        self.meter = meter
        self.state = state
        self.backend = backend

    def state_dict(self) -> Optional[dict]:
        return self.meter.global_state(self.backend) if self.state.batch_in_epoch else None

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state and self.backend.is_main:
            self.meter.load_state_dict(state)
