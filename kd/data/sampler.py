"""Samplers that hand each sample its own augmentation seed.

Training order is torch's ``DistributedSampler`` (``set_epoch`` every epoch; a single
process is rank 0 of 1), so one process and N processes see the same global batches.
With repeated augmentation (``--repeated-aug N``) it is DeiT's ``RASampler`` as timm keeps it
(``RepeatAugSampler``): each sample N times in a row, each repeat with a seed of its own.
Evaluation shards without padding, so no sample is counted twice.
"""

from __future__ import annotations

import math
from typing import Iterator, List, Tuple

import torch
from torch.utils.data import DistributedSampler, Sampler

#: DeiT's repeated-augmentation epoch: the training set's size rounded down to a multiple of this
#: (sets smaller than it keep their size, as timm's RepeatAugSampler does)
SELECTED_ROUND = 256


def sample_seed(seed: int, epoch: int, index: int, repeat: int = 0) -> int:
    """A 63-bit seed for one sample of one epoch (``repeat``: its draw of --repeated-aug), a pure
    function of its arguments."""
    x = seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB
    x = (x + repeat * 0xD1B54A32D192ED03) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & (2**64 - 1)
    return (x ^ (x >> 32)) & (2**63 - 1)


def repeated_epoch(size: int, num_replicas: int) -> int:
    """Samples each process meets in an epoch of repeated augmentation: DeiT's
    ``floor(size // 256 * 256 / num_replicas)``, or ``ceil(size / num_replicas)`` for a set of
    fewer than 256 samples (timm's; DeiT's would be 0)."""
    if size >= SELECTED_ROUND:
        return size // SELECTED_ROUND * SELECTED_ROUND // num_replicas
    return math.ceil(size / num_replicas)


class SeededSampler(Sampler):
    """Yields ``(index, seed)``; ``set_epoch(epoch, skip)`` reorders and skips ``skip`` samples.

    ``repeats`` (training only): each sample ``repeats`` times in a row of the epoch's shuffled
    order, the rows dealt out over the processes as DeiT's RASampler deals them (so a sample's
    repeats meet in one global batch, on different processes), each repeat ``r`` with the seed
    ``sample_seed(seed, epoch, index, r)``.
    """

    def __init__(self, size: int, num_replicas: int, rank: int, shuffle: bool, seed: int, pad: bool, repeats: int = 0):
        if repeats and not pad:
            raise ValueError("repeated augmentation is for training (pad=True)")
        self.size = size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.pad = pad
        self.repeats = repeats
        self.epoch = 0
        self.skip = 0
        if pad and not repeats:
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
        if self.pad and not self.repeats:
            self.inner.set_epoch(epoch)

    def _order(self) -> List[int]:
        """The epoch's order of the whole set: DistributedSampler's permutation (seed + epoch)."""
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def _pairs(self) -> List[Tuple[int, int]]:
        """This rank's ``(index, repeat)`` of the epoch, in order."""
        if self.repeats:
            order, r = self._order(), self.repeats
            whole = self.size * r
            # global position p holds order[p // r], its repeat p % r; past the end the rows start again
            # (timm's padding) with repeat numbers of their own
            positions = range(self.rank, self.total() * self.num_replicas, self.num_replicas)
            return [(order[p % whole // r], p // whole * r + p % r) for p in positions]
        if self.pad:
            return [(index, 0) for index in self.inner]
        return [(index, 0) for index in self._order()[self.rank :: self.num_replicas]]

    def __iter__(self) -> Iterator[Tuple[int, int]]:
        for index, repeat in self._pairs()[self.skip :]:
            yield index, sample_seed(self.seed, self.epoch, index, repeat)

    def total(self) -> int:
        """Samples of this rank in one whole epoch."""
        if self.repeats:
            return min(
                repeated_epoch(self.size, self.num_replicas), math.ceil(self.size * self.repeats / self.num_replicas)
            )
        return len(self.inner) if self.pad else len(range(self.rank, self.size, self.num_replicas))

    def __len__(self) -> int:
        return max(self.total() - self.skip, 0)
