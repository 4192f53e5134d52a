"""Benchmark helpers: the timed steps of ``kd bench`` (a step hook) and BatchNorm statistics for a
random-init teacher."""

from __future__ import annotations

import time
from typing import Dict, Optional

import torch
from torch import nn

from kd.run.step import StepHook


@torch.no_grad()
def calibrate_batchnorm(model: nn.Module, loader, batches: int = 3) -> None:
    """Benchmarks only: BatchNorm statistics of a random-init teacher estimated on the input.

    A random-init network in eval mode (running mean 0, variance 1) lets activations grow
    layer by layer until float16 overflows, which would make an fp16 benchmark measure
    skipped steps. Estimating the statistics on a few batches keeps them in range.
    """
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the calibration batches
    model.train()
    loader.set_epoch(0)
    for _, batch in zip(range(batches), loader):
        model(batch.images)
    for m, momentum in zip(bns, momenta):
        m.momentum = momentum
    model.eval()


class StepTimer(StepHook):
    """Times the steps after ``warmup`` (for ``kd bench``), with device syncs only at its ends; its
    result goes into the epoch's record. A random-init teacher gets BatchNorm statistics first
    (:func:`calibrate_batchnorm`)."""

    def on_teacher(self, teacher: nn.Module, cfg, train_loader) -> None:
        if cfg.teacher_weights == "none":
            calibrate_batchnorm(teacher, train_loader)

    def on_step(self, trainer, out) -> None:
        self.step(trainer.global_step, out.images)

    def on_epoch_end(self, trainer, record) -> None:
        if self.images:
            record.update(self.result(self.backend))

    def __init__(self, warmup: int, backend):
        self.warmup = warmup
        self.backend = backend
        self.start: Optional[float] = None  # perf_counter() at the warmup's end
        self.images = 0
        self.steps = 0

    def _sync(self) -> None:
        if self.backend.device.type == "cuda":
            torch.cuda.synchronize(self.backend.device)

    def step(self, global_step: int, n: int) -> None:
        if not self.warmup or global_step < self.warmup:
            return
        if global_step == self.warmup:
            self._sync()
            self.backend.barrier()
            for dev in self.backend.memory_devices():
                torch.cuda.reset_peak_memory_stats(dev)
            self.start = time.perf_counter()
            return
        self.images += n
        self.steps += 1

    def result(self, backend) -> Dict[str, object]:
        self._sync()
        backend.barrier()
        assert self.start is not None, "no step timed yet (result() before the warmup ended)"
        seconds = time.perf_counter() - self.start
        images = torch.tensor(float(self.images), device=backend.device)
        backend.all_reduce_sum(images)
        mem = [0.0] * backend.world_size
        mine = [torch.cuda.max_memory_allocated(d) / 2**30 for d in backend.memory_devices()]
        slots = torch.zeros(backend.world_size, max(len(mine), 1), device=backend.device)
        if mine:
            slots[backend.rank, : len(mine)] = torch.tensor(mine)
        backend.all_reduce_sum(slots)
        mem = [round(v, 3) for row in slots.tolist() for v in row if v > 0]
        return {
            "timed_steps": self.steps,
            "timed_seconds": seconds,
            "timed_img_per_s": images.item() / max(seconds, 1e-9),
            "s_per_20_iters": 20 * seconds / max(self.steps, 1),
            "peak_mem_gb": mem,
        }
