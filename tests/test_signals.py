"""Every stop exits promptly and leaves nothing running (kd.utils.signals): no worker process, no decode thread.

Real ``kd train`` processes with DataLoader workers and the GPU loader's decode thread (which
runs on the CPU too); each process kd starts inherits a marker in its environment, and after
the exit /proc is searched for it. Under apex.amp (GPU, where an apex with apex.amp is
installed) the same, since apex runs once did not exit after stopping.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    HANG_GUARD,
    ROOT,
    TEST_RESNET_PAIR,
    TINY_PAIR,
    cli_options,
    has_apex_amp,
    kd_main,
    make_image_folder,
)

TINY = [*TINY_PAIR, "--log-every", "1", "--loader", "gpu", "-j", "2", "--no-progress"]
#: the stopped training runs: timm's test_resnet teaching itself (0.4 M parameters), whose checkpoint,
#: written at the stop, is a tenth of resnet10t's
STOPPED = [*cli_options(**TEST_RESNET_PAIR), *TINY[6:]]


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


def start(marker: str, *args, group: bool = False, command: str = "train"):
    """``kd COMMAND ARGS`` (train); with ``group``, in a process group of its own, as a terminal's
    foreground job (on one thread, so that two of them share the cores)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "KD_TEST_MARKER": marker}
    if group:
        env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "cli", command, *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=group,
    )


def wait_line(proc, text: str, timeout: float = HANG_GUARD) -> str:
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
    deadline = time.time() + HANG_GUARD  # the workers' own exit after their parent's
    while marked_processes(marker) and time.time() < deadline:
        time.sleep(0.2)
    assert not marked_processes(marker), "processes left running after kd exited"
    return out


SIGNALS = {"sigterm": (signal.SIGTERM, 143), "ctrl-c": (signal.SIGINT, 130)}


def stops(extra=()):
    run = [*STOPPED, "--epochs", 50, *extra]
    return {
        "sigterm": run,
        "ctrl-c": run,
        "error": [*STOPPED, "--epochs", 50, "--lr", "1e38", "--max-nonfinite-steps", 2, *extra],
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


@pytest.mark.slow
def test_kd_teach_stops_promptly_and_continues(data, tmp_path):
    """SIGTERM while kd teach writes an epoch: exit 143 at once, no process left, the store keeps
    its complete epochs (the partial one is redone), and the same command continues it."""
    import json as _json

    marker = uuid.uuid4().hex
    store = tmp_path / "store"
    args = ["--data", data, "--device", "cpu", *TINY, "--epochs", 50, "--out", store]
    proc = start(marker, *args, command="teach")
    wait_line(proc, "kd teach: epoch 1/50 written")
    proc.send_signal(signal.SIGTERM)
    out = assert_gone(proc, marker)
    assert proc.returncode == 143 and "run the same kd teach again to continue" in out, out
    done = _json.loads((store / "kd-soft-labels.json").read_text())["epochs_done"]
    assert 1 <= done < 50
    assert not (store / f"epoch-{done + 1:03d}.values.npy").exists()
    more = [a if a != 50 else done + 1 for a in args]
    # in this process and without loader workers (the store holds no trace of either): the stop
    # above is the process under test
    r = kd_main("teach", *more, "-j", 0)
    assert r.returncode == 0 and f"continuing at epoch {done + 1}" in r.stderr, r.stderr
    assert (store / f"epoch-{done + 1:03d}.values.npy").exists() and not list(store.glob("*.partial.npy"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not has_apex_amp(), reason="needs CUDA and apex with apex.amp")
@pytest.mark.parametrize("how", ["sigterm", "error"])
@pytest.mark.parametrize("backend", ["single", "apex_ddp"])
def test_apex_runs_stop_promptly_too(data, tmp_path, how, backend):
    marker = uuid.uuid4().hex
    args = stops(["--opt", "O1", "--amp-impl", "apex", "--backend", backend, "--gpus", "0"])[how]
    proc = start(marker, "--data", data, *args, "--out", tmp_path / how)
    stop(proc, how)
    out = assert_gone(proc, marker)
    assert proc.returncode == (SIGNALS[how][1] if how in SIGNALS else 2), out


# ----------------------------------------------------------------------------- Ctrl-C as a terminal sends it
DDP = ["--backend", "torch_ddp", "--nproc", "2", "-j", "1", "--no-progress", "--device", "cpu"]
TEACHER = ["--teacher", "resnet18", "--teacher-weights", "none", "--student", "resnet18"]


@pytest.fixture(scope="module")
def long_val(tmp_path_factory):
    """One training step an epoch (12 images, batch 12) and a validation pass of a few seconds."""
    return make_image_folder(
        tmp_path_factory.mktemp("long_val"), classes=3, train_per_class=4, val_per_class=70, size=(64, 64)
    )


def ctrl_c(proc, after: str, delay: float = 0.0) -> float:
    """Ctrl-C to the whole group (kd's launcher, its workers, their loader workers) once ``after``
    is printed; the time it was sent."""
    wait_line(proc, after)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)
    return time.time()


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["backend torch_ddp"])
def test_ctrl_c_during_set_up_leaves_the_disk_as_it_was(long_val, tmp_path, moment):
    """In the workers' model building: one line, exit 130, and no --out."""
    marker = uuid.uuid4().hex
    out = tmp_path / "run"
    proc = start(marker, "--data", long_val, *TEACHER, *DDP, "--image-size", 64, "-b", 12, "--out", out, group=True)
    ctrl_c(proc, moment)
    text = assert_gone(proc, marker)
    assert proc.returncode == 130, text  # where it stopped is in its line, not in how long it took
    assert "Traceback" not in text and text.strip().splitlines()[-1] == (
        "kd: stopped by SIGINT during set-up; nothing was written"
    ), text
    assert not out.exists()


