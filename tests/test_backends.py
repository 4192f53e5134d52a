"""Backends for real: two gloo processes on the CPU against one process, with tiny test models.

The multi-process tests start two processes with torch.multiprocessing (no mocks of
torch.distributed), give them torchrun's environment and run the engine's own entry point
(``kd.run.launch.worker``) there, one job after another. The models are registered with timm, as a
user registers their own models, so ``--student timm:kd_test_net`` works in every process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as tmp
from conftest import HANG_GUARD, free_port, last_checkpoint, make_image_folder
from torch import nn

import backends
import kd
from backends import dist as kd_dist
from backends.apex_ddp import GradientAverager
from backends.process_group import parameters_without_grad
from kd import config as kd_config
from kd.errors import KDError
from kd.precision import Precision
from kd.utils.placement import Placement


# ----------------------------------------------------------------------------- tiny models
class TinyNet(nn.Module):
    """Two convolutions and a head: no BatchNorm, no dropout, so N processes equal one exactly."""

    def __init__(self, num_classes: int = 10, spare: bool = False):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, 2, 1),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, 2, 1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.fc = nn.Linear(8, num_classes)
        self.spare = nn.Linear(8, 8) if spare else None  # never used: gets no gradient

    def forward(self, x):
        return self.fc(self.body(x))


class BnNet(nn.Module):
    """TinyNet with BatchNorm: each process's running statistics follow its own shard."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, 2, 1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, 2, 1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.fc(self.body(x))


def _register_models():
    import timm
    from timm.models import register_model

    if "kd_test_net" in timm.list_models():
        return

    @register_model
    def kd_test_net(pretrained=False, num_classes=10, **kwargs):
        return TinyNet(num_classes)

    @register_model
    def kd_test_unused(pretrained=False, num_classes=10, **kwargs):
        return TinyNet(num_classes, spare=True)

    @register_model
    def kd_test_bn(pretrained=False, num_classes=10, **kwargs):
        return BnNet(num_classes)


_register_models()


# ----------------------------------------------------------------------------- two processes
def _run_jobs(rank: int, world: int, jobs, error_root: str):
    """One spawned process: torchrun's variables, then each job in turn."""
    from kd.run.jobs import TrainJob
    from kd.run.launch import worker
    from kd.run.students import Students

    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        KD_DIST_TIMEOUT="120",
    )
    for job in jobs:
        os.environ["MASTER_PORT"] = str(job["port"])
        if job["kind"] == "train":
            error_dir = Path(error_root, job["name"])
            error_dir.mkdir(parents=True, exist_ok=True)
            try:
                worker(TrainJob(Students.alone(job["cfg"])), str(error_dir), None)
            except SystemExit:
                pass  # the error file says why; the next job gets a fresh process group
        else:
            job["fn"](job)


def _eval_job(job):
    """top-1/top-5 of a fixed model over a val set whose size is odd, on torch_ddp's process group."""
    backend = backends.get("torch_ddp")(job["cfg"])
    backend.setup()
    try:
        result = evaluate_fixed(job["cfg"], backend)
        if backend.is_main:
            torch.save(result, job["result"])
    finally:
        backend.teardown()


def _failing_eval_job(job):
    """Rank 1's forward raises (an OOM, say) at its first batch: both ranks raise, and the next
    evaluation on the same process group is still exact (the ranks stayed in step)."""
    from kd.utils.accuracy import evaluate

    backend = backends.get("torch_ddp")(job["cfg"])
    backend.setup()
    try:
        rank = backend.rank

        def broken(images):
            if rank == 1:
                raise RuntimeError("CUDA out of memory (simulated)")
            return torch.zeros(len(images), 7)

        raised = ""
        try:
            evaluate(broken, fixed_loader(job["cfg"], backend), backend, Precision(backend.device))
        except RuntimeError as exc:
            raised = str(exc)
        after = evaluate_fixed(job["cfg"], backend)
        torch.save({"raised": raised, "after": after}, Path(job["result"]).with_suffix(f".{rank}"))
    finally:
        backend.teardown()


