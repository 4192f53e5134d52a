"""The val split's crops kept in host memory after the first full pass.

Validation of a decode-bound pipeline costs what decoding costs: 5,000 ImageNet-like val images
took 0.95 s beside a 7.7 s epoch on the H200 (docs/benchmarks.md), which is 4.8 % of an
ImageNet epoch, every epoch. The val crops never change (centre crop, no randomness), so the
first full pass keeps them as uint8 in host memory and later passes only copy them back and
normalise: no worker, no decode. Every pass, the first included, sees the crops rounded to uint8
as the PIL path makes them, so all of a run's validations see the same pixels.
"""

from __future__ import annotations

import os
from typing import Iterator, List, Optional, Tuple

import torch

from kd.data.loader import MEAN, STD, Batch, Loader, Normalisation, upload

#: Where a container's memory limit is (cgroup v2, then v1).
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory_bytes() -> Optional[int]:
    """The memory this process may use: the machine's, or its container's limit where lower."""
    try:
        total: Optional[int] = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        total = None
    for path in CGROUP_LIMITS:
        try:
            with open(path) as fh:
                limit = int(fh.read().strip())
        except (OSError, ValueError):  # absent, or "max"
            continue
        total = limit if total is None else min(total, limit)
    return total


def default_budget_gb(processes_per_host: int) -> float:
    """An eighth of the memory this process may use, shared by the host's processes (0 where unknown)."""
    total = host_memory_bytes()
    return 0.0 if total is None else total / 8 / max(processes_per_host, 1) / 2**30


class CachedVal:
    """A val :class:`Loader` that replays its first full pass from host memory.

    ``budget_bytes``: the most the cache may hold; a split that would not fit is read every
    time. A pass that stops early (a probe's ``limit``, a stop signal) keeps nothing.
    """

    def __init__(self, loader: Loader, image_size: int, device: torch.device, channels_last: bool, budget_bytes: float):
        self.loader = loader
        self.device = device
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        per_batch = getattr(loader, "batch_size", 1) * 3 * image_size * image_size
        self.fits = len(loader) * per_batch <= budget_bytes
        self.batches: Optional[List[Tuple[torch.Tensor, torch.Tensor, List[str], List[str]]]] = None
        # the loader's own normalisation, undone and redone
        self.normalise = Normalisation(getattr(loader, "norm", (MEAN, STD)), device)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.loader.set_epoch(epoch, skip_batches)

    def __len__(self) -> int:
        return len(self.loader)

    def describe(self) -> str:
        return f"{self.loader.describe()}; {self.describe_cache()}"

    def describe_cache(self) -> str:
        if self.fits:
            return "crops kept in host memory after the first pass (--val-cache-gb)"
        return "crops read every pass (more than --val-cache-gb)"

    def close(self) -> None:
        self.loader.close()

    def _normalised(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.normalise(pixels, self.memory_format)

    def __iter__(self) -> Iterator[Batch]:
        if self.batches is not None:
            for pixels, labels, bad, left_out in self.batches:
                images = self._normalised(upload(pixels, self.device))
                yield Batch(images, upload(labels, self.device), list(bad), left_out=list(left_out))
            return
        kept: List[Tuple[torch.Tensor, torch.Tensor, List[str], List[str]]] = []
        inner = iter(self.loader)
        try:
            for batch in inner:
                # back to the uint8 the PIL path makes (exact for it; the GPU path's crops round),
                # kept or not, so that every pass sees the same pixels
                pixels = self.normalise.pixels(batch.images)
                if self.fits:
                    kept.append((pixels.cpu(), batch.labels.cpu(), list(batch.bad), list(batch.left_out)))
                yield Batch(self._normalised(pixels), batch.labels, batch.bad, left_out=batch.left_out)
        finally:
            close = getattr(inner, "close", None)
            if close is not None:
                close()
        if self.fits and len(kept) == len(self.loader):
            self.batches = kept
            self.loader.close()  # its workers have nothing more to read
