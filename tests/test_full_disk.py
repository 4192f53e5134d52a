"""A full disk: one ``kd: error:`` line that says so, exit code 2, and what was written before intact.

The disk is a real one: a small tmpfs mounted for the test (root only; CI runs as root)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import kd_main, make_image_folder

from kd.utils import checkpoint_io

pytestmark = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or not Path("/proc/mounts").is_file(),
    reason="mounts a small tmpfs: needs root on Linux",
)

# a tiny student (timm's test model: a 3.5 MB checkpoint) for one training step an epoch
TINY = ["--student", "timm:test_resnet", "--no-teacher", "--image-size", "32", "-b", "24", "-j", "0"]
TINY += ["--device", "cpu", "--limit-train-batches", "1", "--no-progress"]


@pytest.fixture
def small_disk(tmp_path):
    """A function that mounts a tmpfs of ``size`` at a new folder and returns it; unmounted after the test."""
    mounted = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("data"))


def one_error_line(r) -> str:
    lines = [line for line in r.stderr.splitlines() if line.startswith("kd: ") or "Traceback" in line]
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("kd: error: "), r.stderr[-3000:]
    return lines[0]


def test_no_room_for_the_first_checkpoint(data, small_disk):
    disk = small_disk("1M")
    line = one_error_line(kd_main("train", "--data", data, *TINY, "--epochs", "1", "--out", disk / "run"))
    assert "could not write a checkpoint" in line and "no space left" in line.lower(), line
    assert "no checkpoint was written" in line, line
    assert not list((disk / "run" / "checkpoints").glob("*.tmp")), "a partial file was left behind"


def test_no_room_for_a_later_checkpoint_keeps_the_last_one(data, small_disk):
    disk = small_disk("8M")  # epoch 1's last.pt and best.pt fit; epoch 2's last.pt beside them does not
    out = disk / "run"
    line = one_error_line(kd_main("train", "--data", data, *TINY, "--epochs", "3", "--out", out))
    assert "could not write a checkpoint" in line and "no space left" in line.lower(), line
    assert "the previous checkpoint is intact" in line and "--resume" in line, line
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert state["epoch"] == 1
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "best.pt", "best.pt.sha256", "last.pt", "last.pt.sha256"
    ]  # fmt: skip
    assert checkpoint_io.verify(out / "checkpoints" / "last.pt")  # its sums file lists it


def test_prepare_refuses_a_disk_without_room_before_writing(data, small_disk):
    disk = small_disk("64K")  # the copy of 24 raw 40 x 32 train images needs about 100 KB
    line = one_error_line(kd_main("prepare", data, disk / "copy", "--no-progress"))
    assert "needs about" in line and "free" in line, line
    assert list(disk.iterdir()) == [], "a refused copy wrote something"


def test_prepare_where_no_folder_can_be_made(data):
    line = one_error_line(kd_main("prepare", data, "/proc/kd-test/copy", "--no-progress"))
    assert "/proc takes no new folders" in line, line