def _averager_job(job):
    """Rank 1 lacks the gradient of ``b``; nobody has one for ``c``."""
    backend = backends.get("apex_ddp")(job["cfg"])
    backend.setup()
    try:
        a, b, c = (nn.Parameter(torch.zeros(3)) for _ in range(3))
        a.grad = torch.full((3,), float(backend.rank + 1))  # 1 and 2: mean 1.5
        if backend.rank == 0:
            b.grad = torch.full((3,), 4.0)  # 4 and (missing) 0: mean 2
        GradientAverager([a, b, c], backend.world_size, cap_bytes=16)()
        torch.save({"a": a.grad, "b": b.grad, "c": c.grad}, Path(job["result"]).with_suffix(f".{backend.rank}"))
    finally:
        backend.teardown()


def _rng_job(job):
    """The Trainer's set-up on torch_ddp, then a draw from torch's generator (the one dropout uses)."""
    from kd.run.loop import Trainer
    from kd.run.students import Students

    backend = backends.get("torch_ddp")(job["cfg"])
    backend.setup()
    trainer = None
    try:
        trainer = Trainer(Students.alone(job["cfg"]), backend)
        torch.save(torch.rand(8), Path(job["result"]).with_suffix(f".{backend.rank}"))
    finally:
        if trainer is not None:
            trainer.stop.restore()
            trainer.lane.logger.close()
        backend.teardown()


def fixed_loader(cfg, backend):
    from kd.data.layout import scan_split
    from kd.data.loader import Shard, make_pil_loader

    _, samples = scan_split(Path(cfg.data), "val")
    num_replicas, rank = backend.data_shard()
    return make_pil_loader(cfg, samples, False, Shard(num_replicas, rank, 4, backend.device, False))


def evaluate_fixed(cfg, backend):
    from kd.utils.accuracy import evaluate

    torch.manual_seed(123)
    net = TinyNet(7).eval()
    return evaluate(net, fixed_loader(cfg, backend), backend, Precision(backend.device))


TINY = dict(
    image_size=32,
    batch_size=8,
    workers=0,
    lr=0.2,
    momentum=0.9,
    weight_decay=1e-3,
    lr_schedule="constant",
    device="cpu",
    log_every=1,
    seed=3,
    no_teacher=True,
    epochs=1,
    progress_bar=False,
    student="timm:kd_test_net",
)


def tiny_cfg(data, out, **kw):
    return kd_config.resolve(options={**TINY, "data": str(data), "out": str(out), **kw})


@pytest.fixture(scope="module")
def data7(tmp_path_factory):
    """7 classes: 28 train images, 21 val images (odd, so two processes get 11 and 10)."""
    return make_image_folder(tmp_path_factory.mktemp("data7"), classes=7, train_per_class=4, val_per_class=3)


JOBS = {  # name: (student, backend, find_unused_parameters)
    "ddp_equal": ("timm:kd_test_net", "torch_ddp", None),
    "apex_equal": ("timm:kd_test_net", "apex_ddp", None),
    "ddp_unused_flag": ("timm:kd_test_unused", "torch_ddp", True),
    "ddp_unused_detect": ("timm:kd_test_unused", "torch_ddp", None),
    "apex_unused": ("timm:kd_test_unused", "apex_ddp", None),
    "apex_bn": ("timm:kd_test_bn", "apex_ddp", None),
    "ddp_bn": ("timm:kd_test_bn", "torch_ddp", None),
    "ddp_repaug": ("timm:kd_test_net", "torch_ddp", None),
    "ddp_unused_noflag": ("timm:kd_test_unused", "torch_ddp", False),  # fails: last, as it ends mid-run
}
OPTIONS = {"ddp_repaug": dict(repeated_aug=3)}  # a job's further options


