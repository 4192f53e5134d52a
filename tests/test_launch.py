"""Launching as users do: ``kd train --nproc 2``, torchrun, the legacy torch.distributed.launch,
srun's environment; errors from inside workers and mismatches as one line with exit code 2."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HANG_GUARD, ROOT, WORKER_ERRORS, free_port, kd_main, make_image_folder, run_kd

STUDENT = "timm:test_convnext"  # LayerNorm, no BatchNorm: N processes equal one


@pytest.fixture(scope="module")
def data9(tmp_path_factory):
    """3 classes, 24 train and 9 val images (odd: two processes get 5 and 4)."""
    return make_image_folder(tmp_path_factory.mktemp("data9"), classes=3, train_per_class=8, val_per_class=3)


@pytest.fixture(scope="module")
def teacher_file(tmp_path_factory):
    from kd import models

    torch.manual_seed(7)
    path = tmp_path_factory.mktemp("teacher") / "teacher.pt"
    torch.save(models.build(STUDENT, 3).state_dict(), path)
    return path


def train_args(data, out, teacher, *extra):
    return [
        "train",
        "--data",
        data,
        "--teacher",
        STUDENT,
        "--teacher-weights",
        teacher,
        "--student",
        STUDENT,
        "--image-size",
        32,
        "-b",
        8,
        "--epochs",
        1,
        "--device",
        "cpu",
        "--lr-schedule",
        "constant",
        "--lr",
        0.05,
        "--log-every",
        1,
        "--no-progress",
        "--out",
        out,
        *extra,
    ]


def run_files(out: Path):
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def metrics(out: Path):
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def one_line_error(r):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("kd: error: "), r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


#: two students from one teacher forward: each its own DDP module and buckets, its own gradient averager
TWO_STUDENTS = ["--kd-loss", "kd,dkd"]


@pytest.fixture(scope="module")
def two_students_in_one_process(data9, teacher_file, tmp_path_factory) -> Path:
    """The folder of :data:`TWO_STUDENTS` trained in one process (no loader workers: the same
    steps), the reference of the multi-process runs of the two."""
    one = tmp_path_factory.mktemp("one") / "run"
    r = kd_main(*train_args(data9, one, teacher_file, "-j", 0, *TWO_STUDENTS))
    assert r.returncode == 0, r.stderr
    return one


def assert_students_equal_one_process(out: Path, one: Path) -> None:
    """Every student of the multi-process run ``out`` equals the same students trained in one
    process (``one``; each student's gradients averaged by its own wrapper), and they differ from
    each other."""
    weights = {}
    for name in ("kd", "dkd"):
        assert len(metrics(out / name)) == 1 and [f for f in run_files(out / name) if not f.startswith("tb/")] == [
            "checkpoints/best.pt",
            "checkpoints/best.pt.sha256",
            "checkpoints/last.pt",
            "checkpoints/last.pt.sha256",
            "config.yaml",
            "metrics.jsonl",
            "provenance.json",
            "wall.jsonl",
        ]
        assert metrics(out / name)[0]["train_loss"] == pytest.approx(metrics(one / name)[0]["train_loss"], rel=1e-5)
        a = torch.load(one / name / "checkpoints" / "last.pt", weights_only=True)["student"]
        weights[name] = torch.load(out / name / "checkpoints" / "last.pt", weights_only=True)["student"]
        for key in a:
            torch.testing.assert_close(weights[name][key], a[key], rtol=1e-4, atol=1e-6, msg=f"{name} {key}")
    assert any(not torch.equal(weights["kd"][k], weights["dkd"][k]) for k in weights["kd"])  # two students


# ----------------------------------------------------------------------------- kd's own launcher
#: kd's launcher, two processes, each with two loader workers from kd's default start method
#: (forkserver), for two epochs: test_loader's cell of torch_ddp under forkserver is this run
#: (worker errors are looked for here)
TWO_PROCESSES_WITH_WORKERS = ["--backend", "torch_ddp", "--nproc", 2, "-j", 2, "--mp-context", "forkserver"]


@pytest.mark.slow
def test_kd_starts_two_cpu_processes_with_loader_workers_and_only_main_writes(data9, teacher_file, tmp_path):
    multi, single = tmp_path / "multi", tmp_path / "single"
    r = run_kd(*train_args(data9, multi, teacher_file, *TWO_PROCESSES_WITH_WORKERS, "--epochs", 2))
    assert r.returncode == 0, r.stderr
    for bad in WORKER_ERRORS:
        assert bad not in r.stderr, r.stderr
    assert "backend torch_ddp: 2 process(es) over gloo" in r.stderr
    assert r.stderr.count("precision O0") == 1  # the other process is quiet
    files = run_files(multi)
    assert [f for f in files if f.startswith("tb/")] and len([f for f in files if f.startswith("tb/")]) == 1, files
    assert [f for f in files if not f.startswith("tb/")] == [
        "checkpoints/best.pt",
        "checkpoints/best.pt.sha256",
        "checkpoints/last.pt",
        "checkpoints/last.pt.sha256",
        "config.yaml",
        "metrics.jsonl",
        "provenance.json",
        "wall.jsonl",
    ], files
    assert len(metrics(multi)) == 2  # both epochs

    # the one-process reference (no workers: the same steps)
    r = kd_main(*train_args(data9, single, teacher_file, "-j", 0, "--epochs", 2))
    assert r.returncode == 0, r.stderr
    one, two = metrics(single), metrics(multi)
    assert two[0]["teacher_top1"] == one[0]["teacher_top1"]  # the same fixed teacher, 9 images over 2 processes
    assert [m["train_loss"] for m in two] == pytest.approx([m["train_loss"] for m in one], rel=1e-5)
    a = torch.load(single / "checkpoints" / "last.pt", weights_only=True)["student"]
    b = torch.load(multi / "checkpoints" / "last.pt", weights_only=True)["student"]
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_error_inside_a_worker_is_one_line_and_exit_2(data9, teacher_file, tmp_path):
    r = run_kd(
        *train_args(
            data9, tmp_path / "run", teacher_file, "--backend", "torch_ddp", "--nproc", 2, "-j", 0, "--num-classes", 5
        )
    )
    assert "--num-classes 5 but" in one_line_error(r)
    assert not (tmp_path / "run" / "config.yaml").exists()


# ----------------------------------------------------------------------------- torchrun, legacy launch, srun
def _run_module(args, env=None, timeout=HANG_GUARD):
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", *map(str, args)], env=full_env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "legacy"])
def test_started_by_torchrun_or_torch_distributed_launch(launcher, data9, teacher_file, tmp_path, request):
    out = tmp_path / "run"
    if launcher == "torchrun":
        head = ["torch.distributed.run", "--standalone", "--nproc_per_node", 2]
    else:  # passes --local-rank=N to every process
        head = ["torch.distributed.launch", "--nproc_per_node", 2, "--master_port", free_port()]
    students = TWO_STUDENTS if launcher == "torchrun" else []
    r = _run_module(
        [*head, "-m", "cli", *train_args(data9, out, teacher_file, "--backend", "torch_ddp", "-j", 0, *students)],
        env={"OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "backend torch_ddp: 2 process(es) over gloo" in r.stderr
    if not students:
        assert len(metrics(out)) == 1 and (out / "checkpoints" / "last.pt").is_file()
        return
    assert_students_equal_one_process(out, request.getfixturevalue("two_students_in_one_process"))


def srun_env(rank: int, port: int, **extra):
    """The environment srun gives task ``rank`` of two on this node (torchrun's variables removed)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURMD_NODENAME": "localhost",
        "MASTER_PORT": str(port),
        **extra,
    }
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        env.pop(name, None)
    return env


@pytest.mark.slow
def test_started_by_srun_apex_ddp_with_loader_workers_two_students(
    data9, teacher_file, two_students_in_one_process, tmp_path
):
    """Two tasks with srun's environment: kd starts no process of its own and uses both as ranks."""
    out, port = tmp_path / "run", free_port()
    args = train_args(data9, out, teacher_file, "--backend", "apex_ddp", "-j", 2, *TWO_STUDENTS)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "cli", *map(str, args)],
            env=srun_env(rank, port),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in (0, 1)
    ]
    results = [(p.wait(timeout=HANG_GUARD), *p.communicate()) for p in procs]
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2][-2000:] + results[1][2][-2000:]
    main_log, other_log = results[0][2], results[1][2]
    assert "backend apex_ddp: 2 process(es) over gloo, rank 0" in main_log
    assert "native" in main_log and "epoch 1/1" in main_log
    assert "epoch 1/1" not in other_log and "precision" not in other_log
    assert_students_equal_one_process(out, two_students_in_one_process)


