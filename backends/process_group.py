"""The base of the multi-process backends (torch_ddp, apex_ddp): one process per GPU, per CPU
process, or several processes sharing GPUs, joined in a torch.distributed process group.

What the subclasses share lives here: how many processes the launcher starts, each process's
device and group (``setup``/``teardown``), torch's SyncBatchNorm for ``--sync-bn``, whether the
student may leave parameters without gradient (``detect_unused``), and the collectives
(``all_reduce_sum``, ``all_gather_object``, ``sync_buffers``, ``barrier``). A subclass says how
gradients are synchronised: ``wrap`` and ``sync_gradients``, and ``describe`` what it chose.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, cast

import torch
import torch.distributed as dist
from torch import nn

from backends import dist as kd_dist
from backends.base import Backend, check_gpu_indices, resolve_device
from kd.errors import KDError
from kd.nest import tensors
from kd.utils.placement import Placement

SYNC_BN_CPU = "--sync-bn needs CUDA (torch's SyncBatchNorm runs on GPUs only); drop it on the CPU"


class ProcessGroupBackend(Backend):
    """A backend whose processes form a torch.distributed group; not registered itself."""

    multiprocess = True

    @classmethod
    def unavailable(cls) -> Optional[str]:
        return None if dist.is_available() else "this torch build has no torch.distributed"

    @classmethod
    def num_processes(cls, cfg) -> int:
        """One per ``--gpus`` entry (or per visible GPU), or ``--nproc``: on the CPU, or more processes
        than GPUs, which then share them over gloo.

        Raises KDError for a request this machine cannot meet, before any process starts.
        """
        if cfg.gpus and not torch.cuda.is_available():
            raise KDError(
                f"--gpus {','.join(map(str, cfg.gpus))}: no such GPU, this machine has no usable CUDA GPU; "
                f"on the CPU use --device cpu --nproc N"
            )
        device = resolve_device(cfg)
        if device.type == "cpu":
            if cfg.sync_bn:
                raise KDError(SYNC_BN_CPU)
            kd_dist.group_backend(cfg, "cpu", cfg.nproc or 1, None)
            return cfg.nproc or 1
        count = torch.cuda.device_count()
        check_gpu_indices(cfg.gpus or [], count)
        gpus = cfg.gpus or list(range(min(cfg.nproc or count, count)))
        nproc = cfg.nproc or len(gpus)
        if nproc < len(gpus):
            raise KDError(
                f"--nproc {nproc} is fewer than the {len(gpus)} GPUs of --gpus; give --gpus alone "
                f"(one process per GPU), or list fewer GPUs"
            )
        kd_dist.group_backend(cfg, "cuda", nproc, len(gpus))  # refuses nccl on shared GPUs
        return nproc

    def __init__(self, cfg, placement: Optional[Placement] = None):
        super().__init__(cfg, placement)
        #: ``find_unused_parameters``: given, or decided by :meth:`detect_unused` at wrap time.
        self.find_unused = cfg.find_unused_parameters
        self.find_unused_how = "given" if cfg.find_unused_parameters is not None else "not yet detected"
        self.group_backend = "none"
        self.group_note = ""

    def setup(self) -> None:
        device_type = resolve_device(self.cfg).type
        if self.cfg.sync_bn and device_type != "cuda":
            raise KDError(SYNC_BN_CPU)
        place = self.placement
        self.device = kd_dist.process_device(self.cfg, place, device_type)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        gpus = place.gpus if self.device.type == "cuda" else None
        self.group_backend, self.group_note = kd_dist.group_backend(
            self.cfg, self.device.type, place.local_world_size, len(gpus) if gpus else None
        )
        kd_dist.init_group(place, self.device, self.group_backend)
        self.rank, self.world_size, self.local_rank = place.rank, place.world_size, place.local_rank

    def teardown(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    def describe(self, details: str = "") -> str:
        """What every process-group backend reports, then ``details`` of the subclass."""
        return (
            f"backend {self.name}: {self.world_size} process(es) over {self.group()}, rank {self.rank}, "
            f"device {self.device}{', ' if details else ''}{details}"
        )

    def group(self) -> str:
        """The process group's backend, and why where it is not the usual one."""
        return f"{self.group_backend} ({self.group_note})" if self.group_note else self.group_backend

    def convert_model(self, model: nn.Module) -> nn.Module:
        """``--sync-bn``: torch's SyncBatchNorm layers, made before the optimizer holds the parameters."""
        return nn.SyncBatchNorm.convert_sync_batchnorm(model) if self.cfg.sync_bn else model

    def detect_unused(self, model: nn.Module) -> Tuple[bool, str]:
        """``(unused, how)``: on when the student has parameters a forward/backward leaves without
        gradient, or when the loss has trainable parameters (connectors whose use depends on the
        inputs); off otherwise. ``model`` is the student side, or a student alone."""
        student = getattr(model, "student", model)
        loss = getattr(model, "loss", None)
        missing = parameters_without_grad(student, self.cfg.image_size)
        if missing:
            shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
            return True, f"detected: the student leaves {len(missing)} parameter(s) without gradient: {shown}"
        if loss is not None and any(p.requires_grad for p in loss.parameters()):
            return True, "detected: the loss has trainable parameters"
        return False, "detected: every student parameter gets a gradient"

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_gather_object(self, obj) -> list:
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        sizes = torch.zeros(self.world_size, dtype=torch.long, device=tensor.device)
        sizes[self.rank] = tensor.shape[0]
        dist.all_reduce(sizes)
        most = int(sizes.max())
        padded = tensor.new_zeros((most, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded.contiguous())
        return torch.cat([part[: int(n)] for part, n in zip(parts, sizes)])

    def sync_buffers(self, module: nn.Module) -> None:
        """Rank 0's buffers on every process, broadcast rather than averaged: the checkpoint holds
        rank 0's, so evaluation scores the saved model; it is what torch DDP's forward does at each
        step (an average would change statistics torch_ddp trains with); integer counters stay exact.
        apex_ddp's processes, whose statistics follow their own shards, all start again from rank 0's."""
        if self.world_size > 1:
            kd_dist.broadcast(list(module.buffers()))

    def barrier(self) -> None:
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()


def parameters_without_grad(model: nn.Module, image_size: int) -> List[str]:
    """Names of ``model``'s trainable parameters that get no gradient from a forward/backward on
    a dummy batch; the model's state and the random number generators are left as they were."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if not params:
        return []
    first = next(iter(params.values()))
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    grads = {name: p.grad for name, p in params.items()}
    devices = [first.device.index] if first.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            for p in params.values():
                p.grad = None
            images = torch.zeros(2, 3, image_size, image_size, device=first.device, dtype=first.dtype)
            out = model(images)
            leaves = [t for t in tensors(out) if t.requires_grad]
            if leaves:
                cast(torch.Tensor, sum(t.float().sum() for t in leaves)).backward()  # leaves: not empty
            missing = [name for name, p in params.items() if p.grad is None]
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        for name, p in params.items():
            p.grad = grads[name]
    return missing
