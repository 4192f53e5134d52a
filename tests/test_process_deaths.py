"""A kill -9 leaves no process behind, and a killed rank is one line (kd.process_deaths, kd.run.launch).

Real ``kd train`` processes with DataLoader workers started through the forkserver; every process
kd starts inherits a marker in its environment (test_signals' helpers), and /proc is searched for it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import HANG_GUARD, TINY_PAIR, make_image_folder
from test_signals import marked_processes, start, wait_line

TINY = [*TINY_PAIR, "--log-every", "1", "--no-progress", "--device", "cpu", "--epochs", "50"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("orphans"), classes=3, train_per_class=24, val_per_class=2)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def parent(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


def wait_for_processes(proc, marker: str, forked: int, timeout: float = HANG_GUARD) -> None:
    """Until ``forked`` processes of the forkserver (the servers and their loader workers) run."""
    deadline = time.time() + timeout
    while sum("forkserver" in cmdline(pid) for pid in marked_processes(marker)) < forked:
        assert proc.poll() is None and time.time() < deadline, "the loader workers never started"
        time.sleep(0.2)


def assert_none_left(marker: str, within: float = HANG_GUARD) -> None:
    deadline = time.time() + within
    while marked_processes(marker) and time.time() < deadline:
        time.sleep(0.2)
    left = {pid: cmdline(pid)[:120] for pid in marked_processes(marker)}
    for pid in left:  # not to burden the next tests
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"left running {within:.0f} s after the kill: {left}"


def killed(proc) -> None:
    """kill -9 of ``proc``; not reading its output, which a process left behind would keep open."""
    proc.kill()
    proc.wait(timeout=HANG_GUARD)
    proc.stdout.close()


@pytest.mark.slow
def test_kill_9_of_a_run_leaves_no_process(data, tmp_path):
    """The loader's forkserver, its two DataLoader workers and the resource tracker die with the run."""
    marker = uuid.uuid4().hex
    proc = start(marker, "--data", data, *TINY, "-j", "2", "--out", tmp_path / "run")
    wait_line(proc, "first step done")
    wait_for_processes(proc, marker, forked=3)
    killed(proc)
    assert_none_left(marker)


def dead(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie its parent has not reaped, or gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


@pytest.mark.slow
def test_kill_9_of_one_rank_leaves_no_process_and_is_one_line(data, tmp_path):
    """kill -9 of rank 1 of --nproc 2: the other rank is stopped, nothing is left running, and kd
    blames rank 1 in one line, with exit code 128 + 9. The launcher is paused (SIGSTOP) across the
    kill, as a loaded machine delays it: rank 0, which loses its peer in the step's all-reduce, must
    not end first and take the blame with its own traceback (without loader workers, whose
    forkserver holds rank 0's end open a while)."""
    marker = uuid.uuid4().hex
    out = tmp_path / "run"
    ddp = ["--backend", "torch_ddp", "--nproc", "2", "-j", "0"]
    proc = start(marker, "--data", data, *TINY, *ddp, "--out", out)
    wait_line(proc, "first step done")
    ranks = sorted(pid for pid in marked_processes(marker) if parent(pid) == proc.pid and "spawn_main" in cmdline(pid))
    assert len(ranks) == 2, ranks  # started in rank order
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        os.kill(ranks[1], signal.SIGKILL)
        deadline = time.time() + 5.0  # it ends within 2-4 s where it does not wait for the launcher
        while not dead(ranks[0]) and time.time() < deadline:
            time.sleep(0.1)
        rank0_ended = dead(ranks[0])
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    text, _ = proc.communicate(timeout=HANG_GUARD)
    assert_none_left(marker)
    assert not rank0_ended, "rank 0 ended before the launcher saw rank 1's death: " + text
    assert proc.returncode == 137, text
    assert "Traceback" not in text and "ChildFailedError" not in text and "leaked" not in text, text
    last = text.strip().splitlines()[-1]
    assert re.match(r"kd: error: rank 1 of the run was killed by SIGKILL, and the run stopped; ", last), text
    resume = f"continue from its last checkpoint with: kd train --out {out} --resume"
    assert (resume in last or "it had written no checkpoint" in last) and "--max-restarts" in last, text


def test_a_loader_worker_is_silent_when_the_process_it_serves_dies(tmp_path):
    """A DataLoader worker hands each batch's shared memory to its training process through
    multiprocessing's resource sharer; when that process is killed in the hand-over, the sharer's
    thread in the worker printed a ConnectionResetError traceback above kd's one line. The worker's
    init (kd.data.loader.seed_worker) keeps that thread quiet, and only that thread."""
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, socket, sys, time\n"
        "from multiprocessing import resource_sharer\n"
        "from kd.data.loader import seed_worker\n"
        "seed_worker(0)\n"
        "shared = resource_sharer.DupFd(os.open(os.devnull, os.O_RDONLY))\n"
        "receiver = socket.socket(socket.AF_UNIX)\n"
        "receiver.connect(resource_sharer._resource_sharer._address)\n"
        "time.sleep(0.3)\n"  # the sharer's challenge arrives, unread: closing now resets the connection
        "receiver.close()\n"
        "time.sleep(0.5)\n"
        "raise RuntimeError('an error of the worker itself still shows')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=HANG_GUARD)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("Traceback") == 1 and "resource_sharer" not in proc.stderr, proc.stderr
    assert "RuntimeError: an error of the worker itself still shows" in proc.stderr, proc.stderr
