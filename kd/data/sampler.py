"""Samplers that hand each sample its own augmentation seed.

Training order is torch's ``DistributedSampler`` (``set_epoch`` every epoch; a single
process is rank 0 of 1), so one process and N processes see the same global batches.
Evaluation shards without padding, so no sample is counted twice.
"""

from __future__ import annotations

from typing import Iterator, Tuple

import torch
from torch.utils.data import DistributedSampler, Sampler


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one sample of one epoch, a pure function of its arguments."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & (2**64 - 1)
    return (x ^ (x >> 32)) & (2**63 - 1)


class SeededSampler(Sampler):
    """Yields ``(index, seed)``; ``set_epoch(epoch, skip)`` reorders and skips ``skip`` samples."""

    def __init__(self, size: int, num_replicas: int, rank: int, shuffle: bool, seed: int, pad: bool):
        self.size = size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.pad = pad
        self.epoch = 0
        self.skip = 0
        if pad:
            # the ignore: torch's stub asks for a Dataset, but DistributedSampler only takes len() of it
            self.inner: DistributedSampler[int] = DistributedSampler(
                range(size),  # type: ignore[arg-type]
                num_replicas=num_replicas,
                rank=rank,
                shuffle=shuffle,
                seed=seed,
                drop_last=False,
            )

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch = epoch
        self.skip = skip
        if self.pad:
            self.inner.set_epoch(epoch)

    def _indices(self):
        if self.pad:
            return list(self.inner)
        order = range(self.size)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=g).tolist()
        return list(order)[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[Tuple[int, int]]:
        for index in self._indices()[self.skip :]:
            yield index, sample_seed(self.seed, self.epoch, index)

    def total(self) -> int:
        """Samples of this rank in one whole epoch."""
        return len(self.inner) if self.pad else len(range(self.rank, self.size, self.num_replicas))

    def __len__(self) -> int:
        return max(self.total() - self.skip, 0)
