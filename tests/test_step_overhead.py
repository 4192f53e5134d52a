"""The step's host side: no host-device synchronisation per step, and its cost on the CPU (timm's
tiny test_resnet, 8 px, batch 2: the time is mostly the loop's own Python and dispatch).

A read of a device value (``.item()``, ``.tolist()``, ``bool(t)``, ``float(t)``, ``.cpu()``)
stalls the host until the GPU has caught up, which serialises launch and execution. The
engine reads its metrics only at log intervals and epoch ends; this counts such reads over
epochs of different lengths with the real loop, so a per-step read added anywhere in the
step (engine, precision, loss, optimizer glue) fails here, on the CPU, without a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import backends
from kd import config as kd_config
from kd.run.loop import Trainer
from kd.run.students import Students

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")

pytestmark = pytest.mark.skipif(
    "test_resnet" not in __import__("timm").list_models("test_*"),
    reason="needs a timm with its tiny test_resnet (1.0.x)",
)


def tiny_trainer(out: Path, steps: int, **kw) -> Trainer:
    options = dict(
        data="synthetic",
        teacher="timm:test_resnet",
        student="timm:test_resnet",
        teacher_weights="none",
        num_classes=10,
        image_size=8,
        batch_size=2,
        epochs=1,
        limit_train_batches=steps,
        device="cpu",
        log_every=1000,
        progress_bar=False,
        out=str(out),
        **kw,
    )
    cfg = kd_config.resolve(options=options)
    backend = backends.get("single")(cfg)
    backend.setup()
    return Trainer(Students.alone(cfg), backend)


@pytest.fixture
def count_reads(monkeypatch):
    counts = {name: 0 for name in READS}
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, __name=name, __original=original, **kwargs):
            counts[__name] += 1
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


@pytest.mark.parametrize("opt", ["O0", "O1", "O2"])
def test_no_device_reads_per_step(tmp_path, count_reads, opt):
    reads = []
    # at O2 with the moving average of the weights too (from the float32 masters, with its warm-up)
    ema = dict(model_ema=True, model_ema_warmup=True) if opt == "O2" else {}
    for steps in (3, 9):
        trainer = tiny_trainer(tmp_path / f"{opt}_{steps}", steps, opt=opt, **ema)
        trainer.train_epoch()  # warms up lazily built state first
        trainer.lane.state.batch_in_epoch = 0
        before = dict(count_reads)
        trainer.train_epoch()
        reads.append({k: count_reads[k] - before[k] for k in READS})
    assert reads[0] == reads[1], f"device reads grow with the number of steps: {reads}"
    assert sum(reads[0].values()) > 0  # the epoch-end reduction is seen: the counter works


def test_step_host_time(benchmark, tmp_path):
    """pytest-benchmark: one engine step of a tiny KD run on the CPU (timed, not asserted)."""
    trainer = tiny_trainer(tmp_path / "bench", 10_000)
    trainer.lane.side.train()
    loader = trainer.data.train
    loader.set_epoch(0)
    batch = next(iter(loader))
    out = benchmark(trainer.step, batch)[0]  # under pytest-xdist the benchmark is off and this runs once
    assert trainer.lane.state.global_step >= 1 and out.images == len(batch)
    assert torch.isfinite(out.parts["loss"]) and not bool(out.skipped)


@pytest.mark.parametrize("opt", ["O0", "O1"])
def test_public_step_reads_nothing_from_the_device(tmp_path, count_reads, opt):
    """Trainer.step (what benchmarks and the loop call) trains and leaves its results on the device."""
    trainer = tiny_trainer(tmp_path / opt, 10, opt=opt)
    trainer.lane.side.train()
    trainer.data.train.set_epoch(0)
    batch = next(iter(trainer.data.train))
    before_weights = [p.detach().clone() for p in trainer.lane.params]
    trainer.step(batch)  # lazily built state first
    before = dict(count_reads)
    out = trainer.step(batch)[0]
    assert {k: count_reads[k] - before[k] for k in READS} == {k: 0 for k in READS}
    assert trainer.lane.state.global_step == 2 and out.images == len(batch)
    assert set(out.parts) >= {"loss", "ce", "kd"} and all(v.dim() == 0 for v in out.parts.values())
    assert out.skipped is not None and out.skipped.dim() == 0
    assert not bool(out.flags[:-1].any())  # no source was non-finite ...
    assert bool(out.flags[-1]) == bool(out.skipped)  # ... so a skipped step was skipped on its gradients alone
    if opt == "O0":  # float32: this step trained (a bfloat16 step of this 8-pixel model may be skipped)
        assert not bool(out.skipped)
        assert any(not torch.equal(a, b) for a, b in zip(before_weights, trainer.lane.params))