@pytest.fixture(scope="module")
def two_process_runs(data7, tmp_path_factory):
    """Every job of JOBS and of ``checks`` (evaluations, averaging, RNG draws) in the same two processes."""
    root = tmp_path_factory.mktemp("two")
    checks = [  # kind, function, folder, result file, backend
        ("eval", _eval_job, "eval", "eval.pt", "torch_ddp"),
        ("eval_fail", _failing_eval_job, "eval_fail", "eval_fail", "torch_ddp"),
        ("averager", _averager_job, "avg", "avg", "apex_ddp"),
        ("rng", _rng_job, "rng", "rng", "torch_ddp"),
    ]
    jobs = [
        {
            "kind": kind,
            "fn": fn,
            "port": free_port(),
            "result": str(root / result),
            "cfg": tiny_cfg(data7, root / folder, backend=backend),
        }
        for kind, fn, folder, result, backend in checks
    ]
    for name, (student, backend, unused) in JOBS.items():
        cfg = tiny_cfg(
            data7,
            root / name,
            student=student,
            backend=backend,
            find_unused_parameters=unused,
            limit_train_batches=2,
            **OPTIONS.get(name, {}),
        )
        (root / name).mkdir()  # what the parent's prepare_out does before a launch
        jobs.append({"kind": "train", "name": name, "cfg": cfg, "port": free_port()})
    tmp.spawn(_run_jobs, args=(2, jobs, str(root / "errors")), nprocs=2, join=True)
    return root


def errors_of(root: Path, name: str):
    return [p.read_text() for p in sorted((root / "errors" / name).glob("rank*.txt"))]


def single_run(data, out, **kw):
    kd.train(tiny_cfg(data, out, limit_train_batches=2, **kw))
    return last_checkpoint(out)["student"]


# ----------------------------------------------------------------------------- registry, cheap units
def test_every_backend_is_registered_and_reported():
    rows = {name: (ok, note) for name, ok, note in backends.report()}
    assert set(rows) >= {"single", "dp", "torch_ddp", "apex_ddp"}
    assert rows["single"][0] and rows["torch_ddp"][0] and rows["apex_ddp"][0]
    if not torch.cuda.is_available():
        assert rows["dp"] == (False, "needs CUDA GPUs, and none is usable here")
    assert "native implementation" in rows["apex_ddp"][1] or "real apex.parallel" in rows["apex_ddp"][1]


def test_kd_backends_command(capsys):
    from cli import main

    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    for name in ("single", "dp", "torch_ddp", "apex_ddp"):
        assert name in out
    line = next(line for line in out.splitlines() if line.startswith("apex_ddp"))
    assert "native implementation" in line or "real apex.parallel" in line


def test_single_process_backend_refuses_a_multi_process_launch(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    cfg = tiny_cfg("synthetic", tmp_path / "run")
    with pytest.raises(KDError, match="2 processes were started .* --backend single runs in one"):
        kd.train(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["torch_ddp", "apex_ddp"])
def test_multi_process_backend_as_one_process_equals_single(name, data7, tmp_path):
    """``--nproc 1`` (or one GPU): the backend runs in place, on a one-process group."""
    single = single_run(data7, tmp_path / "single")
    alone = single_run(data7, tmp_path / name, backend=name, nproc=1)
    for key in single:
        torch.testing.assert_close(alone[key], single[key], rtol=1e-6, atol=1e-7)
    assert not torch.distributed.is_initialized()  # teardown destroyed the group


def test_unknown_backend_lists_the_names():
    with pytest.raises(KDError, match="choose from: apex_ddp, dp, single, torch_ddp"):
        backends.get("ddp2")


def test_buckets_group_by_dtype_and_cap():
    ts = [torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(100), torch.zeros(1)]
    assert kd_dist.buckets(ts, cap_bytes=32) == [[0, 1], [3], [4], [2]]


def test_probe_finds_the_unused_parameter_and_leaves_the_model_alone():
    torch.manual_seed(0)
    net = nn.Sequential(TinyNet(3, spare=True), nn.BatchNorm1d(3)).train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    rng = torch.get_rng_state()
    assert parameters_without_grad(net, 16) == ["0.spare.weight", "0.spare.bias"]
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())  # BN statistics untouched
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in net.parameters())


