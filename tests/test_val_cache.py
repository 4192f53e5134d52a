"""The val crops kept in host memory after the first full pass: later passes read no file and see
the same pixels; a pass cut short or a split over the budget keeps nothing."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import make_image_folder

from kd import config as kd_config
from kd.data import build
from kd.data.cache import CachedVal
from kd.data.loader import STD
from kd.utils.accuracy import evaluate

CPU = torch.device("cpu")
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities of TorchVision")


def val_loader(root, loader="pil", **kw):
    opts = dict(data=str(root), no_teacher=True, student="resnet18", workers=0, image_size=32, device="cpu")
    opts.update(loader=loader, **kw)
    return build(kd_config.resolve(options=opts), 1, 0, 4, CPU, False).val


def passes(loader):
    return [(b.images.clone(), b.labels.clone(), list(b.bad)) for b in loader]


def hide(root):
    """Move the val split away: a pass that reads files now finds none."""
    shutil.move(str(root / "val"), str(root / "val_hidden"))


@pytest.mark.parametrize("loader", ["pil", "gpu"])
def test_the_second_pass_reads_no_file_and_sees_the_same_pixels(tmp_path, monkeypatch, loader):
    monkeypatch.setenv("KD_GPU_DECODER", "cpu-thread")
    root = make_image_folder(tmp_path / "data", classes=2, val_per_class=5)
    cached = val_loader(root, loader, val_cache_gb=1)
    plain = val_loader(root, loader, val_cache_gb=0)
    assert isinstance(cached, CachedVal) and not isinstance(plain, CachedVal)
    assert "kept in host memory" in cached.describe()
    first, reference = passes(cached), passes(plain)
    hide(root)
    second = passes(cached)
    assert len(first) == len(second) == len(reference) == 3
    for (a, la, ba), (b, lb, bb), (r, lr, _) in zip(first, second, reference, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb) and torch.equal(la, lr) and ba == bb == []
        # the PIL path's uint8 crops come back exactly; the GPU path's are rounded to uint8 (half a level)
        level = ((a - r).abs() * torch.tensor(STD).view(1, 3, 1, 1)).max()
        assert level < (1e-3 if loader == "pil" else 0.51)
    assert all(b for _, _, b in passes(plain))  # the uncached loader reads the files: all gone now


def test_a_pass_cut_short_or_over_the_budget_keeps_nothing(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, val_per_class=5)
    cut = val_loader(root, val_cache_gb=1)
    evaluate(lambda x: x.flatten(1)[:, :2], cut, _NoBackend(), _Fp32(), limit=1)  # a probe: one batch
    over = val_loader(root, val_cache_gb=1e-9)
    assert "read every pass" in over.describe()
    passes(over)
    hide(root)
    assert all(b for _, _, b in passes(cut)) and all(b for _, _, b in passes(over))


def test_training_validates_from_the_cache(tmp_path):
    """Two epochs of kd train: the log says the val crops are kept; both epochs validate the same count."""
    import json

    from conftest import kd_main

    root = make_image_folder(tmp_path / "data", classes=2, val_per_class=3)
    out = tmp_path / "run"
    r = kd_main(
        *["train", "--data", root, "--teacher", "resnet18", "--teacher-weights", "none", "--student", "resnet18"],
        *["--image-size", "32", "-b", "4", "-j", "0", "--epochs", "2", "--device", "cpu", "--out", out],
    )
    assert r.returncode == 0, r.stderr
    assert "val: crops kept in host memory" in r.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2] and all("val_top1" in r for r in records)


class _NoBackend:
    device = CPU

    def all_reduce_sum(self, t):
        return t


class _Fp32:
    def autocast(self):
        from contextlib import nullcontext

        return nullcontext()

    def input_cast(self, x):
        return x


def test_bench_data_times_the_val_passes(tmp_path):
    from conftest import kd_main

    root = make_image_folder(tmp_path / "data", classes=2, val_per_class=3)
    common = ["bench", "data", "--data", root, "--split", "val", "-j", "0", "--image-size", "32", "-b", "4"]
    r = kd_main(*common, "--epochs", "2", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "crops kept in host memory" in r.stdout and "pass 2: 6 images" in r.stdout
    r = kd_main(*common, "--val-cache-gb", "0", "--device", "cpu")
    assert r.returncode == 0 and "kept in host memory" not in r.stdout
