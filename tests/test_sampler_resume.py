"""Exact resume with repeated augmentation, mixup and cutmix and a moving average of the weights
together (--repeated-aug 3 --mixup --cutmix --model-ema): a run resumed mid-epoch from a step
checkpoint ends bit for bit as the uninterrupted one, in one process and in two (torch_ddp on the CPU)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TEST_RESNET_PAIR, cli_options, kd_main, make_image_folder, one_error_line, run_kd

# 12 training images at global batch 4: 3 steps an epoch, in one process as in two (6 samples each,
# timm's ceil(12 / 2) for a set under 256); step checkpoint 4 is mid-way through the second epoch
RUN = cli_options(**TEST_RESNET_PAIR, image_size=32, batch_size=4, epochs=2)
RUN += cli_options(device="cpu", workers=0, save_every_steps=2, keep_last=9, limit_val_batches=1, no_progress=True)
RUN += cli_options(repeated_aug=3, mixup=0.8, cutmix=1.0, model_ema=True, model_ema_decay=0.9)
DDP = cli_options(backend="torch_ddp", nproc=2)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("repaug_data"), classes=3, train_per_class=4, val_per_class=1)


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("repaug_one") / "run"
    r = kd_main("train", "--data", data, *RUN, "--out", out)
    assert r.returncode == 0, r.stderr
    return out


def assert_resumes_bit_for_bit(whole: Path, copy: Path, train) -> None:
    """``copy`` (of ``whole``) resumed by ``train(ARGS)`` from its step-4 checkpoint ends with the
    student and the moving average of ``whole``, bit for bit."""
    shutil.copytree(whole, copy)
    step = copy / "checkpoints" / "step_00000004.pt"
    assert torch.load(step, weights_only=True)["batch_in_epoch"] == 1  # mid-way through epoch 2
    r = train("train", "--out", copy, "--resume", step)
    assert r.returncode == 0 and "resumed" in r.stderr, r.stderr
    a, b = (torch.load(run / "checkpoints" / "last.pt", weights_only=True) for run in (whole, copy))
    assert a["global_step"] == b["global_step"] == 6
    for part in ("student", "state_dict_ema"):
        assert a[part].keys() == b[part].keys()
        for key, value in a[part].items():
            assert torch.equal(value, b[part][key]), (part, key)
    assert yaml.safe_load((copy / "config.yaml").read_text())["repeated_aug"] == 3


@pytest.mark.slow
def test_a_run_with_repeated_aug_mixup_and_ema_resumes_bit_for_bit_in_one_process_and_two(data, one_process, tmp_path):
    assert_resumes_bit_for_bit(one_process, tmp_path / "one_again", kd_main)
    two = tmp_path / "two"
    r = run_kd("train", "--data", data, *RUN, *DDP, "--out", two)
    assert r.returncode == 0, r.stderr
    assert_resumes_bit_for_bit(two, tmp_path / "two_again", run_kd)


def test_a_resume_cannot_change_it(one_process, tmp_path):
    """--repeated-aug is the run's: another value on a resume is one line, and the folder stays as it was."""
    copy = tmp_path / "copy"
    shutil.copytree(one_process, copy)
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    line = one_error_line(kd_main("train", "--out", copy, "--resume", "--repeated-aug", "0"))
    assert "repeated_aug" in line or "--repeated-aug" in line, line
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before
