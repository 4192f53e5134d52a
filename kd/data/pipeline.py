"""The input pipeline of one process: train and val loaders for ``--data`` and ``--loader``.

``pil`` is :mod:`kd.data.loader`, ``gpu`` is :mod:`kd.data.gpu` (which builds on the PIL
loader's pieces); ``--data synthetic`` makes random batches on the device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Tuple

import torch

from kd.data.cache import CachedVal, default_budget_gb
from kd.data.folder import scan
from kd.data.gpu import make_gpu_loader
from kd.data.loader import Loader, SyntheticLoader, make_loader, val_transform
from kd.errors import KDError
from kd.registry import suggest

#: ``--loader`` names and the function that makes each one's loader.
LOADERS = {"pil": make_loader, "gpu": make_gpu_loader}
SYNTHETIC_CLASSES = 1000
SYNTHETIC_STEPS = 100


@dataclass
class Data:
    train: Loader
    val: Loader
    classes: List[str]
    num_train: int
    num_val: int
    val_samples: List[Tuple[str, int]] = field(default_factory=list)  # for a teacher's own val loader

    def close(self) -> None:
        for loader in (self.train, self.val):
            loader.close()


def build(cfg, num_replicas: int, rank: int, local_batch: int, device: torch.device, channels_last: bool) -> Data:
    """Train and val loaders for this process: its shard of the data, ``local_batch`` per step."""
    if cfg.data == "synthetic":
        n = cfg.num_classes or SYNTHETIC_CLASSES
        steps = cfg.limit_train_batches or SYNTHETIC_STEPS
        train: Loader = SyntheticLoader(local_batch, cfg.image_size, n, steps, device, channels_last, cfg.seed + rank)
        val: Loader = SyntheticLoader(
            local_batch, cfg.image_size, n, cfg.limit_val_batches or 2, device, channels_last, cfg.seed + 999
        )
        return Data(train, val, [str(i) for i in range(n)], steps * local_batch * num_replicas, 0)
    if cfg.loader not in LOADERS:
        raise KDError(
            f"unknown --loader {cfg.loader!r}{suggest(cfg.loader, LOADERS)}; choose from: {', '.join(LOADERS)}"
        )
    classes, train_samples, val_samples = scan(cfg.data)
    make = LOADERS[cfg.loader]
    train = make(cfg, train_samples, True, num_replicas, rank, local_batch, device, channels_last)
    val = build_val(cfg, val_samples, num_replicas, rank, local_batch, device, channels_last)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", num_replicas))  # this host's processes under a launcher
    budget = default_budget_gb(min(local, num_replicas)) if cfg.val_cache_gb is None else cfg.val_cache_gb
    if budget > 0:
        val = CachedVal(val, cfg.image_size, device, channels_last, budget * 2**30)
    return Data(train, val, classes, len(train_samples), len(val_samples), val_samples)


def build_val(cfg, samples, num_replicas: int, rank: int, local_batch: int, device, channels_last: bool) -> Loader:
    """The val loader for ``cfg``'s validation transform; the device path resizes bilinearly only, so
    a bicubic evaluation (most timm models) is decoded and resized by the PIL path's workers."""
    make = LOADERS[cfg.loader] if val_transform(cfg)[1] == "bilinear" else make_loader
    return make(cfg, samples, False, num_replicas, rank, local_batch, device, channels_last)
