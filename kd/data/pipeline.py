"""The input pipeline of one process: train and val loaders for ``--data`` and ``--loader``.

The loaders are registered by name in :mod:`kd.data.registry`: ``pil`` is
:mod:`kd.data.loader`, ``gpu`` is :mod:`kd.data.gpu` (which builds on the PIL loader's pieces),
and ``auto`` (the default) is the gpu loader wherever CUDA and a GPU JPEG decoder work, else pil
(:func:`choose_loader`); ``--data synthetic`` makes random batches on the device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from kd.data.augment_options import wanted
from kd.data.cache import CachedVal, default_budget_gb
from kd.data.gpu import decoder_choice, make_gpu_loader, shared_decoder
from kd.data.layout import scan
from kd.data.loader import Loader, Shard, SyntheticLoader, make_pil_loader, val_transform
from kd.data.registry import AUTO_LOADER, LOADERS, check_loader

SYNTHETIC_CLASSES = 1000
SYNTHETIC_STEPS = 100


@dataclass
class Data:
    train: Loader
    val: Loader
    classes: List[str]
    num_train: int
    num_val: int
    val_samples: Sequence[Tuple[str, int]] = field(default_factory=list)  # for a teacher's own val loader
    train_samples: Sequence[Tuple[str, int]] = field(default_factory=list)  # what a soft-label store is checked against
    #: a val loader of the same samples and shard with another config's transform (a teacher's own)
    own_val: Optional[Callable[[Any], Loader]] = None

    def close(self) -> None:
        for loader in (self.train, self.val):
            loader.close()


def build(
    cfg,
    num_replicas: int,
    rank: int,
    local_batch: int,
    device: torch.device,
    channels_last: bool,
    every_sample: bool = False,
    views: int = 1,
) -> Data:
    """Train and val loaders for this process: its shard of the data, ``local_batch`` per step;
    ``every_sample``: the training batches hold every sample, a last short batch too (kd teach);
    ``views`` 2: the training batches hold each sample's strong view too (a method of the run learns
    from two views: :mod:`kd.data.views`)."""
    if cfg.data == "synthetic":
        n = cfg.num_classes or SYNTHETIC_CLASSES
        steps = cfg.limit_train_batches or SYNTHETIC_STEPS
        train: Loader = SyntheticLoader(
            local_batch, cfg.image_size, n, steps, device, channels_last, cfg.seed + rank, rank, num_replicas, views
        )
        val: Loader = SyntheticLoader(
            local_batch, cfg.image_size, n, cfg.limit_val_batches or 2, device, channels_last, cfg.seed + 999
        )
        listing = synthetic_listing(steps, local_batch, num_replicas, cfg.seed, n)
        return Data(train, val, [str(i) for i in range(n)], len(listing), 0, train_samples=listing)
    name, why = choose_loader(cfg.loader, device, augments=wanted(cfg))
    classes, train_samples, val_samples = scan(cfg.data)
    shard = Shard(num_replicas, rank, local_batch, device, channels_last)
    train = LOADERS.get(name)(cfg, train_samples, True, shard, every_sample, views)
    train.why = why
    describe = getattr(train_samples, "describe", None)  # a prepared copy says what it holds
    train.source = describe() if describe is not None else ""
    val = build_val(cfg, val_samples, shard)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", num_replicas))  # this host's processes under a launcher
    budget = default_budget_gb(min(local, num_replicas)) if cfg.val_cache_gb is None else cfg.val_cache_gb
    if budget > 0:
        val = CachedVal(val, cfg.image_size, device, channels_last, budget * 2**30)
    data = Data(train, val, classes, len(train_samples), len(val_samples), val_samples, train_samples)
    data.own_val = lambda other: build_val(other, val_samples, shard)
    return data


def synthetic_listing(steps: int, local_batch: int, replicas: int, seed: int, classes: int) -> List[Tuple[str, int]]:
    """The training "listing" of synthetic tensors, which a soft-label store pins as a folder's: its
    samples depend on the seed, the batch per process and the processes (:class:`SyntheticLoader`).
    Their classes (``i % classes``) stand in for the tensors' random labels where a method draws
    samples by class (CRD's negatives)."""
    where = f"synthetic-seed{seed}-{replicas}x{local_batch}"
    return [(f"{where}/{i}", i % classes) for i in range(steps * local_batch * replicas)]


def choose_loader(choice: str, device: torch.device, augments: bool = False) -> Tuple[str, str]:
    """The loader ``--loader choice`` runs on ``device``, and why auto chose it (logged with the loader).

    ``auto`` is the gpu loader where CUDA and a GPU JPEG decoder work: on one H200 with 15 workers
    it fed the KD step 77 % of the synthetic rate against the PIL loader's 31 % (docs/benchmarks.md).
    Without either it is the PIL loader, which needs nothing but the CPU; so it is where timm's
    augmentations run (``augments``: :mod:`kd.data.augment`), on the workers' PIL crops.
    """
    if check_loader(choice) != AUTO_LOADER:
        return choice, ""  # the user's choice needs no reason
    if augments:
        return "pil", "--loader auto: timm's augmentations run on the PIL crops"
    if device.type != "cuda":
        return "pil", "--loader auto: no CUDA device"
    decoder, notes = shared_decoder(device, decoder_choice())
    if decoder.in_workers:
        return "pil", f"--loader auto: no GPU JPEG decoder works here ({'; '.join(notes) or decoder.name})"
    return "gpu", f"--loader auto: CUDA and the {decoder.name} decoder work here"


def build_val(cfg, samples, shard: Shard) -> Loader:
    """The val loader for ``cfg``'s validation transform. ``--loader auto`` validates on the PIL path:
    its crops are torchvision's ``Resize`` + ``CenterCrop`` bit for bit, whatever the machine, and the
    val cache keeps them after the first pass. ``--loader gpu`` validates on the device where the
    transform is bilinear (its crops within rounding of those); a bicubic evaluation (most timm
    models) always goes through the PIL path, as the device resizes bilinearly only."""
    on_device = cfg.loader == "gpu" and val_transform(cfg)[1] == "bilinear"
    make = make_gpu_loader if on_device else make_pil_loader
    return make(cfg, samples, False, shard)
