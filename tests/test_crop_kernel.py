"""kd.data.crop_kernel: the one-kernel crop gives what the roi_align path gives, alone and inside
the loader. On the CPU through Triton's interpreter (a child process with TRITON_INTERPRET=1,
which Triton reads when a kernel is defined); on CUDA compiled (gpu marker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HANG_GUARD

from kd.data import crop_kernel
from kd.data import gpu as gpu_mod
from kd.data.gpu import crop_resize
from kd.data.loader import Shard

triton = pytest.importorskip("triton")
TESTS = Path(__file__).resolve().parent


def largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, infinite where either holds a nan (a pixel the kernel did not write)."""
    return float(torch.nan_to_num((a - b).abs(), nan=float("inf")).max())


def compare_kernel(device: str) -> float:
    """Largest difference between crop_batch and crop_resize + flip + normalise + placing, over
    images of several sizes and strides, boxes inside, at and over the edges, both memory formats."""
    g = torch.Generator().manual_seed(0)
    dev = torch.device(device)
    sizes = [(30, 40), (30, 40), (61, 23), (16, 16), (90, 120), (7, 9)]
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g).to(dev) for h, w in sizes]
    images[1] = images[1].transpose(1, 2).contiguous().transpose(1, 2)  # same pixels, column-major
    images[4] = images[4].permute(1, 2, 0).contiguous().permute(2, 0, 1)  # channels last (HWC storage)
    boxes = torch.tensor(
        [[0, 0, 40, 30], [3.3, 2.1, 33.7, 29.2], [1, 5, 22, 60.5], [0, 0, 16, 16], [10, 7, 118, 89]]
        + [[-0.8, 0, 9.9, 7.6]],  # over the left edge and past the bottom row
        dtype=torch.float32,
    )
    flips = torch.tensor([False, True, False, True, True, False])
    places = torch.tensor([4, 0, 2, 1, 5, 3])
    scale = torch.tensor([0.5, 2.0, 1.0], device=dev).view(1, 3, 1, 1)
    bias = torch.tensor([1.0, -3.0, 0.25], device=dev).view(1, 3, 1, 1)
    size = 16
    ref = crop_resize(images, boxes, size)
    ref = torch.where(flips.to(dev).view(-1, 1, 1, 1), ref.flip(3), ref) * scale + bias
    expect = torch.empty_like(ref)
    expect[places.to(dev)] = ref
    worst = 0.0
    for fmt in (torch.contiguous_format, torch.channels_last):
        out = torch.full((6, 3, size, size), float("nan"), device=dev).contiguous(memory_format=fmt)
        crop_kernel.crop_batch(images, boxes, flips, places, out, scale, bias)
        worst = max(worst, largest_difference(out, expect))
    return worst


def compare_loaders(data: str, device: str) -> float:
    """The loader's batches with the kernel against those with KD_GPU_CROP=roi_align: a PIL share,
    flips, the sampler's order; returns the largest difference."""
    from test_gpu_loader import cfg_for

    from kd.data.layout import scan

    _, train, _ = scan(data)
    dev = torch.device(device)
    cfg = cfg_for(data, cpu_decode_share=0.5, device=device)
    saved = {k: os.environ.get(k) for k in (gpu_mod.DECODER_ENV, crop_kernel.CROP_ENV)}
    try:
        os.environ[gpu_mod.DECODER_ENV] = "cpu-thread" if device == "cpu" else "auto"
        fused = gpu_mod.make_gpu_loader(cfg, train, True, Shard(1, 0, 8, dev, True))
        os.environ[crop_kernel.CROP_ENV] = "roi_align"
        separate = gpu_mod.make_gpu_loader(cfg, train, True, Shard(1, 0, 8, dev, True))
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    assert fused.kernel_missing is None and "one Triton kernel" in fused.describe(), fused.describe()
    assert separate.kernel_missing and "roi_align per image size" in separate.describe()
    worst, seen = 0.0, 0
    for epoch in (0, 1):
        fused.set_epoch(epoch)
        separate.set_epoch(epoch)
        for a, b in zip(fused, separate, strict=True):
            assert torch.equal(a.labels, b.labels)
            assert a.images.is_contiguous(memory_format=torch.channels_last)
            worst = max(worst, largest_difference(a.images, b.images))
            seen += len(a)
    assert seen >= 16
    return worst


