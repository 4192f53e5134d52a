"""Process-group helpers shared by the multi-process backends (torch_ddp, apex_ddp).

A process learns its place from a :class:`kd.utils.placement.Placement` (read from torchrun's, Slurm's
or kd's launcher's environment); a process nobody launched is rank 0 of 1.

Several processes may share a GPU (``--gpus`` lists fewer GPUs than there are processes on the
node, local rank r taking entry r modulo its length): NCCL refuses two ranks on one GPU, so such
a group runs over gloo, which all-reduces CUDA tensors through host memory. Slow, but it lets a
one-GPU workstation run and debug multi-rank code.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from kd.errors import KDError
from kd.utils.placement import Placement

DIST_BACKENDS = ("auto", "nccl", "gloo")
BUCKET_BYTES = 25 * 2**20


def process_device(cfg, place: Placement, device_type: str) -> torch.device:
    """This process's device: the CPU, or its GPU among ``--gpus`` (or among all visible ones).

    With fewer ``--gpus`` than processes on the node, local rank r takes entry r modulo their
    number, so the processes share the GPUs. Raises KDError when they cannot be matched.
    """
    if device_type != "cuda":
        if cfg.nproc is not None and place.launched and cfg.nproc != place.local_world_size:
            raise KDError(
                f"the launcher started {place.local_world_size} process(es) on this node but --nproc is "
                f"{cfg.nproc}; give one of them (drop --nproc under torchrun / srun)"
            )
        return torch.device("cpu")
    count = torch.cuda.device_count()
    gpus = place.gpus
    if gpus:
        if len(gpus) > place.local_world_size:
            raise KDError(
                f"--gpus lists {len(gpus)} GPU(s) but the launcher started {place.local_world_size} "
                f"process(es) on this node (torchrun --nproc_per_node / srun tasks per node); "
                f"list at most one GPU per process (fewer GPUs are shared by the processes)"
            )
        index = gpus[place.local_rank % len(gpus)]
    elif count == 1 and place.local_world_size > 1:
        index = 0  # srun --gpus-per-task=1: every task sees just its own GPU
    else:
        if place.local_world_size > count:
            raise KDError(
                f"{place.local_world_size} processes on this node but only {count} visible GPU(s); "
                f"start one process per GPU, or list the GPUs to share with --gpus"
            )
        index = place.local_rank
    if index >= count:
        raise KDError(f"GPU {index} does not exist: this process sees {count} GPU(s)")
    return torch.device("cuda", index)


def group_backend(cfg, device_type: str, processes: int, gpus: Optional[int]) -> Tuple[str, str]:
    """``(nccl or gloo, note)`` for ``processes`` processes of a node on ``gpus`` GPUs (None: one each).

    ``dist_backend`` auto is nccl on CUDA, gloo on the CPU and where processes share a GPU (NCCL
    refuses two ranks on one GPU); the note says when GPUs are shared. KDError for a choice that
    cannot run.
    """
    choice = cfg.dist_backend
    if choice not in DIST_BACKENDS:
        raise KDError(f"dist_backend must be {', '.join(DIST_BACKENDS[:-1])} or {DIST_BACKENDS[-1]}, got {choice!r}")
    shared = device_type == "cuda" and gpus is not None and processes > gpus
    note = f"{processes} processes share {gpus} GPU(s)" if shared else ""
    if choice == "nccl" and device_type != "cuda":
        raise KDError("dist_backend=nccl needs CUDA; on the CPU use gloo (or auto)")
    if choice == "nccl" and shared:
        raise KDError(f"dist_backend=nccl runs one process per GPU, and {note} here; use dist_backend=gloo (or auto)")
    if choice == "auto":
        choice = "nccl" if device_type == "cuda" and not shared else "gloo"
    return choice, note


def init_group(place: Placement, device: torch.device, backend: str) -> None:
    """A process group over ``backend``; a one-process group needs no address or port."""
    kwargs: Dict[str, Any] = dict(backend=backend, timeout=place.timeout)
    if backend == "nccl":
        kwargs["device_id"] = device
    if not place.launched:
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    else:
        for name, value in (("MASTER_ADDR", place.master_addr), ("MASTER_PORT", place.master_port)):
            if value is None:
                raise KDError(f"{name} is not set; start kd with torchrun, srun or 'kd train --nproc / --gpus'")
        if place.restart and place.agent_store:
            # a restarted group (--max-restarts) must not read the dead group's addresses from the store
            assert place.master_addr is not None and place.master_port is not None  # checked just above
            store = dist.TCPStore(
                place.master_addr, place.master_port, place.world_size, is_master=False, timeout=place.timeout
            )
            kwargs.update(
                store=dist.PrefixStore(f"kd/attempt_{place.restart}", store),
                rank=place.rank,
                world_size=place.world_size,
            )
        else:  # torch reads MASTER_ADDR and MASTER_PORT itself
            kwargs.update(init_method="env://", rank=place.rank, world_size=place.world_size)
    dist.init_process_group(**kwargs)


def buckets(tensors: Iterable[torch.Tensor], cap_bytes: int = BUCKET_BYTES) -> List[List[int]]:
    """Indices of ``tensors`` grouped by device and dtype, each group at most ``cap_bytes`` (or one tensor)."""
    groups: Dict[Tuple[torch.device, torch.dtype], List[List[int]]] = {}
    sizes: Dict[Tuple[torch.device, torch.dtype], int] = {}
    for i, t in enumerate(tensors):
        key = (t.device, t.dtype)
        nbytes = t.numel() * t.element_size()
        if key not in groups or sizes[key] + nbytes > cap_bytes and groups[key][-1]:
            groups.setdefault(key, []).append([])
            sizes[key] = 0
        groups[key][-1].append(i)
        sizes[key] += nbytes
    return [bucket for group in groups.values() for bucket in group if bucket]


def broadcast(tensors: List[torch.Tensor], src: int = 0) -> None:
    """Make every process's ``tensors`` equal to those of rank ``src`` (in place), bucket by bucket."""
    with torch.no_grad():
        for bucket in buckets(tensors):
            parts = [tensors[i] for i in bucket]
            flat = torch.cat([t.detach().reshape(-1) for t in parts])
            dist.broadcast(flat, src)
            offset = 0
            for t in parts:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def broadcast_state(module: nn.Module, src: int = 0) -> None:
    """Make every process's parameters and buffers equal to those of rank ``src``."""
    broadcast(list(module.parameters()) + list(module.buffers()), src)
