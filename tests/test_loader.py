"""DataLoader workers (kd.data.loader) are safe under every backend and start method; the naive KD pattern
is not."""

from __future__ import annotations

import multiprocessing
import pickle

import pytest
import torch
from conftest import HANG_GUARD, WORKER_ERRORS, kd_main, make_image_folder, run_kd, train_args
from torch.utils.data import DataLoader, Dataset


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("workers"), classes=2, train_per_class=8, val_per_class=3)


#: the teacher and student of the runs with workers, which never see the models: squeezenet1_1
#: checkpoints a tenth of resnet18's weights and took the least CPU of the torchvision models tried
SMALL_PAIR = dict(teacher="squeezenet1_1", student="squeezenet1_1")

#: the backends and start methods of this file's runs. torch_ddp under forkserver is test_launch's
#: run of kd's launcher with workers (test_kd_starts_two_cpu_processes_with_loader_workers_and_only_main_writes:
#: the same options for two epochs, its worker errors looked for there), which compares it with one
#: process too. apex_ddp is left out: it starts its processes, shards the data and starts their
#: workers as torch_ddp does (both are backends.process_group's, of one launcher; they differ only
#: in how the gradients are averaged), and test_launch's srun run trains apex_ddp with workers under
#: kd's default start method.
CELLS = [("fork", "single"), ("fork", "torch_ddp"), ("forkserver", "single")]


@pytest.mark.slow
@pytest.mark.parametrize("context,backend", CELLS)
def test_two_workers_under_every_backend_and_start_method(data, tmp_path, backend, context):
    """fork and forkserver (Linux; kd's default); spawn, where every worker imports torch, in
    tests/test_loader_spawn.py (its own file, so that pytest -n runs the two on two workers)."""
    train_two_epochs_with_two_workers(data, tmp_path, backend, context)


def train_two_epochs_with_two_workers(data, tmp_path, backend: str, context: str) -> None:
    """``kd train -j 2 --mp-context CONTEXT --backend BACKEND`` (two processes for torch_ddp and
    apex_ddp) for two epochs: no worker error, both epochs logged."""
    procs = [] if backend == "single" else ["--nproc", "2"]
    options = dict(batch_size=4, epochs=2, workers=2, mp_context=context, backend=backend, **SMALL_PAIR)
    r = run_kd(*train_args(data, tmp_path / "run", *procs, **options))
    assert r.returncode == 0, r.stderr
    for bad in WORKER_ERRORS:
        assert bad not in r.stderr, r.stderr
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


