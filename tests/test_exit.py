"""Every stop exits promptly and leaves nothing running: no worker process, no decode thread.

Real ``kd train`` processes with DataLoader workers and the GPU loader's decode thread (which
runs on the CPU too); each process kd starts inherits a marker in its environment, and after
the exit /proc is searched for it. Under apex.amp (GPU, where an apex with apex.amp is
installed) the same, since apex runs once did not exit after stopping.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from conftest import ROOT, make_image_folder

TINY = [
    "--teacher",
    "timm:resnet10t",
    "--teacher-weights",
    "none",
    "--student",
    "timm:resnet10t",
    "--image-size",
    "32",
    "-b",
    "4",
    "--log-every",
    "1",
    "--loader",
    "gpu",
    "-j",
    "2",
    "--no-progress",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("exit"), classes=3, train_per_class=24, val_per_class=2)


def marked_processes(marker: str):
    """PIDs of live processes whose environment holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                status = (entry / "status").read_text()
                if "State:\tZ" not in status:
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def start(marker: str, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "KD_TEST_MARKER": marker}
    return subprocess.Popen(
        [sys.executable, "-m", "cli", "train", *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_line(proc, text: str, timeout: float = 300) -> str:
    seen = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if text in line:
            return "".join(seen)
    raise AssertionError(f"no {text!r} in: {''.join(seen)}")


def assert_gone(proc, marker: str, grace: float = 60.0) -> str:
    """``proc`` exits within ``grace`` seconds and no process it started is left; its output."""
    try:
        out, _ = proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"kd did not exit within {grace:.0f} s of the stop")
    deadline = time.time() + 20  # the workers' own exit after their parent's
    while marked_processes(marker) and time.time() < deadline:
        time.sleep(0.2)
    assert not marked_processes(marker), "processes left running after kd exited"
    return out


SIGNALS = {"sigterm": (signal.SIGTERM, 143), "ctrl-c": (signal.SIGINT, 130)}


def stops(extra=()):
    run = [*TINY, "--epochs", 50, *extra]
    return {
        "sigterm": run,
        "ctrl-c": run,
        "error": [*TINY, "--epochs", 50, "--lr", "1e38", "--max-nonfinite-steps", 2, *extra],
    }


def stop(proc, how: str) -> None:
    wait_line(proc, "first step done")
    if how in SIGNALS:
        proc.send_signal(SIGNALS[how][0])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigterm", "ctrl-c", "error"])
def test_a_stop_exits_promptly_and_leaves_nothing_running(data, tmp_path, how):
    marker = uuid.uuid4().hex
    proc = start(marker, "--data", data, "--device", "cpu", *stops()[how], "--out", tmp_path / how)
    stop(proc, how)
    out = assert_gone(proc, marker)
    if how in SIGNALS:
        assert proc.returncode == SIGNALS[how][1] and "continue with: kd train" in out, out
    else:
        assert proc.returncode == 2 and "not finite for 2 consecutive steps" in out, out


def _has_apex_amp() -> bool:
    try:
        from apex import amp  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not _has_apex_amp(), reason="needs CUDA and apex with apex.amp")
@pytest.mark.parametrize("how", ["sigterm", "error"])
@pytest.mark.parametrize("backend", ["single", "apex_ddp"])
def test_apex_runs_stop_promptly_too(data, tmp_path, how, backend):
    marker = uuid.uuid4().hex
    args = stops(["--opt", "O1", "--amp-impl", "apex", "--backend", backend, "--gpus", "0"])[how]
    proc = start(marker, "--data", data, *args, "--out", tmp_path / how)
    stop(proc, how)
    out = assert_gone(proc, marker)
    assert proc.returncode == (SIGNALS[how][1] if how in SIGNALS else 2), out
