"""One writer per run folder: a second run on a folder being written is refused in one line, and
the lock of a run killed with kill -9 is taken over; a kill -9 in validation resumes exactly.

Real processes: the holder is a real kd run (or a small process holding the lock), the second
writer a real ``kd`` command."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import HANG_GUARD, ROOT, THREADS, TINY_PAIR, kd_main, make_image_folder, start_kd

from kd.errors import KDError
from kd.runfolder import LOCK_FILE
from kd.runlock import FolderLock

TINY = [*TINY_PAIR, "--device", "cpu", "-j", "0", "--no-progress"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("lock"), classes=3, train_per_class=8, val_per_class=2)


start = start_kd


def wait_for(pred, proc, timeout=HANG_GUARD, poll=0.05):
    deadline = time.time() + timeout
    while not pred():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "timed out"
        time.sleep(poll)


def reading(pid: int, folder: Path) -> bool:
    """Whether process ``pid`` has a file below ``folder`` open now (its /proc/PID/fd links)."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd).startswith(str(folder)):
                return True
        except OSError:
            continue
    return False


HOLD = """
import sys, time
from kd.runlock import FolderLock
FolderLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def holder(folder: Path) -> subprocess.Popen:
    """A process that holds ``folder``'s lock until killed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kd: error: "), stderr
    return lines[0]


def test_a_held_folder_names_its_holder_and_a_killed_holders_lock_is_taken_over(tmp_path):
    folder = tmp_path / "a" / "run"
    proc = holder(folder)
    try:
        with pytest.raises(KDError) as err:
            FolderLock(folder).acquire()
        assert f"pid {proc.pid} on host {socket.gethostname()}, started " in str(err.value)
    finally:
        proc.kill()
        proc.wait()
    # what a kill -9 mid-write leaves: atomic writers' temporary files, never a checkpoint itself
    (folder / "checkpoints").mkdir()
    stale = [folder / "checkpoints" / ".step_00000015.pt.sha256.tmp", folder / ".last.pt.x1.tmp", folder / "a.json.tmp"]
    for path in stale:
        path.write_text("half")
    (folder / "checkpoints" / "last.pt").write_text("kept")
    lock = FolderLock(folder).acquire()  # the kernel released the dead holder's lock; its file names it
    assert lock.taken_over is not None and lock.taken_over["pid"] == proc.pid
    assert not any(path.exists() for path in stale), "a killed writer's temporary files were left"
    assert (folder / "checkpoints" / "last.pt").read_text() == "kept"
    (folder / "checkpoints" / "last.pt").unlink()
    (folder / "checkpoints").rmdir()
    lock.release()
    assert list(folder.iterdir()) == []  # its file gone; the folder stays: the killed holder made it
    lock = FolderLock(tmp_path / "b" / "c").acquire()
    assert lock.taken_over is None and (tmp_path / "b" / "c" / LOCK_FILE).is_file()
    lock.release()
    assert list(tmp_path.iterdir()) == [tmp_path / "a"]  # what it made is gone


def test_a_run_on_a_held_folder_is_refused_in_one_line_and_writes_nothing(data, tmp_path):
    out = tmp_path / "run"
    proc = holder(out)
    try:
        before = sorted(p.name for p in out.iterdir())
        for extra in ([], ["--overwrite"]):
            r = kd_main("train", "--data", data, *TINY, "--epochs", 1, "--out", out, *extra)
            assert r.returncode == 2, r.stderr
            line = one_error_line(r.stderr)
            assert f"--out {out} is being written by another kd run (pid {proc.pid} on host" in line, line
            assert sorted(p.name for p in out.iterdir()) == before
        store = tmp_path / "store"  # kd teach's store, too
        proc2 = holder(store)
        try:
            r = kd_main("teach", "--data", data, *TINY, "--epochs", 1, "--out", store)
            assert r.returncode == 2 and f"(pid {proc2.pid} on host" in one_error_line(r.stderr), r.stderr
            assert [p.name for p in store.iterdir()] == [LOCK_FILE]
        finally:
            proc2.kill()
            proc2.wait()
    finally:
        proc.kill()
        proc.wait()