class _Images(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.full((3, 4, 4), float(i)), i % 2


def _iterate(collate):
    """Every batch of a DataLoader with one spawned worker (a fresh interpreter that imports this
    file to unpickle the dataset and ``collate``)."""
    loader = DataLoader(
        _Images(),
        batch_size=4,
        num_workers=1,
        collate_fn=collate,
        multiprocessing_context=multiprocessing.get_context("spawn"),
    )
    return [batch for batch in loader]


def test_naive_lambda_collate_fails_under_spawn_and_ours_works():
    """The usual KD script passes a lambda collate; spawn/forkserver workers cannot pickle it."""
    from kd.data.folder import collate

    # AttributeError up to Python 3.13, pickle.PicklingError from 3.14 on: the same refusal
    with pytest.raises((AttributeError, pickle.PicklingError), match="Can't pickle local object"):
        _iterate(lambda batch: torch.utils.data.default_collate(batch))
    batches = _iterate(lambda_free_collate)
    assert len(batches) == 2 and batches[0][0].shape == (4, 3, 4, 4)
    assert callable(collate) and collate.__module__ == "kd.data.folder"  # ours is module-level too


def lambda_free_collate(batch):
    return torch.utils.data.default_collate(batch)


def test_worker_seeds_differ_across_workers_ranks_and_epochs():
    from kd.data.sampler import SeededSampler

    seeds = {}
    for rank in (0, 1):
        s = SeededSampler(16, 2, rank, shuffle=True, seed=3, pad=True)
        for epoch in (0, 1):
            s.set_epoch(epoch)
            seeds[(rank, epoch)] = [seed for _, seed in s]
    flat = [x for v in seeds.values() for x in v]
    assert len(set(flat)) == len(flat)  # every (rank, epoch, sample) its own seed
    again = SeededSampler(16, 2, 0, shuffle=True, seed=3, pad=True)
    again.set_epoch(1)
    assert [seed for _, seed in again] == seeds[(0, 1)]  # reproducible from --seed


def test_corrupt_image_is_skipped_named_and_counted(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = make_image_folder(tmp_path / "data", classes=2, train_per_class=6, val_per_class=2)
    broken = data / "train" / "class_00" / "001.jpg"
    broken.write_bytes(broken.read_bytes()[:40])  # truncated JPEG
    options = dict(batch_size=4, workers=2, log_every=1, **SMALL_PAIR)
    r = kd_main(*train_args(data, tmp_path / "ok", **options))
    assert r.returncode == 0, r.stderr
    assert f"skipped unreadable image {broken}" in r.stderr
    events = EventAccumulator(str(tmp_path / "ok" / "tb"))
    events.Reload()
    assert events.Scalars("train/bad_images")[-1].value == 1
    r = kd_main(*train_args(data, tmp_path / "strict", max_bad_images=0, **options))
    assert r.returncode == 2 and "more than --max-bad-images 0" in r.stderr, r.stderr


WORKER_SIDE = """
import pickle, sys
for dataset, collate, init in pickle.load(open(sys.argv[1], "rb")):
    init(0)
    collate([dataset[(0, 1)], dataset[(1, 2)]])  # what a worker does: (index, seed) -> sample, then a batch
heavy = ("torchvision", "timm", "tensorboard", "kd.run.loop", "kd.models", "kd.data.gpu", "kd.data.pipeline")
print(" ".join(sorted(m for m in sys.modules if m in heavy)))
"""


def test_a_spawned_worker_imports_only_what_it_reads_images_with(data, tmp_path):
    """A spawn or forkserver worker (Python 3.14's default on Linux) imports the modules its dataset is
    pickled from: the datasets of both loaders load without torchvision, timm or the engine."""
    import os
    import pickle
    import subprocess
    import sys

    from conftest import ROOT

    from kd.data.bytes_dataset import JpegBytes, collate_packed
    from kd.data.folder import ImageFolderPIL, collate
    from kd.data.layout import scan
    from kd.data.loader import seed_worker

    _, train, _ = scan(str(data))
    jobs = [
        (ImageFolderPIL(train, 16, True), collate, seed_worker),
        (JpegBytes(train, 16, True), collate_packed, seed_worker),
    ]
    (tmp_path / "jobs.pkl").write_bytes(pickle.dumps(jobs))
    r = subprocess.run(
        [sys.executable, "-c", WORKER_SIDE, str(tmp_path / "jobs.pkl")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=HANG_GUARD,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [], r.stdout


class _Niceness(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, item):
        import os

        return os.nice(0)


def test_workers_run_nicer_than_the_training_process(tmp_path, monkeypatch):
    """When the workers keep every core busy, the threads that feed the GPU still get a core at once."""
    import os

    monkeypatch.delenv("KD_WORKER_NICE", raising=False)  # conftest turns it off under pytest-xdist

    from kd import config as kd_config
    from kd.data.loader import WORKER_NICE, Shard, dataloader_and_sampler

    cfg = kd_config.resolve(
        options=dict(data="synthetic", no_teacher=True, student="resnet18", workers=1, mp_context="fork")
    )
    loader, _ = dataloader_and_sampler(cfg, _Niceness(), list, False, Shard(1, 0, 2, torch.device("cpu")))
    (worker_nice,) = {n for batch in loader for n in batch}
    assert worker_nice == min(19, os.nice(0) + WORKER_NICE)


@pytest.mark.parametrize(
    "cores,processes,local,expected",
    [
        (16, 1, None, 15),  # one H200 machine: the fastest measured, -j 15
        (2, 1, None, 1),
        (1, 1, None, 1),  # never none: the training thread shares the core
        (128, 8, None, 15),  # 8 GPUs, one process each
        (128, 16, "8", 15),  # two such hosts: the cores are this host's, shared by its 8 processes only
        (256, 1, None, 32),  # capped
    ],
)
def test_default_workers_are_this_hosts_cores_per_process_less_one(monkeypatch, cores, processes, local, expected):
    from kd import config as kd_config
    from kd.data.loader import worker_count

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr("kd.data.loader.cgroup_cpu_limit", lambda: None)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    cfg = kd_config.RunConfig()
    assert worker_count(cfg, processes) == expected
    assert worker_count(kd_config.RunConfig(workers=3), processes) == 3


def test_default_workers_see_a_containers_cpu_quota_and_slurms_cores_per_task(monkeypatch, tmp_path):
    """A pod limited to 8 CPUs on a 96-core node sees all 96 in its affinity; a Slurm task with
    --cpus-per-task has its cores to itself (dividing them by the tasks on the node again left one)."""
    from kd import config as kd_config
    from kd.data.loader import cgroup_cpu_limit, worker_count

    (tmp_path / "cpu.max").write_text("800000 100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) == 8
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("250000")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cgroup_cpu_limit(str(v1)) == 3
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(96)), raising=False)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr("kd.data.loader.cgroup_cpu_limit", lambda: 8)
    assert worker_count(kd_config.RunConfig(), 1) == 7
    monkeypatch.setattr("kd.data.loader.cgroup_cpu_limit", lambda: None)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "12")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert worker_count(kd_config.RunConfig(), 16) == 11
