"""One device, no wrapper."""

from __future__ import annotations

import torch

from backends.base import Backend, check_gpu_indices, resolve_device
from kd.errors import KDError


class Single(Backend):
    description = "one device (CPU or one GPU), no wrapper"

    def setup(self) -> None:
        device = resolve_device(self.cfg)
        if self.cfg.nproc not in (None, 1):
            raise KDError(f"--backend single runs one process; --nproc {self.cfg.nproc} needs torch_ddp or apex_ddp")
        if device.type == "cuda":
            gpus = self.cfg.gpus or [0]
            if len(gpus) != 1:
                raise KDError(f"--backend single uses one GPU, --gpus lists {len(gpus)}; use dp, torch_ddp or apex_ddp")
            check_gpu_indices(gpus, torch.cuda.device_count())
            device = torch.device("cuda", gpus[0])
            torch.cuda.set_device(device)
        self.device = device
