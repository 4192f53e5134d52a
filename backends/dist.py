"""Process-group helpers shared by the multi-process backends (torch_ddp, apex_ddp).

A process learns its place from torchrun's environment variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); :mod:`kd.launch`
sets them for processes that kd or Slurm started. A process nobody launched is rank 0 of 1.

Several processes may share a GPU (``--gpus`` lists fewer GPUs than there are processes on the
node, local rank r taking entry r modulo its length): NCCL refuses two ranks on one GPU, so such
a group runs over gloo, which all-reduces CUDA tensors through host memory. Slow, but it lets a
one-GPU workstation run and debug multi-rank code.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from kd.errors import KDError

#: Seconds a collective may wait for the other processes before the run fails (default 10 min).
TIMEOUT_ENV = "KD_DIST_TIMEOUT"
#: Set by kd's launcher: the GPUs (``--gpus``, or the first ones) it made visible as ``CUDA_VISIBLE_DEVICES``.
GPUS_ENV = "KD_GPUS"
DIST_BACKENDS = ("auto", "nccl", "gloo")
BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Place:
    """Where this process sits among all of them."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launched: bool = False

    @classmethod
    def from_env(cls) -> "Place":
        env = os.environ
        if "WORLD_SIZE" not in env or "LOCAL_RANK" not in env:
            return cls()
        try:
            world = int(env["WORLD_SIZE"])
            local_rank = int(env["LOCAL_RANK"])
            return cls(int(env.get("RANK", local_rank)), world, local_rank,
                       int(env.get("LOCAL_WORLD_SIZE", world)), True)
        except ValueError:
            raise KDError("RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE must be integers "
                          f"(got {env.get('RANK')!r}, {env.get('WORLD_SIZE')!r}, {env.get('LOCAL_RANK')!r}, "
                          f"{env.get('LOCAL_WORLD_SIZE')!r})") from None


def timeout() -> timedelta:
    value = os.environ.get(TIMEOUT_ENV, "600")
    try:
        seconds = float(value)
    except ValueError:
        raise KDError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds") from None
    return timedelta(seconds=seconds)


def given_gpus(cfg) -> Optional[List[int]]:
    """The GPUs this node's processes were given, as this process sees them, or None where nobody
    said (one GPU per process by local rank): what kd's launcher made visible, else ``--gpus``."""
    launched = os.environ.get(GPUS_ENV)
    if launched and (not cfg.gpus or launched == ",".join(map(str, cfg.gpus))):
        return list(range(len(launched.split(","))))  # exactly these are visible, in order
    return list(cfg.gpus) if cfg.gpus else None


def process_device(cfg, place: Place, device_type: str) -> torch.device:
    """This process's device: the CPU, or its GPU among ``--gpus`` (or among all visible ones).

    With fewer ``--gpus`` than processes on the node, local rank r takes entry r modulo their
    number, so the processes share the GPUs. Raises KDError when they cannot be matched.
    """
    if device_type != "cuda":
        if cfg.nproc is not None and place.launched and cfg.nproc != place.local_world_size:
            raise KDError(f"the launcher started {place.local_world_size} process(es) on this node but --nproc is "
                          f"{cfg.nproc}; give one of them (drop --nproc under torchrun / srun)")
        return torch.device("cpu")
    count = torch.cuda.device_count()
    gpus = given_gpus(cfg)
    if gpus:
        if len(gpus) > place.local_world_size:
            raise KDError(f"--gpus lists {len(gpus)} GPU(s) but the launcher started {place.local_world_size} "
                          f"process(es) on this node (torchrun --nproc_per_node / srun tasks per node); "
                          f"list at most one GPU per process (fewer GPUs are shared by the processes)")
        index = gpus[place.local_rank % len(gpus)]
    elif count == 1 and place.local_world_size > 1:
        index = 0  # srun --gpus-per-task=1: every task sees just its own GPU
    else:
        if place.local_world_size > count:
            raise KDError(f"{place.local_world_size} processes on this node but only {count} visible GPU(s); "
                          f"start one process per GPU, or list the GPUs to share with --gpus")
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


def init_group(place: Place, device: torch.device, backend: str) -> None:
    """A process group over ``backend``; a one-process group needs no address or port."""
    kwargs = dict(backend=backend, timeout=timeout())
    if backend == "nccl":
        kwargs["device_id"] = device
    if not place.launched:
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    else:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise KDError(f"{name} is not set; start kd with torchrun, srun or 'kd train --nproc / --gpus'")
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if attempt and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            # a restarted group (--max-restarts) must not read the dead group's addresses from the store
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), place.world_size,
                                  is_master=False, timeout=timeout())
            kwargs.update(store=dist.PrefixStore(f"kd/attempt_{attempt}", store), rank=place.rank,
                          world_size=place.world_size)
        else:
            kwargs.update(init_method="env://", rank=place.rank, world_size=place.world_size)
    dist.init_process_group(**kwargs)


def destroy_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier(device: torch.device) -> None:
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


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
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def broadcast_state(module: nn.Module, src: int = 0) -> None:
    """Make every process's parameters and buffers equal to those of rank ``src``."""
    broadcast(list(module.parameters()) + list(module.buffers()), src)