INTERPRETED = """
import json, sys, traceback
import test_crop_kernel as t
results = {}
comparisons = {"kernel": lambda: t.compare_kernel("cpu"), "loaders": lambda: t.compare_loaders(sys.argv[1], "cpu")}
for name, compare in comparisons.items():
    try:
        results[name] = compare()
    except Exception:
        results[name] = traceback.format_exc()
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def interpreted(nat_folder):
    """:func:`compare_kernel` and :func:`compare_loaders` on the CPU through Triton's interpreter, both
    in one fresh interpreter (Triton reads TRITON_INTERPRET as it is imported): each one's largest
    difference, or its traceback."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent)]))
    env.pop(crop_kernel.CROP_ENV, None)
    args = [sys.executable, "-c", INTERPRETED, str(nat_folder)]
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=HANG_GUARD)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def largest_interpreted_difference(interpreted: dict, name: str) -> float:
    value = interpreted[name]
    assert isinstance(value, float), value  # else the comparison's traceback
    return value


@pytest.mark.slow  # Triton's interpreter in a fresh interpreter
def test_kernel_is_roi_aligns_crop_flip_and_normalisation(interpreted):
    assert largest_interpreted_difference(interpreted, "kernel") < 1e-4


@pytest.mark.slow  # Triton's interpreter in a fresh interpreter, over a loader's batches
def test_loader_batches_with_the_kernel_are_the_roi_align_paths(interpreted):
    assert largest_interpreted_difference(interpreted, "loaders") < 1e-4


def test_the_kernel_is_skipped_where_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(crop_kernel.CROP_ENV, raising=False)
    assert crop_kernel.unavailable(torch.device("cpu")) == "needs a CUDA device"
    monkeypatch.setenv(crop_kernel.CROP_ENV, "roi_align")
    assert crop_kernel.unavailable(torch.device("cuda", 0)) == "KD_GPU_CROP=roi_align"
    monkeypatch.setenv(crop_kernel.CROP_ENV, "fast")
    assert "not auto or roi_align" in str(crop_kernel.unavailable(torch.device("cuda", 0)))


def test_self_check_refuses_a_wrong_kernel(monkeypatch):
    def zeros(images, boxes, flips, places, out, scale, bias):
        return out.zero_()

    monkeypatch.setattr(crop_kernel, "crop_batch", zeros)
    assert "self-check: off by" in str(crop_kernel.self_check(torch.device("cpu")))


@pytest.mark.parametrize(
    "message,reason",
    [
        ("Failed to find C compiler. Please specify via CC environment variable.\nmore", "Failed to find C compiler."),
        ("", ""),
    ],
)
def test_a_triton_that_cannot_compile_leaves_the_roi_align_path(monkeypatch, message, reason):
    def no_compiler():
        raise RuntimeError(message)

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the device check on this CPU
    monkeypatch.delenv(crop_kernel.CROP_ENV, raising=False)
    monkeypatch.setattr(crop_kernel, "_compiled", no_compiler)
    monkeypatch.setattr(crop_kernel, "_CHECKED", {})
    why = str(crop_kernel.unavailable(torch.device("cpu")))
    assert why.startswith(f"Triton unusable here (RuntimeError: {reason}"), why


@pytest.fixture(scope="module")
def nat_folder(tmp_path_factory):
    """8 training images of 3 sizes: one batch of 8 an epoch, in which the crops of
    :func:`compare_loaders` are flipped and not, of whole images and of decoded regions."""
    from test_gpu_loader import natural_folder

    return natural_folder(tmp_path_factory.mktemp("natural"), per_class=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_on_cuda(nat_folder, monkeypatch):
    monkeypatch.delenv(crop_kernel.CROP_ENV, raising=False)
    monkeypatch.setenv(gpu_mod.DECODER_ENV, "auto")
    assert compare_kernel("cuda") < 1e-3
    assert compare_loaders(str(nat_folder), "cuda") < 1e-3
    assert crop_kernel.unavailable(torch.device("cuda", 0)) is None
