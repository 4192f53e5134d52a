"""The PIL loader, and what every loader shares: batches of normalised float images and labels
on the device (:class:`Batch`, :class:`DeviceLoader`), and the DataLoader settings.

The DataLoader settings that keep ``num_workers > 0`` safe live here: a module-level,
picklable dataset and collate function, a deliberate start method, persistent workers,
pinned memory with non-blocking copies, and worker seeds that differ across workers,
ranks and epochs. The teacher never runs in a worker.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Protocol, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader

from kd.data.augment import TrainAugment
from kd.data.augment import describe as augment_note
from kd.data.augment_options import wanted
from kd.data.folder import ImageFolderPIL, collate
from kd.data.sampler import SeededSampler
from kd.process_deaths import quiet_resource_sharer

MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def normalisation(cfg) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """The loaders' mean and std on the 0-255 scale: the student's data config (the first student's
    where several share the loaders; the others and the teacher renormalise on the device)."""
    data = getattr(cfg, "student_data", None) or {}
    if "mean" not in data:
        return MEAN, STD
    return tuple(m * 255 for m in data["mean"]), tuple(s * 255 for s in data["std"])


def val_transform(cfg) -> Tuple[int, str]:
    """The validation's short-side resize and its interpolation: ``--val-resize`` and
    ``val_interpolation`` where given, else the student's data config's at ``--image-size``."""
    from kd.data.data_config import DataConfig

    data = getattr(cfg, "student_data", None)
    dc = DataConfig.from_dict(data) if data else DataConfig()
    return cfg.val_resize or dc.val_resize(cfg.image_size), getattr(cfg, "val_interpolation", None) or dc.interpolation


def default_mp_context() -> str:
    """forkserver on Linux, spawn elsewhere.

    Not fork: a forked worker inherits the parent's CUDA state, threads and loader iterators,
    the source of 'Cannot re-initialize CUDA in forked subprocess' and 'can only test a child
    process'. forkserver starts workers from a clean server process (Python 3.14's default on
    Linux); it needs picklable datasets, which ours are by construction.
    """
    methods = multiprocessing.get_all_start_methods()
    return "forkserver" if sys.platform.startswith("linux") and "forkserver" in methods else "spawn"


def mp_context(name: str):
    """The multiprocessing context for DataLoader workers.

    forkserver's server imports torch and kd's datasets once (it never touches CUDA), so each
    worker is a cheap fork of it: without the preload every worker imports torch itself;
    with 15 workers on a 16-core H200 machine the first batch came after 47 s without it,
    7.5 s with it (1.1 s with fork).
    """
    ctx = multiprocessing.get_context(name)
    if name == "forkserver":
        # kd.process_deaths first: the server and the workers it forks die with this process (a kill -9)
        preload = ["kd.process_deaths", "torch", "kd.data.loader", "kd.data.folder", "kd.data.bytes_dataset"]
        ctx.set_forkserver_preload(preload)
        from multiprocessing import forkserver

        from kd.process_deaths import forkserver_guarded
        from kd.utils.signals import ignoring_sigint

        # ignoring SIGINT: a Ctrl-C while it imports torch stops the run, not it with a traceback
        with ignoring_sigint(), forkserver_guarded():
            forkserver.ensure_running()
    return ctx


#: The most DataLoader workers a process starts by default. Each keeps two batches in flight in
#: shared memory and its own copy of the dataset's listing; past a GPU's share of a machine's
#: cores more workers only compete with the training threads.
MAX_DEFAULT_WORKERS = 32


def local_processes(num_replicas: int) -> int:
    """The processes of this run that share this host's cores: a launcher's ``LOCAL_WORLD_SIZE``,
    else ``num_replicas``; 1 under Slurm with ``--cpus-per-task``, whose tasks have cores of their own."""
    if os.environ.get("SLURM_CPUS_PER_TASK"):
        return 1
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", num_replicas)))
    except ValueError:
        return max(1, num_replicas)


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> Optional[int]:
    """A container's CPU quota in cores (cgroup v2 ``cpu.max``, or v1's CFS quota), rounded up;
    None where there is none. A quota does not show in the process's CPU affinity."""
    try:
        quota, period = Path(root, "cpu.max").read_text().split()[:2]
        if quota != "max":
            return max(1, math.ceil(int(quota) / int(period)))
        return None
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(Path(root, "cpu", "cpu.cfs_quota_us").read_text())
        period_us = int(Path(root, "cpu", "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return max(1, math.ceil(quota_us / period_us)) if quota_us > 0 and period_us > 0 else None


def available_cores() -> int:
    """The CPU cores this process may use: its affinity, bounded by a container's CPU quota and by
    Slurm's ``SLURM_CPUS_PER_TASK``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    for limit in (cgroup_cpu_limit(), os.environ.get("SLURM_CPUS_PER_TASK")):
        try:
            cores = min(cores, int(limit)) if limit else cores
        except ValueError:
            pass
    return max(1, cores)


def default_workers(processes: int) -> int:
    """The CPU cores each of this host's ``processes`` processes has (:func:`available_cores`), less
    the one its training thread needs (at least 1, at most MAX_DEFAULT_WORKERS). One process per
    GPU, so on the GPU machines kd is measured on (16 cores, one H200) this is the fastest measured
    setting, 15; ``dp``'s one process feeds all its GPUs and gets all the cores."""
    return max(1, min(MAX_DEFAULT_WORKERS, available_cores() // max(processes, 1) - 1))


#: How much nicer than the training process its loader workers run (``KD_WORKER_NICE`` overrides):
#: when the workers keep every core busy, the threads that feed the GPU still get one at once.
WORKER_NICE = 10


def worker_count(cfg, num_replicas: int) -> int:
    """The DataLoader workers of this process, one of ``num_replicas``: ``--workers``, or the
    default for this host's share of them (:func:`default_workers`)."""
    return default_workers(local_processes(num_replicas)) if cfg.workers is None else cfg.workers


def seed_worker(worker_id: int) -> None:
    """Run nicer than the training process (WORKER_NICE); seed Python's and NumPy's RNGs from
    torch's per-worker seed (for third-party transforms); say nothing when the process this worker
    serves is killed while taking a batch (:func:`kd.process_deaths.quiet_resource_sharer`)."""
    quiet_resource_sharer()
    try:
        nice = int(os.environ.get("KD_WORKER_NICE", WORKER_NICE))
    except ValueError:  # not a number: the default
        nice = WORKER_NICE
    if nice > 0 and hasattr(os, "nice"):
        os.nice(nice)
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without holding up the host: a copy to CUDA from pageable memory may wait
    for the stream's earlier work (the prep stream waits on the decode), so it goes through pinned
    memory first, which the caching host allocator keeps until the copy is done."""
    if device.type != "cuda":
        return t.to(device)
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)


@dataclass
class Batch:
    images: torch.Tensor
    labels: torch.Tensor
    bad: List[str] = field(default_factory=list)
    #: the samples' indices in the dataset (int64, on the CPU), in the batch's order (synthetic
    #: tensors too: :class:`SyntheticLoader`); None for batches made otherwise (tests, benchmarks)
    indices: Optional[torch.Tensor] = None
    #: images of the split that no batch holds (left out of a prepared copy as unreadable), named
    #: with the first batch of a whole pass: a validation counts them as errors (:func:`left_out`)
    left_out: List[str] = field(default_factory=list)
    #: each sample's second, strongly augmented view (:mod:`kd.data.views`), normalised as ``images``,
    #: where a method of the run learns from two views; None otherwise
    second_images: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])


class Normalisation:
    """One normalisation (mean and std on the 0-255 scale) on a device, in each form a loader uses it:
    ``(x - mean) / std`` (:meth:`__call__`), its fused form ``x * scale + bias`` (:attr:`scale`,
    :attr:`bias`, the one-kernel crop's and :meth:`fused`), and the way back to uint8 pixels
    (:meth:`pixels`). Each loader keeps the form it used, so their results are as before."""

    def __init__(self, norm: Tuple[Tuple[float, ...], Tuple[float, ...]], device: torch.device):
        self.norm = norm
        self.mean = torch.tensor(norm[0], device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(norm[1], device=device).view(1, 3, 1, 1)
        std = torch.tensor(norm[1]).view(1, 3, 1, 1)
        self.scale = (1.0 / std).to(device)
        self.bias = (-torch.tensor(norm[0]).view(1, 3, 1, 1) / std).to(device)

    def __call__(self, pixels: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
        """Pixels (any dtype, 0-255) normalised as float32 in ``memory_format``."""
        return pixels.float().sub_(self.mean).div_(self.std).contiguous(memory_format=memory_format)

    def fused(self, x: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
        """``x`` (float, 0-255) normalised in one kernel: ``x * scale + bias``."""
        out = torch.empty(x.shape, device=x.device, memory_format=memory_format)
        return torch.addcmul(self.bias, x, self.scale, out=out)

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """Normalised images back to the uint8 pixels the PIL path makes (exact for them)."""
        return (images.float() * self.std + self.mean).round_().clamp_(0, 255).to(torch.uint8)


class Loader(Protocol):
    """What every loader is (:class:`DeviceLoader`, :class:`kd.data.gpu.GpuLoader`, :class:`SyntheticLoader`):
    an epoch of :class:`Batch` objects on the device, ``len`` of them, after ``set_epoch``."""

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Order the next epoch as ``epoch``'s, without its first ``skip_batches`` batches (a resume)."""

    def __len__(self) -> int:
        """Batches the next epoch yields."""

    def __iter__(self) -> Iterator[Batch]:
        """One epoch."""

    def describe(self) -> str:
        """One line for the log: where decoding and normalisation happen."""

    def close(self) -> None:
        """Stop the loader's worker processes and threads."""


#: What the PIL loader's log line adds on a GPU, where the CPU's decoding bounds the run.
GPU_LOADER_HINT = (
    "on a GPU, --loader gpu decodes the JPEGs there and is usually faster "
    "(one H200, 16 cores: about 2,500 images/s against 6,300-7,900; docs/input-pipeline.md)"
)


class DeviceLoader:
    """A DataLoader plus the move to the device and normalisation there (uint8 crosses the bus)."""

    #: why ``--loader auto`` chose this loader, shown by describe() ("" when the user named it)
    why: str = ""
    #: what it reads where that is not the folder's files: a prepared copy (kd.data.prepared)
    source: str = ""
    #: the log line's note on the training augmentations (kd.data.augment.describe)
    augments: str = ""

    def __init__(
        self,
        loader: DataLoader,
        sampler: SeededSampler,
        device: torch.device,
        channels_last: bool,
        limit: Optional[int] = None,
        norm: Tuple[Tuple[float, ...], Tuple[float, ...]] = (MEAN, STD),
    ):
        """``norm``: the mean and std (0-255) images are normalised with, on the device."""
        self.loader = loader
        self.sampler = sampler
        self.device = device
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.limit = limit
        self.norm = norm
        self.normalise = Normalisation(norm, device)
        self.skipped_batches = 0
        #: unreadable files that are not among its samples (the val images a prepared copy left out),
        #: reported with the first batch of every pass (:func:`left_out`)
        self.left_out: List[str] = []

    @property
    def batch_size(self) -> int:
        """The DataLoader's batch size (kd's DataLoaders always batch)."""
        bs = self.loader.batch_size
        assert bs is not None, "DeviceLoader needs a DataLoader with a batch_size"
        return bs

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.skipped_batches = skip_batches
        self.sampler.set_epoch(epoch, skip_batches * self.batch_size)

    def __len__(self) -> int:
        bs = self.batch_size
        total = self.sampler.total()
        n = total // bs if self.loader.drop_last and total >= bs else (total + bs - 1) // bs
        n = n if self.limit is None else min(n, self.limit)
        return max(n - self.skipped_batches, 0)

    def describe(self) -> str:
        where = f"normalised on {self.device}"
        if self.augments:  # random erasing needs the normalised crop: the workers normalise
            where = ("normalised there" if "--reprob" in self.augments else where) + f"; {self.augments}"
        text = f"{self.heading('pil')}: PIL decode and crop in {self.loader.num_workers} DataLoader worker(s), {where}"
        if self.device.type == "cuda" and not self.why:  # auto said why already
            text += f"; {GPU_LOADER_HINT}"
        return text

    def heading(self, name: str) -> str:
        """``loader NAME (why)``: the start of describe()."""
        return (
            f"loader {name}" + (f" ({self.why})" if self.why else "") + (f" from {self.source}" if self.source else "")
        )

    def to_device(self, images: torch.Tensor) -> torch.Tensor:
        """A batch's images on the device, normalised there unless the workers did (random erasing)."""
        images = images.to(self.device, non_blocking=True)
        if images.dtype != torch.uint8:
            return images.contiguous(memory_format=self.memory_format)
        return self.normalise(images, self.memory_format)

    def close(self) -> None:
        """Stop the persistent worker processes now rather than at interpreter exit."""
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self.loader._iterator = None

    def __iter__(self) -> Iterator[Batch]:
        remaining = len(self)
        if remaining == 0:
            return
        first = self.left_out if self.limit is None else []  # a limited pass covers its batches alone
        for images, labels, bad, indices in self.loader:
            second = None
            if images.dim() == 5:  # two views of each sample (ImageFolderPIL's views 2)
                images, second = images[:, 0], images[:, 1]
                second = self.to_device(second)
            images = self.to_device(images)
            labels = labels.to(self.device, non_blocking=True)
            yield Batch(images, labels, bad, indices, first, second_images=second)
            first = []
            remaining -= 1
            if remaining == 0:
                break


class SyntheticLoader:
    """Random images and labels made on the device: benchmarks of the step without input cost."""

    def __init__(
        self,
        batch_size: int,
        size: int,
        num_classes: int,
        steps: int,
        device: torch.device,
        channels_last: bool,
        seed: int,
        rank: int = 0,
        replicas: int = 1,
        views: int = 1,
    ):
        """Sample ``i`` of the epoch is image ``i % batch_size`` of the one batch of process
        ``(i // batch_size) % replicas``: each step's batch names its samples (``Batch.indices``), as
        a folder's do, so a soft-label store can be written and read on synthetic tensors too.
        ``views`` 2: a second random image of each sample stands for its strong view."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        self.images = torch.randn(batch_size, 3, size, size, generator=g).to(device).contiguous(memory_format=fmt)
        self.labels = torch.randint(0, num_classes, (batch_size,), generator=g).to(device)
        self.second_images: Optional[torch.Tensor] = None
        if views == 2:
            second = torch.randn(batch_size, 3, size, size, generator=g)
            self.second_images = second.to(device).contiguous(memory_format=fmt)
        self.steps = steps
        self.rank, self.replicas = rank, replicas
        self.skipped_batches = 0

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.skipped_batches = skip_batches

    def __len__(self) -> int:
        return max(self.steps - self.skipped_batches, 0)

    def describe(self) -> str:
        return f"loader synthetic: random images made on {self.images.device}"

    def close(self) -> None:
        pass

    def __iter__(self) -> Iterator[Batch]:
        size = len(self.labels)
        for step in range(self.skipped_batches, self.steps):
            first = (step * self.replicas + self.rank) * size
            indices = torch.arange(first, first + size)
            yield Batch(self.images, self.labels, indices=indices, second_images=self.second_images)


@dataclass(frozen=True)
class Shard:
    """This process's share of a split and where its batches go: process ``rank`` of ``num_replicas``,
    ``local_batch`` samples a step, on ``device`` (channels-last where ``channels_last``)."""

    num_replicas: int
    rank: int
    local_batch: int
    device: torch.device
    channels_last: bool = False


def make_pil_loader(
    cfg, samples, train: bool, shard: Shard, every_sample: bool = False, views: int = 1
) -> DeviceLoader:
    """A PIL loader over ``samples`` for ``shard``: shuffled and padded for training, sharded exactly for val;
    ``every_sample``: a training loader keeps its last short batch (kd teach's store); ``views`` 2:
    training batches carry each sample's strong view too (:attr:`Batch.second_images`)."""
    resize, interpolation = val_transform(cfg)
    augment = TrainAugment(cfg.image_size, cfg, normalisation(cfg)) if train and wanted(cfg) else None
    dataset = ImageFolderPIL(
        samples,
        cfg.image_size,
        train,
        resize,
        cfg.min_crop_scale,
        interpolation,
        views,
        augment,
        cfg.train_interpolation,
    )
    loader, sampler = dataloader_and_sampler(cfg, dataset, collate, train, shard, every_sample)
    limit = cfg.limit_train_batches if train else cfg.limit_val_batches
    out = DeviceLoader(loader, sampler, shard.device, shard.channels_last, limit, normalisation(cfg))
    out.augments = augment_note(cfg) if train else ""
    out.left_out = left_out(samples, train, shard.rank)
    return out


def left_out(samples, train: bool, rank: int) -> List[str]:
    """The val images a prepared copy left out as unreadable, for the first process's val loader
    to report (a validation counts each as an error once, as on the folder); none otherwise."""
    from kd.data.prepared import Prepared

    return samples.left_out() if isinstance(samples, Prepared) and not train and rank == 0 else []


def dataloader_and_sampler(cfg, dataset, collate_fn, train: bool, shard: Shard, every_sample: bool = False):
    """The DataLoader and SeededSampler of ``shard`` over ``dataset``, with the worker settings of the module
    docstring; training drops a last short batch unless ``every_sample``, and repeats each sample
    ``--repeated-aug`` times an epoch where that is on."""
    repeats = cfg.repeated_aug if train and not every_sample else 0
    num_replicas, rank, local_batch = shard.num_replicas, shard.rank, shard.local_batch
    sampler = SeededSampler(len(dataset), num_replicas, rank, shuffle=train, seed=cfg.seed, pad=train, repeats=repeats)
    workers = worker_count(cfg, num_replicas)
    # its own generator, with workers or without: iterating never draws from the training's (dropout) generators
    kwargs: Dict[str, Any] = dict(generator=torch.Generator().manual_seed(cfg.seed * 1000 + rank * 2 + int(train)))
    if workers > 0:
        # prefetch 2 per worker: in-flight batches live in /dev/shm, which containers often keep small
        kwargs.update(
            multiprocessing_context=mp_context(cfg.mp_context or default_mp_context()),
            persistent_workers=True,
            prefetch_factor=2,
            worker_init_fn=seed_worker,
        )
    # training drops a last short batch; kd teach keeps it (its store needs every sample, whatever
    # batch size and processes the students train with)
    drop_last = train and not every_sample and len(sampler) >= local_batch
    loader = DataLoader(
        dataset,
        batch_size=local_batch,
        sampler=sampler,
        num_workers=workers,
        collate_fn=collate_fn,
        pin_memory=shard.device.type == "cuda",
        drop_last=drop_last,
        **kwargs,
    )
    return loader, sampler