def test_a_run_refused_in_set_up_leaves_no_lock_and_no_folder(data, tmp_path):
    out = tmp_path / "new" / "run"
    r = kd_main("train", "--data", data, *TINY, "--epochs", 1, "--out", out, "--resume")
    assert r.returncode == 2 and "nothing to resume" in one_error_line(r.stderr), r.stderr
    r = kd_main("train", "--data", data, *TINY, "--epochs", 1, "--out", out, "--teacher", "resnet_nosuch")
    assert r.returncode == 2 and "resnet_nosuch" in one_error_line(r.stderr), r.stderr
    r = kd_main("teach", "--data", data, *TINY, "--epochs", 1, "--out", out, "--teacher", "resnet_nosuch")
    assert r.returncode == 2 and "resnet_nosuch" in one_error_line(r.stderr), r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_second_writer_is_refused_while_the_first_runs_on(data, tmp_path):
    """``--resume`` on a folder whose run is still going is refused (two writers would both train, leaving
    metrics.jsonl ending 1, 2, 1, 2); and --overwrite, and one student's folder of several. The first
    run is paused (SIGSTOP) while the second writers are tried: it holds its folders as a running
    one does, and cannot end before they are tried however slow they are; then it runs on."""
    out = tmp_path / "run"
    proc = start("train", "--data", data, *TINY, "--kd-loss", "kd,dkd", "--epochs", 2, "--out", out)
    try:
        # an epoch done: --resume has its checkpoints
        wait_for(lambda: all((out / name / "checkpoints" / "last.pt").exists() for name in ("kd", "dkd")), proc)
        proc.send_signal(signal.SIGSTOP)
        for args, folder in (
            (["--out", out, "--resume"], out),
            (["--out", out / "dkd", "--resume"], out / "dkd"),
            (["--data", data, *TINY, "--kd-loss", "kd,dkd", "--out", out, "--overwrite"], out),
        ):
            r = kd_main("train", *args)
            assert r.returncode == 2, r.stderr
            line = one_error_line(r.stderr)
            assert f"--out {folder} is being written by another kd run (pid {proc.pid} on host" in line, line
            assert proc.poll() is None, "the first run ended before the second writer was tried"
        proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate(timeout=HANG_GUARD)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    for name in ("kd", "dkd"):
        records = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["epoch"] for r in records] == [1, 2]
    assert not list(out.rglob(LOCK_FILE))


@pytest.mark.slow
def test_kd_teach_refuses_a_second_writer_of_its_store(data, tmp_path):
    store = tmp_path / "store"
    args = ["--data", data, *TINY, "--out", store]
    proc = start("teach", *args, "--epochs", 50)
    try:
        wait_for(lambda: (store / "kd-soft-labels.json").exists(), proc)
        r = kd_main("teach", *args, "--epochs", 1)
        assert r.returncode == 2 and f"(pid {proc.pid} on host" in one_error_line(r.stderr), r.stderr
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=HANG_GUARD)
    assert proc.returncode == 143 and not (store / LOCK_FILE).exists()


# ----------------------------------------------------------------------------- kill -9 in validation
RESNET = ["--teacher", "resnet18", "--teacher-weights", "none", "--student", "resnet18"]


@pytest.fixture(scope="module")
def long_val(tmp_path_factory):
    """One training step an epoch (12 images, batch 12) and a validation pass of 75 images."""
    return make_image_folder(
        tmp_path_factory.mktemp("long_val"), classes=3, train_per_class=4, val_per_class=25, size=(64, 64)
    )


def epochs_saved(path: Path) -> int:
    try:
        return int(torch.load(path, weights_only=True)["epoch"])
    except (OSError, RuntimeError, KeyError):
        return 0


@pytest.mark.slow
def test_kill_9_in_validation_then_resume_takes_the_lock_over_and_is_exact(long_val, tmp_path, monkeypatch):
    """The kill lands in epoch 2's validation: after epoch 1's checkpoint and epoch 2's one short
    step, before epoch 2's record. The lock file it leaves names a process that is gone; --resume
    takes it over and ends equal to a run never killed."""
    args = ["--data", long_val, *RESNET, "--image-size", 64, "-b", 12, "--epochs", 2, "--device", "cpu"]
    args += ["-j", 0, "--val-cache-gb", 0, "--no-progress", "--lr", "0.02", "--teacher-precision", "float32"]
    ref = tmp_path / "ref"
    r = kd_main("train", *args, "--out", ref)  # (in this process: a fresh interpreter adds only its start)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "run"
    monkeypatch.setenv("OMP_NUM_THREADS", str(THREADS))  # the reference's threads: a step's sums differ with them
    proc = start("train", *args, "--out", out)
    wait_for(lambda: epochs_saved(out / "checkpoints" / "last.pt") == 1, proc)
    wait_for(lambda: reading(proc.pid, long_val / "val"), proc, poll=0.0005)  # epoch 2's validation (-j 0)
    proc.kill()
    proc.communicate()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1, "the kill came after the validation"
    assert epochs_saved(out / "checkpoints" / "last.pt") == 1
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == proc.pid  # left behind, its holder gone
    r = kd_main("train", "--out", out, "--resume")
    assert r.returncode == 0, r.stderr
    assert f"was locked by a run that ended without releasing it (pid {proc.pid} on host" in r.stderr
    assert not (out / LOCK_FILE).exists()
    a = torch.load(ref / "checkpoints" / "last.pt", weights_only=True)
    b = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert a["global_step"] == b["global_step"] == 2
    for key, value in a["student"].items():
        assert torch.equal(value, b["student"][key]), key
    ma = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    mb = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in mb] == [1, 2]
    for ra, rb in zip(ma, mb):
        for key in ("train_loss", "train_images", "val_top1", "val_top5"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-9), (key, ra, rb)
