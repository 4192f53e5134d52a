"""torch.nn.DataParallel: one process, the global batch split over ``--gpus``."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from backends.base import Backend, check_gpu_indices
from kd.errors import KDError
from kd.nest import map_tensors


class _DataParallel(nn.DataParallel):
    """DataParallel whose outputs end on the backend's device, where the engine keeps its meters.

    The replicas compute the loss parts themselves, so what is gathered on ``output_device`` is
    small; moving it to the main device afterwards costs next to nothing.
    """

    def __init__(self, module: nn.Module, device_ids: List[int], output_device: int, home: torch.device):
        super().__init__(module, device_ids=device_ids, output_device=output_device)
        self.home = home

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if self.output_device == self.home.index:
            return out
        return map_tensors(lambda t: t.to(self.home, non_blocking=True), out)

    def parallel_apply(self, replicas, inputs, kwargs):
        """Each replica under the caller's autocast dtype: torch re-enters autocast in every replica's
        thread without one, and the dtype is thread-local (float16 by default), so bfloat16 would
        silently run as float16, without a loss scaler."""
        if not torch.is_autocast_enabled("cuda"):
            return super().parallel_apply(replicas, inputs, kwargs)
        dtype = torch.get_autocast_dtype("cuda")
        return super().parallel_apply([_under_autocast(r, dtype) for r in replicas], inputs, kwargs)


def _under_autocast(module: nn.Module, dtype: torch.dtype):
    """``module`` as a callable that runs it under ``torch.autocast('cuda', dtype)``, in any thread."""

    def run(*args, **kwargs):
        with torch.autocast("cuda", dtype=dtype):
            return module(*args, **kwargs)

    return run


class DataParallelBackend(Backend):
    description = "torch DataParallel over --gpus in one process (global batch split across the GPUs)"

    @classmethod
    def unavailable(cls) -> Optional[str]:
        return None if torch.cuda.is_available() else "needs CUDA GPUs, and none is usable here"

    @classmethod
    def num_processes(cls, cfg) -> int:
        """Always one; a request for more, or for the CPU, is refused before any work."""
        if cfg.nproc not in (None, 1):
            raise KDError(
                f"--backend dp runs one process that drives all --gpus; --nproc {cfg.nproc} needs "
                f"--backend torch_ddp or apex_ddp"
            )
        if cfg.amp_impl == "apex" and cfg.opt in ("O2", "O3"):
            raise KDError(
                f"--backend dp cannot run --amp-impl apex at {cfg.opt}: apex.amp patches the forward of the "
                f"module on the first GPU, and every replica would run that one (apex issue #227); "
                f"use --amp-impl native, or --backend torch_ddp or apex_ddp"
            )
        if cfg.device == "cpu":
            raise KDError("--backend dp needs CUDA GPUs; on the CPU use --backend torch_ddp --nproc N --device cpu")
        if cfg.sync_bn:
            raise KDError("--sync-bn needs a process group; use --backend torch_ddp or apex_ddp")
        return 1

    def setup(self) -> None:
        self.num_processes(self.cfg)
        if not torch.cuda.is_available():
            raise KDError("--backend dp needs CUDA GPUs, and none is usable here")
        count = torch.cuda.device_count()
        gpus = self.cfg.gpus or list(range(count))
        check_gpu_indices(gpus, count)
        out = self.cfg.dp_output_device if self.cfg.dp_output_device is not None else gpus[0]
        if out >= count:
            raise KDError(f"--dp-output-device {out} does not exist, this machine has {count} visible GPU(s)")
        self.gpus = gpus
        self.output_device = out
        self.device = torch.device("cuda", gpus[0])  # DataParallel keeps the module on the first GPU
        torch.cuda.set_device(self.device)

    def local_batch(self, global_batch: int) -> int:
        if global_batch % len(self.gpus):
            raise KDError(f"--batch-size {global_batch} is not divisible by the {len(self.gpus)} GPUs of --backend dp")
        return global_batch

    def describe(self) -> str:
        return (
            f"backend dp: 1 process, DataParallel over GPUs {','.join(map(str, self.gpus))}, "
            f"module on {self.device}, outputs gathered on cuda:{self.output_device}"
        )

    def memory_devices(self):
        """Every GPU of the DataParallel group: the output GPU's extra memory shows in kd bench."""
        return [torch.device("cuda", g) for g in self.gpus]

    def wrap(self, model: nn.Module) -> nn.Module:
        return _DataParallel(model, self.gpus, self.output_device, self.device)

    def wrap_forward(self, module: nn.Module) -> nn.Module:
        return _DataParallel(module, self.gpus, self.output_device, self.device)
