"""The backend protocol: the only place that knows about processes, wrappers and reductions.

The engine never branches on the backend's name; it asks the backend object for facts and
actions:

* roles: ``rank``, ``world_size``, ``is_main`` (the only process that writes ``--out``);
* placement: ``device``; ``local_batch(global_batch)``, the per-process share of the batch;
* data: ``data_shard()`` -> ``(num_replicas, rank)`` for the samplers;
* models: ``fork()`` for each further trained model of a run (several students),
  ``convert_model(student_side)`` before the optimizer exists (layers replaced, parameter
  layout), ``wrap(student_side)`` for gradient sync, ``wrap_forward(module)`` for the teacher
  and evaluation (forward only, never for gradient sync);
* the step: ``prefers_apex_amp`` (a wish the run's precision choice honours where it can),
  ``sync_gradients(model)`` runs after backward (a no-op where the wrapper syncs during backward);
* reductions: ``all_reduce_sum(tensor)``, ``all_gather(tensor)``, ``all_gather_object(obj)``, ``sync_buffers(module)``
  before evaluation and checkpoints, and ``barrier()``.

A backend is made with the run's config and its :class:`~kd.utils.placement.Placement` (where this
process sits, as the launcher said; read from the environment when not given). The
multi-process backends derive from :class:`backends.process_group.ProcessGroupBackend`.

kd's backends are listed by name in :mod:`backends` (one line each, imported when first used);
third-party backends register with ``@register("name")`` or through the Python entry point group
``kd.backends``.
"""

from __future__ import annotations

import copy
from typing import ClassVar, Optional, Sequence, Tuple

import torch
from torch import nn

from backends import BACKENDS
from kd.errors import KDError
from kd.utils.placement import Placement

register = BACKENDS.register


def resolve_device(cfg) -> torch.device:
    """The device type a run asks for: ``--device auto`` is CUDA where available."""
    if cfg.device == "cuda" or (cfg.device == "auto" and (cfg.gpus or torch.cuda.is_available())):
        if not torch.cuda.is_available():
            raise KDError("--device cuda (or --gpus) asked for CUDA, but no CUDA GPU is usable here; use --device cpu")
        return torch.device("cuda")
    return torch.device("cpu")


def check_gpu_indices(gpus: Sequence[int], count: int) -> None:
    """KDError unless every one of ``gpus`` (``--gpus``) is one of the ``count`` visible GPUs."""
    missing = [g for g in gpus if g >= count]
    if missing:
        raise KDError(
            f"--gpus {','.join(map(str, gpus))}: GPU {missing[0]} does not exist, "
            f"this machine has {count} visible GPU(s)" + (f" (0..{count - 1})" if count else "")
        )


class Backend:
    """Base class; concrete backends override what differs. One instance per process."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: True when the backend runs one process per device, started by the launcher.
    multiprocess: ClassVar[bool] = False
    #: True when the backend would rather run real apex.amp (with ``--amp-impl auto``, where it can
    #: run); the precision itself is chosen in one place, :func:`kd.precision.make_precision`.
    prefers_apex_amp: ClassVar[bool] = False

    @classmethod
    def unavailable(cls) -> Optional[str]:
        """Why this backend cannot run on this machine, or None if it can."""
        return None

    @classmethod
    def num_processes(cls, cfg) -> int:
        """How many processes the launcher starts on this node."""
        return 1

    def __init__(self, cfg, placement: Optional[Placement] = None):
        self.cfg = cfg
        self.placement = placement if placement is not None else Placement.from_environment(cfg.gpus)
        self.rank = 0
        self.world_size = 1
        self.local_rank = 0
        self.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def setup(self) -> None:
        """Create the process group (if any) and choose this process's device."""

    def teardown(self) -> None:
        """Destroy what setup created."""

    def describe(self) -> str:
        return f"backend {self.name}: {self.world_size} process(es), device {self.device}"

    def local_batch(self, global_batch: int) -> int:
        if global_batch % self.world_size:
            raise KDError(f"--batch-size {global_batch} is not divisible by the {self.world_size} processes")
        return global_batch // self.world_size

    def data_shard(self) -> Tuple[int, int]:
        return self.world_size, self.rank

    def fork(self) -> Backend:
        """This set-up backend for one more trained model (each student of ``kd train --kd-loss a,b``):
        the same process group and device, and per-model state of its own (wrapping choices,
        gradient buckets); only the original is torn down."""
        return copy.copy(self)

    def convert_model(self, model: nn.Module) -> nn.Module:
        """Called once on the student side, on its device, before the optimizer and precision are
        built from its parameters; returns the module to build them from (layers may be replaced)."""
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def wrap_forward(self, module: nn.Module) -> nn.Module:
        """A forward-only wrapper (teacher, evaluation); never synchronises gradients."""
        return module

    def memory_devices(self):
        """The CUDA devices this process allocates on (for peak-memory reports); none on the CPU."""
        return [self.device] if self.device.type == "cuda" else []

    def sync_gradients(self, model: nn.Module) -> None:
        """Called after backward, before unscale/clip/step."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_object(self, obj) -> list:
        """``obj`` of every process, in rank order (a collective)."""
        return [obj]

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's ``tensor`` concatenated along dim 0, in rank order (a collective; the
        tensors may differ in their first dimension)."""
        return tensor

    def sync_buffers(self, module: nn.Module) -> None:
        """Give every process the same buffers (BatchNorm statistics), those the checkpoint holds;
        called on every process before evaluation and before a checkpoint is written."""

    def barrier(self) -> None:
        """Wait for every process (a no-op for one process)."""