@pytest.mark.slow
def test_started_by_srun_every_task_refuses_a_used_out_at_once(data9, teacher_file, tmp_path):
    """Every rank checks --out (read-only): none waits KD_DIST_TIMEOUT for a rank 0 that refused."""
    out, port = tmp_path / "run", free_port()
    out.mkdir()
    (out / "config.yaml").write_text("epochs: 1\n")
    args = train_args(data9, out, teacher_file, "--backend", "torch_ddp", "-j", 0)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "cli", *map(str, args)],
            text=True,
            env=srun_env(rank, port, KD_DIST_TIMEOUT="120"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in (0, 1)
    ]
    try:
        results = [p.communicate(timeout=HANG_GUARD) for p in procs]  # liveness, not speed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 2, err[-2000:]
        assert "already holds a run (config.yaml)" in err and "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml"]


# ----------------------------------------------------------------------------- mismatches, before any work
@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "dp", "--nproc", 2], "--backend dp runs one process .* needs --backend torch_ddp or apex_ddp"),
        (
            ["--backend", "torch_ddp", "--device", "auto", "--gpus", "0,7"],
            "GPU 7 does not exist|0,7: no such GPU|0,7 asks for a CUDA GPU, but none",
        ),
        (
            ["--backend", "single", "--local_rank", 0, "--nproc", 2],
            "--backend single runs one process; --nproc 2 needs torch_ddp or apex_ddp",
        ),
        (["--backend", "dp", "--local-rank", 0, "--device", "cpu"], "dp needs CUDA GPUs"),
        (["--backend", "apex_ddp", "--nproc", 2, "--sync-bn"], "--sync-bn needs CUDA"),
        (
            ["--backend", "dp", "--device", "cpu", "--amp-impl", "apex", "--opt", "O2"],
            "--backend dp cannot run --amp-impl apex at O2: .* every replica",
        ),
        (["--backend", "torch_ddp", "--nproc", 2, "--set", "dist_backend=nccl"], "dist_backend=nccl needs CUDA"),
    ],
)
def test_mismatch_is_one_line_exit_2_before_any_work(args, message, data9, teacher_file, tmp_path):
    if "--gpus" in args and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a GPU 7")
    out = tmp_path / "run"
    r = kd_main(*train_args(data9, out, teacher_file, "-j", 0, *args))  # refused before any process starts
    assert re.search(message, one_line_error(r))
    assert not out.exists() or not any(out.iterdir())