@pytest.fixture(scope="module")
def stopped_in_validation(long_val, tmp_path_factory):
    """A two-epoch run under torch_ddp with loader workers, Ctrl-C sent to its group in the
    end-of-epoch validation (the teacher's, which comes after the first epoch): its folder, exit
    code, output and, as they were before :func:`resumed_then_sigterm` continued it, its checkpoint
    and whether it had written metrics."""
    marker = uuid.uuid4().hex
    out = tmp_path_factory.mktemp("stopped") / "run"
    # the stop's moment is the teacher's validation; a small student's validations cost less
    args = ["--data", long_val, *TEACHER[:4], "--student", "mobilenet_v3_small", *DDP, "--image-size", 64]
    args += ["-b", 12, "--epochs", 2]
    proc = start(marker, *args, "--teacher-precision", "float32", "--out", out, group=True)
    ctrl_c(proc, "first step done", 0.3)
    text = assert_gone(proc, marker)
    last = out / "checkpoints" / "last.pt"
    state = torch.load(last, weights_only=True) if last.is_file() else None
    return SimpleNamespace(out=out, returncode=proc.returncode, text=text, state=state,
                           wrote_metrics=(out / "metrics.jsonl").exists())  # fmt: skip


@pytest.fixture(scope="module")
def resumed_then_sigterm(stopped_in_validation):
    """:func:`stopped_in_validation` continued with --resume (no loader workers: the stop's, above,
    were those under test), and SIGTERM sent to its launcher once the last epoch is logged: its
    exit code and output."""
    marker = uuid.uuid4().hex
    proc = start(marker, "--out", stopped_in_validation.out, "--resume", "-j", 0, group=True)
    text = wait_line(proc, "epoch 2/2 |")
    proc.send_signal(signal.SIGTERM)
    text += assert_gone(proc, marker)
    return SimpleNamespace(returncode=proc.returncode, text=text)