def test_process_device_refuses_nproc_that_disagrees_with_the_launcher():
    cfg = kd_config.resolve(options={**TINY, "data": "synthetic", "out": "x", "student": "resnet18", "nproc": 3})
    place = Placement(rank=0, world_size=2, local_rank=0, local_world_size=2, launched=True)
    with pytest.raises(KDError, match="started 2 process.*--nproc is 3"):
        kd_dist.process_device(cfg, place, "cpu")
    assert kd_dist.process_device(dataclasses.replace(cfg, nproc=2), place, "cpu") == torch.device("cpu")


def test_dp_refuses_nproc_cpu_and_sync_bn():
    dp = backends.get("dp")
    base = kd_config.resolve(options={**TINY, "data": "synthetic", "out": "x", "student": "resnet18"})
    with pytest.raises(KDError, match="--nproc 2 needs --backend torch_ddp or apex_ddp"):
        dp.num_processes(dataclasses.replace(base, device="auto", nproc=2))
    with pytest.raises(KDError, match="on the CPU use --backend torch_ddp --nproc N --device cpu"):
        dp.num_processes(base)
    with pytest.raises(KDError, match="--sync-bn needs a process group"):
        dp.num_processes(dataclasses.replace(base, device="auto", sync_bn=True))


def test_dist_backend_is_gloo_where_processes_share_a_gpu():
    cfg = kd_config.resolve(options={**TINY, "data": "synthetic", "out": "x", "student": "resnet18"})
    assert kd_dist.group_backend(cfg, "cuda", 2, 2) == ("nccl", "")
    assert kd_dist.group_backend(cfg, "cuda", 2, 1) == ("gloo", "2 processes share 1 GPU(s)")
    assert kd_dist.group_backend(cfg, "cuda", 1, None) == ("nccl", "")
    assert kd_dist.group_backend(cfg, "cpu", 2, None) == ("gloo", "")
    gloo = kd_config.resolve(sets=["dist_backend=gloo"], base=cfg)
    assert kd_dist.group_backend(gloo, "cuda", 2, 2) == ("gloo", "")
    nccl = kd_config.resolve(sets=["dist_backend=nccl"], base=cfg)
    with pytest.raises(KDError, match="dist_backend=nccl runs one process per GPU, and 2 processes share 1 GPU"):
        kd_dist.group_backend(nccl, "cuda", 2, 1)
    with pytest.raises(KDError, match="dist_backend=nccl needs CUDA"):
        kd_dist.group_backend(nccl, "cpu", 2, None)
    with pytest.raises(KDError, match="dist_backend must be auto, nccl or gloo, got 'mpi'"):
        kd_dist.group_backend(dataclasses.replace(cfg, dist_backend="mpi"), "cpu", 1, None)


def test_apex_ddp_takes_the_native_averager_where_real_apex_would_be_wrong(tmp_path):
    """Real apex.parallel drops bfloat16 gradients and buckets only the gradients present; apex_ddp
    then uses kd's averager (decided on a real one-process group, before the optimizer exists)."""
    backend = backends.get("apex_ddp")(tiny_cfg("synthetic", tmp_path / "a", backend="apex_ddp", nproc=1))
    backend.setup()
    try:
        assert backend.native_reason(TinyNet(7)) is None
        why = backend.native_reason(TinyNet(7, spare=True))
        assert "2 parameter(s) without gradient: spare.weight, spare.bias" in why
    finally:
        backend.teardown()
    given = backends.get("apex_ddp")(
        tiny_cfg("synthetic", tmp_path / "b", backend="apex_ddp", find_unused_parameters=True)
    )
    assert "find_unused_parameters (given)" in given.native_reason(TinyNet(7))
    bf16 = backends.get("apex_ddp")(
        tiny_cfg("synthetic", tmp_path / "c", backend="apex_ddp", opt="O2", amp_dtype="bfloat16")
    )
    assert "bfloat16" in bf16.native_reason(TinyNet(7))