# ----------------------------------------------------------------------------- GPUs
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("backend", ["torch_ddp", "apex_ddp"])
def test_two_gpus_nccl(backend, data9, teacher_file, tmp_path):
    out = tmp_path / "run"
    gpus = ",".join(str(i) for i in range(torch.cuda.device_count())[-2:])  # a subset that need not start at 0
    r = run_kd(*train_args(data9, out, teacher_file, "--device", "cuda", "--backend", backend, "--gpus", gpus))
    assert r.returncode == 0, r.stderr
    assert "2 process(es) over nccl" in r.stderr


# Rank 1 fails as its set-up begins; rank 0 waits for it in Python until the launcher stops it (in
# the real set-up it would wait inside the process group's start, which takes no signal: the agent
# would kill it only after its 30 s shutdown wait, the same result 30 s later).
CRASHING_RANK = """
import errno, sys, time
import kd.run.launch as launch
from kd.utils.placement import Placement

real_worker = launch.worker

def failing_worker(*args):
    def fail(*a, **k):
        if Placement.from_environment(None).rank == 1:
            if sys.argv[1] == "crash":
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\\nmore detail")
            raise OSError(errno.ENOSPC, "No space left on device", "run/metrics.jsonl")
        while True:
            time.sleep(0.05)
    launch._worker = fail
    return real_worker(*args)

if __name__ == "__main__":
    launch.worker = failing_worker
    import cli
    sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["crash", "full disk"])
def test_a_rank_failing_outside_kd_s_errors_is_one_line_with_its_cause(fault, data9, teacher_file, tmp_path):
    """An error kd does not translate (an out-of-memory, a bug) in one rank: one line naming it,
    the rank's traceback kept above; a full disk in a rank: kd's full-disk line."""
    script = tmp_path / "failing_rank.py"
    script.write_text(CRASHING_RANK)
    args = train_args(data9, tmp_path / "run", teacher_file, "--backend", "torch_ddp", "--nproc", 2, "-j", 0)
    r = _run_module([script.stem, fault.split()[0], *args], env={"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"})
    last = r.stderr.strip().splitlines()[-1]
    assert "ChildFailedError" not in r.stderr, r.stderr[-3000:]
    if fault == "crash":
        assert r.returncode == 1, r.stderr[-3000:]
        assert last.startswith("kd: error: rank 1 of the run failed with RuntimeError: CUDA out of memory."), last
        assert "more detail" not in last and "Traceback" in r.stderr  # the rank's own traceback, above
    else:
        assert r.returncode == 2, r.stderr[-3000:]
        expected = (
            "cannot write run/metrics.jsonl: no space left on the device; free space, then continue with --resume"
        )
        assert last == f"kd: error: {expected}", last
        assert "Traceback" not in r.stderr, r.stderr[-3000:]


def test_a_rank_that_said_its_error_before_a_signal_ended_for_its_error(tmp_path):
    """A rank that wrote its one-line error (a non-finite stop) and then aborted as it exited (an
    'terminate called without an active exception' in a library thread, seen under load) is not
    reported as killed: the run's line is the error it wrote; a rank killed without one is."""
    from types import SimpleNamespace

    from kd.run.launch import rank_killed

    job = SimpleNamespace(cfg=SimpleNamespace(max_restarts=0), how_to_continue=lambda: "start it again")
    failures = {0: SimpleNamespace(exitcode=2), 1: SimpleNamespace(exitcode=-6)}
    assert rank_killed(failures, job, str(tmp_path)) is not None  # no word from rank 1: killed by SIGABRT
    (tmp_path / "rank00001.txt").write_text("loss not finite for 4 steps", encoding="utf-8")
    assert rank_killed(failures, job, str(tmp_path)) is None
