"""The linear warm-up of kd.run.optim against torchvision's LinearLR, and the epoch's logged lr."""

from __future__ import annotations

import json
import types

import pytest
import torch

from kd.run.optim import build_scheduler
from tests.conftest import kd_main, train_args


def _cfg(**over):
    base = dict(warmup_epochs=1.0, lr_schedule="constant", lr_milestones=[], lr_gamma=0.1, epochs=3, lr=0.1, min_lr=0.0)
    return types.SimpleNamespace(**{**base, **over})


def _lrs(scheduler, optimizer, steps):
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("steps_per_epoch,warm", [(5, 1.0), (4, 2.0)])
def test_warmup_is_torchvisions_linear_lr_from_its_first_step(steps_per_epoch, warm):
    """n warm-up steps train at lr/n, 2 lr/n, ..., lr: torchvision's ``LinearLR(start_factor=1/n,
    total_iters=n-1)``; the first step's lr is not (nearly) zero."""
    n = int(steps_per_epoch * warm)
    param = torch.nn.Parameter(torch.zeros(1))
    ours = torch.optim.SGD([param], lr=0.4)
    kd_lrs = _lrs(build_scheduler(_cfg(warmup_epochs=warm), ours, steps_per_epoch), ours, n + 3)
    theirs = torch.optim.SGD([param], lr=0.4)
    reference = torch.optim.lr_scheduler.LinearLR(theirs, start_factor=1 / n, total_iters=n - 1)
    tv_lrs = _lrs(reference, theirs, n + 3)
    assert kd_lrs == pytest.approx(tv_lrs)
    assert kd_lrs[0] == pytest.approx(0.4 / n)


def test_cosine_after_warmup_starts_at_the_full_lr():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    lrs = _lrs(build_scheduler(_cfg(lr_schedule="cosine", epochs=3), opt, 4), opt, 12)
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0) and lrs[5] < 1.0


@pytest.mark.slow
def test_the_epochs_logged_lr_is_the_mean_of_its_steps(image_folder, tmp_path):
    """metrics.jsonl's lr is the mean lr the epoch's steps trained at (here the warm-up's 1/3, 2/3, 1)."""
    out = tmp_path / "run"
    args = train_args(image_folder, out, no_teacher=True, epochs=2, lr=0.3, warmup_epochs=1, lr_schedule="constant")
    result = kd_main(*args, "--no-progress", "--limit-train-batches", "3", "--set", "val_cache_gb=0")
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["lr"] == pytest.approx(0.3 * (1 / 3 + 2 / 3 + 1) / 3)
    assert records[1]["lr"] == pytest.approx(0.3)