class _Meet(nn.Module):
    """Holds each thread until the other arrives, so both replicas run with both taps in place."""

    def __init__(self, barrier: threading.Barrier):
        super().__init__()
        self.barrier = barrier

    def forward(self, x):
        self.barrier.wait(timeout=HANG_GUARD)
        return x


def replicate_in_place(module: nn.Module) -> nn.Module:
    """torch.nn.parallel.replicate minus the copies to other GPUs: every module's own
    ``_replicate_for_data_parallel()`` (a shallow copy of its ``__dict__``), children and parameters set anew."""
    copies = {m: m._replicate_for_data_parallel() for m in module.modules()}
    for m, replica in copies.items():
        for name, child in m._modules.items():
            setattr(replica, name, copies[child])
        for name, p in m._parameters.items():
            setattr(replica, name, p.view_as(p))  # a non-leaf, as torch's broadcast copies are
    return copies[module]


def test_feature_taps_of_data_parallel_replicas_stay_apart():
    """Replicas share their modules' hook dicts; each tap keeps the output of its own replica only."""
    from kd.utils.taps import _keep_output, tap

    torch.manual_seed(0)
    meet = threading.Barrier(2)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), _Meet(meet), nn.ReLU(), _Meet(meet))
    replicas = [replicate_in_place(net) for _ in range(2)]
    inputs = [torch.randn(2, 3, 8, 8) for _ in range(2)]
    stores = [{}, {}]

    def run(i):
        with tap(replicas[i], ["2"], stores[i]):
            replicas[i](inputs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with torch.no_grad():
        for store, x in zip(stores, inputs):
            torch.testing.assert_close(store["2"], torch.relu(net[0](x)))
    assert list(net[2]._forward_hooks.values()) == [_keep_output]  # one hook serves every replica


# ----------------------------------------------------------------------------- two real processes
@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp_equal", "apex_equal", "ddp_repaug"])
def test_two_processes_equal_one_after_the_same_steps(two_process_runs, data7, tmp_path, name):
    """Same seed and global batch: after two optimizer steps (SGD, momentum, weight decay) the
    student of torch_ddp / apex_ddp (native) equals that of one process; with --repeated-aug too,
    whose batches differ from those without."""
    assert not errors_of(two_process_runs, name)
    single = single_run(data7, tmp_path / "single", student="timm:kd_test_net", **OPTIONS.get(name, {}))
    multi = last_checkpoint(two_process_runs / name)["student"]
    if name in OPTIONS:
        plain = last_checkpoint(two_process_runs / "ddp_equal")["student"]
        assert any(not torch.allclose(plain[key], multi[key]) for key in plain)
    torch.manual_seed(TINY["seed"])  # as the Trainer does before building the student
    init = TinyNet(7)
    assert single.keys() == multi.keys()
    changed = 0
    for key in single:
        torch.testing.assert_close(multi[key], single[key], rtol=1e-5, atol=1e-6)
        changed += int(not torch.allclose(single[key], init.state_dict()[key]))
    assert changed == len(single)
    log = (two_process_runs / name / "config.yaml").read_text()
    assert f"backend: {JOBS[name][1]}" in log


@pytest.mark.slow
def test_unused_parameter_trains_with_the_flag_detected_and_under_apex(two_process_runs, data7, tmp_path):
    for name in ("ddp_unused_flag", "ddp_unused_detect", "apex_unused"):
        assert not errors_of(two_process_runs, name), name
        assert (two_process_runs / name / "checkpoints" / "last.pt").is_file(), name
    # apex_ddp: a gradient nobody has stays missing, as on one device (no weight decay on it)
    single = single_run(data7, tmp_path / "single", student="timm:kd_test_unused")
    apex = last_checkpoint(two_process_runs / "apex_unused")["student"]
    for key in single:
        torch.testing.assert_close(apex[key], single[key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_unused_parameter_without_the_flag_says_what_to_do(two_process_runs):
    errors = errors_of(two_process_runs, "ddp_unused_noflag")
    assert len(errors) == 2
    assert all("--find-unused-parameters" in e and "apex_ddp" in e for e in errors)
    assert "\n" not in errors[0]


@pytest.mark.slow
def test_validation_over_two_processes_equals_one_exactly(two_process_runs, data7, tmp_path):
    single_cfg = tiny_cfg(data7, tmp_path / "e")
    single = backends.get("single")(single_cfg)
    single.setup()
    expected = evaluate_fixed(single_cfg, single)
    got = torch.load(two_process_runs / "eval.pt", weights_only=True)
    assert expected["count"] == got["count"] == 21
    assert got["top1"] == expected["top1"] and got["top5"] == expected["top5"]
    assert 0 < expected["top5"] < 100  # 7 classes: top-5 is not trivially 100


@pytest.mark.slow
def test_a_forward_that_fails_on_one_rank_fails_on_every_rank_in_step(two_process_runs):
    """The teacher probe and validation: a RuntimeError on rank 1 only (an OOM) reaches rank 0 too,
    after the one collective, so a fallback (the plain teacher) starts on every rank together."""
    full = torch.load(two_process_runs / "eval.pt", weights_only=True)
    for rank in (0, 1):
        result = torch.load((two_process_runs / "eval_fail").with_suffix(f".{rank}"), weights_only=True)
        expected = "CUDA out of memory (simulated)" if rank == 1 else "the forward failed on another process"
        assert result["raised"] == expected
        assert result["after"] == full


def test_native_apex_averages_missing_gradients_as_zero(two_process_runs):
    for rank in (0, 1):
        grads = torch.load((two_process_runs / "avg").with_suffix(f".{rank}"), weights_only=True)
        assert torch.equal(grads["a"], torch.full((3,), 1.5))
        assert torch.equal(grads["b"], torch.full((3,), 2.0))
        assert grads["c"] is None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["apex_bn", "ddp_bn"])
def test_validation_is_that_of_the_saved_model_with_batchnorm(two_process_runs, data7, name):
    """Every process evaluates with rank 0's BatchNorm statistics, those of the checkpoint: the
    logged val loss is what one process computes from last.pt."""
    from kd.commands.evaluate import evaluate_model

    assert not errors_of(two_process_runs, name)
    logged = json.loads((two_process_runs / name / "metrics.jsonl").read_text().splitlines()[-1])
    saved = evaluate_model(
        "timm:kd_test_bn",
        str(two_process_runs / name / "checkpoints" / "last.pt"),
        str(data7),
        batch_size=4,
        device="cpu",
        image_size=32,
        workers=0,
    )
    assert saved["count"] == 21
    assert saved["loss"] == pytest.approx(logged["val_loss"], abs=1e-5)


@pytest.mark.slow
def test_each_process_draws_its_own_random_numbers(two_process_runs):
    """Reseeded per rank after set-up: dropout and drop-path masks differ across processes."""
    draws = [torch.load((two_process_runs / "rng").with_suffix(f".{rank}"), weights_only=True) for rank in (0, 1)]
    assert not torch.equal(draws[0], draws[1])


# ----------------------------------------------------------------------------- GPUs
def _gpus(n):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} CUDA GPUs")


@pytest.mark.gpu
@_gpus(2)
def test_dp_over_two_gpus_equals_one_gpu(data7, tmp_path):
    one = single_run(data7, tmp_path / "one", student="timm:kd_test_net", device="cuda", gpus=[0])
    two = single_run(
        data7,
        tmp_path / "two",
        student="timm:kd_test_net",
        device="cuda",
        gpus=[0, 1],
        backend="dp",
        dp_output_device=1,
    )
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5)
