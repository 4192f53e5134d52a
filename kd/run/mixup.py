"""Mixup and cutmix on the device batch (``--mixup``, ``--cutmix``): timm's :class:`timm.data.Mixup`
in its per-batch mode, with its draws taken from numpy's generator seeded from the run's seed, the
epoch, the step in the epoch and the process's rank, so that a resumed run mixes each step as the
uninterrupted run did. The loop mixes each batch once, before the teacher's forward: the teacher
and every student see the same mixed images, and the label term gets the mixed soft targets."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from kd.data.loader import Batch


@contextlib.contextmanager
def numpy_seeded(key: Sequence[int]) -> Iterator[None]:
    """numpy's global generator seeded from ``key`` (ints from 0 to 2**32 - 1) inside, as it was outside
    (timm's Mixup draws from it)."""
    outer = np.random.get_state()
    np.random.seed([int(k) for k in key])
    try:
        yield
    finally:
        np.random.set_state(outer)


class BatchMixer:
    """Mixes a batch as timm's ``Mixup(mode="batch")`` does (each image with the batch's mirror image,
    one lambda, one box), from a draw keyed by (seed, epoch, step in epoch, rank)."""

    def __init__(self, cfg, num_classes: int, rank: int = 0):
        from timm.data.mixup import Mixup  # timm only where a run mixes

        self.mixup = Mixup(
            mixup_alpha=cfg.mixup,
            cutmix_alpha=cfg.cutmix,
            prob=cfg.mixup_prob,
            switch_prob=cfg.mixup_switch_prob,
            mode="batch",
            label_smoothing=cfg.smoothing,
            num_classes=num_classes,
        )
        self.seed, self.rank = cfg.seed, rank

    def __call__(self, batch: Batch, epoch: int, step: int) -> Batch:
        """``batch`` mixed (new tensors: the loader's batch is left as it was), its labels the mixed
        soft targets [B, C]; a second view is mixed with the same draw."""
        seed = self.seed % 2**64  # any seed torch takes (negative ones too), as two 32-bit words
        key = (seed & 0xFFFFFFFF, seed >> 32, epoch, step, self.rank)
        images = batch.images.clone()
        with numpy_seeded(key):
            # timm's __call__ less its even-batch assert: an odd batch mixes its middle image with itself
            lam = self._mix(images)
        second: Optional[torch.Tensor] = None
        if batch.second_images is not None:
            second = batch.second_images.clone()
            with numpy_seeded(key):
                self._mix(second)
        from timm.data.mixup import mixup_target

        labels = mixup_target(batch.labels, self.mixup.num_classes, lam, self.mixup.label_smoothing)
        return dataclasses.replace(batch, images=images, labels=labels, second_images=second)

    def _mix(self, images: torch.Tensor) -> float:
        return self.mixup._mix_batch(images)  # in place, as timm's Mixup.__call__ mixes in batch mode


def build(cfg, num_classes: int, rank: int) -> Optional[BatchMixer]:
    """The run's mixer, or None where neither --mixup nor --cutmix is on."""
    return BatchMixer(cfg, num_classes, rank) if cfg.mixup or cfg.cutmix else None
