"""A run's checkpoints (kd.run.checkpoint): preemption, kills and non-finite losses lose nothing, with an
exact mid-epoch resume and intact checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import HANG_GUARD, THREADS, cli_options, kd_main, make_image_folder, run_kd, start_kd

# timm's test_resnet (BatchNorm, 0.4 M parameters) teaching itself: what a resume must restore
# exactly is the same as for a large model, in a fraction of the compute and checkpoint bytes
TINY_RESNET = "timm:test_resnet"
ARGS = cli_options(teacher=TINY_RESNET, teacher_weights="none", student=TINY_RESNET, image_size=32, batch_size=4)
# a warm-up over the stops' epochs: each step's lr differs, so the logged mean lr of an epoch resumed mid-way is checked
ARGS += cli_options(epochs=3, device="cpu", lr=0.02, log_every=1, temperature=2, warmup_epochs=2)
DDP = ["--backend", "torch_ddp", "--nproc", "2"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("rel"), classes=3, train_per_class=16, val_per_class=3)


start = start_kd


def wait_for(pred, proc, timeout=HANG_GUARD):
    deadline = time.time() + timeout
    while not pred():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """The uninterrupted run that the interrupted ones must equal, without loader workers; its steps
    do not depend on the number of workers (every sample draws from its own seed), so the SIGTERM
    run with two workers is held against it as the kill -9 run without them is. In this process (a
    fresh interpreter adds only its start), on the threads of the runs held against it."""
    out = tmp_path_factory.mktemp("reference") / "ref"
    r = kd_main("train", "--data", data, *ARGS, "-j", 0, "--out", out, threads=THREADS)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture
def reference_threads(monkeypatch):
    """Runs in fresh interpreters on the thread count of :func:`reference`: a step's sums, and so
    its exact result, depend on it."""
    monkeypatch.setenv("OMP_NUM_THREADS", str(THREADS))


@pytest.fixture(scope="module")
def ddp_reference(data, tmp_path_factory):
    """The uninterrupted run of two processes (torch_ddp, no loader workers) that the stopped and
    the restarted runs of two processes must equal."""
    out = tmp_path_factory.mktemp("ddp_reference") / "ref"
    r = run_kd("train", "--data", data, *ARGS, *DDP, "-j", "0", "--out", out)
    assert r.returncode == 0, r.stderr
    return out


def assert_same_run(a: Path, b: Path):
    ca = torch.load(a / "checkpoints" / "last.pt", weights_only=True)
    cb = torch.load(b / "checkpoints" / "last.pt", weights_only=True)
    assert ca["global_step"] == cb["global_step"]
    for key, value in ca["student"].items():
        assert torch.equal(value, cb["student"][key]), key
    for sa, sb in zip(ca["optimizer"]["state"].values(), cb["optimizer"]["state"].values()):
        assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])
    ma = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    mb = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in mb] == [1, 2, 3]
    for ra, rb in zip(ma, mb):
        for key in ("train_loss", "train_ce", "train_kd", "train_images", "val_top1", "val_top5", "lr"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-9), (key, ra, rb)


@pytest.mark.slow
def test_sigterm_mid_epoch_then_resume_is_exact(data, reference, reference_threads, tmp_path):
    out = tmp_path / "run"
    proc = start("train", "--data", data, *ARGS, "-j", 2, "--out", out)
    wait_for(lambda: (out / "metrics.jsonl").exists(), proc)  # epoch 1 done: now in epoch 2
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG_GUARD)
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM" in err and f"kd train --out {out} --resume" in err
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert 0 < state["batch_in_epoch"] < 12, state["batch_in_epoch"]  # 48 images / batch 4
    # with its two workers, from the saved config; in this process (the stopped run is the fresh interpreter)
    r = kd_main("train", "--out", out, "--resume", threads=THREADS)
    assert r.returncode == 0, r.stderr
    assert_same_run(reference, out)


@pytest.mark.slow
def test_kill_9_after_step_checkpoint_then_resume_is_exact(data, reference, reference_threads, tmp_path):
    out = tmp_path / "run"
    proc = start("train", "--data", data, *ARGS, "-j", 0, "--out", out, "--save-every-steps", 5, "--keep-last", 2)
    wait_for(lambda: (out / "checkpoints" / "step_00000015.pt").exists(), proc)  # in epoch 2 of 12 steps each
    proc.kill()
    proc.communicate()
    steps = sorted((out / "checkpoints").glob("step_*.pt"))
    assert len(steps) <= 2  # --keep-last
    r = kd_main("train", "--out", out, "--resume", threads=THREADS)  # (the killed run is the fresh interpreter)
    assert r.returncode == 0, r.stderr
    assert not list((out / "checkpoints").glob("*.tmp"))  # a write the kill cut short is removed on resume
    assert_same_run(reference, out)


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(data, tmp_path):
    out = tmp_path / "nan"
    r = kd_main(
        "train",
        "--data",
        data,
        *ARGS,
        "-j",
        0,
        "--out",
        out,
        "--lr",
        "1e12",
        "--save-every-steps",
        "1",
        "--max-nonfinite-steps",
        "3",
        "--epochs",
        "1",
    )
    assert r.returncode == 2, r.stderr
    assert "not finite for 3 consecutive steps" in r.stderr and "Traceback" not in r.stderr
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state["student"].values() if v.is_floating_point())


def test_checkpoint_write_is_atomic(tmp_path):
    from kd.utils.checkpoint_io import save_atomic

    path = tmp_path / "c.pt"
    save_atomic({"a": torch.ones(3)}, path)

    class Boom:
        def __reduce__(self):
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left on device"):
        save_atomic({"a": torch.zeros(3), "b": Boom()}, path)
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt", "c.pt.sha256"]


@pytest.mark.slow
def test_sigterm_under_torch_ddp_then_resume_is_exact(data, ddp_reference, tmp_path):
    out = tmp_path / "run"  # the stop, with workers in every process (the steps do not depend on them)
    proc = start("train", "--data", data, *ARGS, *DDP, "-j", "2", "--out", out)
    wait_for(lambda: (out / "metrics.jsonl").exists(), proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG_GUARD)
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM" in err and "--resume" in err
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert 0 < state["batch_in_epoch"] < 12 or state["epoch"] == 2
    r = run_kd("train", "--out", out, "--resume", "-j", "0")
    assert r.returncode == 0, r.stderr
    assert_same_run(ddp_reference, out)


def _ranks(parent: int):
    """The worker processes torch's elastic agent started for the run (children of kd's process)."""
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
    pids = []
    for pid in map(int, out):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "spawn_main" in cmd and "resource_tracker" not in cmd:
            pids.append(pid)
    return pids


@pytest.mark.slow
def test_a_dead_rank_restarts_the_group_from_its_checkpoint(data, ddp_reference, tmp_path):
    """--max-restarts 1: the agent restarts the group, which resumes from the last checkpoint and
    ends as the uninterrupted run (without restarts the group goes down in one line:
    tests/test_process_deaths.py)."""
    out = tmp_path / "run"
    # a checkpoint every step: the same training, slower, so that the kill lands well before the end
    # (epochs of 0.4 s left it a second), and the group resumes mid-epoch
    more = ["--max-restarts", 1, "--save-every-steps", 1]
    proc = start("train", "--data", data, *ARGS, *DDP, "-j", "0", "--out", out, *more)
    wait_for(lambda: (out / "metrics.jsonl").exists() and len(_ranks(proc.pid)) == 2, proc)  # in epoch 2 of 3
    os.kill(_ranks(proc.pid)[-1], signal.SIGKILL)
    _, err = proc.communicate(timeout=HANG_GUARD)
    assert proc.returncode == 0, err
    assert "resumed from" in err
    assert_same_run(ddp_reference, out)


def test_keep_last_holds_at_every_moment_of_a_step_checkpoint(data, tmp_path, monkeypatch):
    """A kill -9 may land between writing a step copy and pruning: the oldest go first, so no moment
    has more than --keep-last copies."""
    import kd.run.checkpoint

    seen = []
    real_copy = kd.run.checkpoint.copy_atomic

    def counting_copy(src, dst):
        real_copy(src, dst)
        seen.append(len(list(Path(dst).parent.glob("step_*.pt"))))

    monkeypatch.setattr(kd.run.checkpoint, "copy_atomic", counting_copy)
    out = tmp_path / "keep"
    r = kd_main(
        "train", "--data", data, *ARGS, "-j", 0, "--epochs", 1, "--out", out, "--save-every-steps", 2, "--keep-last", 2
    )
    assert r.returncode == 0, r.stderr
    assert len(seen) >= 4 and max(seen) <= 2, seen


def test_a_resume_reads_its_checkpoint_once(data, tmp_path, monkeypatch):
    """The config a resume continues, best.pt's check, the epochs left and the restore share one read
    of last.pt."""
    import kd.run.checkpoint

    out = tmp_path / "run"
    assert kd_main("train", "--data", data, *ARGS, "-j", 0, "--epochs", 1, "--out", out).returncode == 0
    reads = []
    real_read = kd.run.checkpoint.read

    def counting_read(path, *args, **kwargs):
        reads.append(Path(path).name)
        return real_read(path, *args, **kwargs)

    monkeypatch.setattr(kd.run.checkpoint, "read", counting_read)
    r = kd_main("train", "--out", out, "--resume", "--epochs", 2, "--no-progress")
    assert r.returncode == 0 and "resumed" in r.stderr, r.stderr
    assert reads.count("last.pt") == 1, reads
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=True)["epoch"] == 2


def test_a_file_size_limit_at_a_checkpoint_write_is_one_line(data, tmp_path):
    """A write past the file-size limit (ulimit -f: EFBIG, which torch.save reports as a RuntimeError
    of its own) stops the run in one line saying so and what to do; no partial file is left."""
    import resource

    out = tmp_path / "run"
    args = ["train", "--data", data, "--no-teacher", "--student", TINY_RESNET, "--image-size", 32, "-b", 8]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # the checkpoint is 3 MB; the rest far less
    try:
        r = kd_main(*args, "-j", 0, "--epochs", 1, "--device", "cpu", "--out", out)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert f"could not write a checkpoint to {out / 'checkpoints'}: file too large; no checkpoint was written" in line
    assert line.endswith(
        "raise the file-size limit (ulimit -f) or write to a filesystem that takes larger files, then start again"
    )
    assert not list((out / "checkpoints").iterdir()), "a partial file was left behind"


def test_a_checkpoint_without_the_methods_state_is_refused(data, tmp_path):
    """A method with trained modules of its own (FitNet's connectors) resumes only from a checkpoint that
    holds them: one without them is refused in one line, not resumed with fresh connectors."""
    from kd.utils import checkpoint_io

    out = tmp_path / "run"
    args = ["train", "--data", data, *ARGS, "--kd-loss", "fitnet", "-j", 0, "--epochs", 1, "--out", out]
    assert kd_main(*args).returncode == 0
    last = out / "checkpoints" / "last.pt"
    state = torch.load(last, weights_only=True)
    assert state["loss"], "FitNet's connectors are in the checkpoint"
    del state["loss"]
    checkpoint_io.save_atomic(state, last)
    r = kd_main("train", "--out", out, "--resume", "--epochs", 2, "--no-progress")
    assert r.returncode == 2 and "holds no" in r.stderr and "(loss)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