@pytest.mark.slow
def test_ctrl_c_during_validation_keeps_the_epoch_and_resumes_it(stopped_in_validation, resumed_then_sigterm):
    """The stop lands in the end-of-epoch validation: the epoch's training is saved (its validation
    pending, not the stop's partial one), and --resume validates it, then trains on."""
    stopped = stopped_in_validation
    text = stopped.text
    assert stopped.returncode == 130, text  # where it stopped is in its line, not in how long it took
    assert "Traceback" not in text and "kd: stopped by SIGINT at step 1; checkpoint written" in text, text
    state = stopped.state
    assert state is not None, text
    assert (state["epoch"], state["global_step"]) == (0, 1) and state["pending_epoch"]["train"]["images"] == 12
    assert not stopped.wrote_metrics
    text = resumed_then_sigterm.text
    assert "holds it complete" in text, text  # the resume ran to its end (its exit code: the SIGTERM's, below)
    records = [json.loads(line) for line in (stopped.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2] and records[0]["train_images"] == 12 and "val_top1" in records[0]
    assert "teacher_top1" in records[0] and "teacher resnet18: val top-1" in text


def test_a_second_ctrl_c_waits_for_the_checkpoint_and_a_launched_process_ignores_it():
    from kd.utils.signals import StopFlag

    flag = StopFlag(launched=False)
    try:
        with pytest.raises(KeyboardInterrupt):
            with flag.critical():
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)  # "stop now", but not inside the write
                time.sleep(0.05)
                written = True
        assert flag.requested and flag.signame == "SIGINT" and written
    finally:
        flag.restore()
    flag = StopFlag(launched=True)  # the launcher's forwarded copy of the first signal
    try:
        for _ in range(3):
            os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert flag.requested
    finally:
        flag.restore()


def test_a_late_copy_of_the_signal_after_the_run_is_no_new_stop():
    """A launched worker's run has stopped on a SIGINT and put the set-up handler back; the
    launcher's forwarded copy then arrives while the process exits: ignored, no traceback in
    threading's shutdown."""
    from kd.utils.signals import StopFlag, install_early

    restore = install_early(launched=True)
    try:
        flag = StopFlag(launched=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        flag.restore()
        assert flag.requested
        os.kill(os.getpid(), signal.SIGINT)  # would raise Interrupted from the set-up handler
        time.sleep(0.05)
    finally:
        restore()


# ----------------------------------------------------------------------------- SIGTERM before and after the run
@pytest.mark.slow
def test_sigterm_as_a_launched_run_ends_exits_143_with_its_line(stopped_in_validation, resumed_then_sigterm):
    """SIGTERM to kd's launcher once the last epoch is logged (its checkpoint, the workers' end, the
    launcher's collection of the results): exit 143 with kd's stop line at once, the run complete,
    not 130 and 'kd: interrupted' after the agent's 30 s wait for the workers. The run: the
    resume of :func:`stopped_in_validation`, its launcher and two ranks."""
    out, text = stopped_in_validation.out, resumed_then_sigterm.text
    assert resumed_then_sigterm.returncode == 143, text
    assert "Traceback" not in text and text.strip().splitlines()[-1] == (
        f"kd: stopped by SIGTERM as the run ended; {out} holds it complete"
    ), text
    assert [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=True)["epoch"] == 2


def test_sigterm_while_torch_is_imported_is_one_line(data, tmp_path):
    """SIGTERM in a kd train's first second, while Python imports torch (before any run's handler):
    one line and exit 143, nothing written (not the default action: killed, no line)."""
    marker = uuid.uuid4().hex
    out = tmp_path / "run"
    proc = start(marker, "--data", data, "--device", "cpu", *TINY, "--out", out)
    deadline = time.time() + HANG_GUARD
    while time.time() < deadline and proc.poll() is None:
        if "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text():  # torch's import has begun
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    text = assert_gone(proc, marker)
    assert proc.returncode == 143, text
    assert text.strip().splitlines() == ["kd: stopped by SIGTERM before the run started; nothing was written"], text
    assert not out.exists()
