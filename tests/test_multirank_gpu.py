"""Several ranks on one GPU, and the multi-rank fixes that need CUDA or real apex.parallel.

Two processes share GPU 0 over gloo (NCCL refuses two ranks on one GPU), as
``kd train --nproc 2 --gpus 0`` runs them. The fixture spawns them with torchrun's variables
(as tests/test_backends.py does on the CPU) and runs jobs that drive a backend directly: one
backward on each rank's own batch, then the averaged gradients are checked against the mean of
both ranks' gradients computed without any wrapper. The command-line tests compare a run of two
ranks with a run of one on the same global batch. Tests of real apex skip where
``apex.parallel.DistributedDataParallel`` is not importable; TF32 is off so sums compare tightly.
"""

from __future__ import annotations

import copy
import os
import traceback
from pathlib import Path

import pytest
import test_backends as tb  # the tiny models (registered with timm) and configs
import torch
import torch.multiprocessing as tmp
from conftest import ROOT, free_port, make_image_folder, run_kd
from torch import nn

import backends
import kd
from backends.apex_ddp import apex_parallel
from kd.precision import make_precision

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

APEX, NO_APEX = apex_parallel() if torch.cuda.is_available() else (None, "needs CUDA")
needs_apex = pytest.mark.skipif(APEX is None, reason=f"needs real apex.parallel: {NO_APEX}")
NO_TF32 = {"NVIDIA_TF32_OVERRIDE": "0"}  # cuDNN and cuBLAS in the processes kd starts


def _no_tf32() -> None:
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


# ----------------------------------------------------------------------------- two ranks, one GPU
def _run_jobs(rank: int, world: int, jobs, root: str):
    """One spawned process: torchrun's variables, then each job; its result (or traceback) saved."""
    torch.set_num_threads(2)
    _no_tf32()
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
        try:
            result = _averaged_gradients(job["cfg"])
        except Exception:
            result = {"error": traceback.format_exc()}
        torch.save(result, Path(root, f"{job['name']}.{rank}"))


def _batch(rank: int, device: torch.device) -> torch.Tensor:
    return torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(100 + rank)).to(device)


def _averaged_gradients(cfg):
    """One step's backward through the backend, as the engine runs it (convert_model, precision,
    wrap, sync), on this rank's batch; and the reference: the mean of every rank's float32
    gradients, computed here on an unwrapped copy."""
    backend = backends.get(cfg.backend)(cfg)
    backend.setup()
    try:
        torch.manual_seed(0)
        model = tb.TinyNet(7, spare=cfg.student == "timm:kd_test_unused")
        model = model.to(backend.device, memory_format=torch.channels_last)  # kd's default on CUDA
        reference = copy.deepcopy(model)
        model = backend.convert_model(model)
        precision = make_precision(cfg, backend.device, prefer_apex=backend.prefers_apex_amp)
        model, _ = precision.convert(model, torch.optim.SGD(model.parameters(), lr=0.1))
        wrapped = backend.wrap(model)
        with precision.autocast():
            out = wrapped(precision.input_cast(_batch(backend.rank, backend.device)))
        out.float().square().mean().backward()
        backend.sync_gradients(wrapped)
        for rank in range(backend.world_size):
            reference(_batch(rank, backend.device)).square().mean().div(backend.world_size).backward()
        grads = {name: None if p.grad is None else p.grad.float().cpu() for name, p in model.named_parameters()}
        expected = {name: None if p.grad is None else p.grad.cpu() for name, p in reference.named_parameters()}
        return {
            "describe": backend.describe(),
            "got": grads,
            "expected": expected,
            "contiguous": all(p.is_contiguous() for p in model.parameters()),
        }
    finally:
        backend.teardown()


JOBS = {  # name: (backend, student, options); the apex ones run where real apex is importable
    "ddp": ("torch_ddp", "timm:kd_test_net", {}),
    "apex_channels_last": ("apex_ddp", "timm:kd_test_net", {}),
    "apex_bfloat16": ("apex_ddp", "timm:kd_test_net", {"opt": "O2", "amp_dtype": "bfloat16"}),
    "apex_unused": ("apex_ddp", "timm:kd_test_unused", {}),
}


@pytest.fixture(scope="module")
def one_gpu_two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu2")
    jobs = [
        {
            "name": name,
            "port": free_port(),
            "cfg": tb.tiny_cfg(
                "synthetic", root / name, backend=backend, student=student, device="cuda", gpus=[0], **options
            ),
        }
        for name, (backend, student, options) in JOBS.items()
        if APEX is not None or backend != "apex_ddp"
    ]
    tmp.spawn(_run_jobs, args=(2, jobs, str(root)), nprocs=2, join=True)
    return root


def results(root: Path, name: str):
    out = [torch.load(root / f"{name}.{rank}", weights_only=True) for rank in (0, 1)]
    for r in out:
        assert "error" not in r, r.get("error")
    return out


def assert_averaged(result, rel: float) -> None:
    """Every averaged gradient is the mean of the ranks' gradients (relative error in norm)."""
    assert result["got"].keys() == result["expected"].keys()
    for name, want in result["expected"].items():
        got = result["got"][name]
        if want is None:
            assert got is None, name
            continue
        assert (got - want).norm() <= rel * want.norm(), f"{name}: {(got - want).norm() / want.norm():.3g}"


def test_torch_ddp_two_ranks_share_one_gpu_over_gloo(one_gpu_two_ranks):
    for result in results(one_gpu_two_ranks, "ddp"):
        assert "2 process(es) over gloo (2 processes share 1 GPU(s))" in result["describe"]
        assert "device cuda:0" in result["describe"]
        assert_averaged(result, 1e-5)


@needs_apex
def test_real_apex_averages_channels_last_convolutions_right(one_gpu_two_ranks):
    """apex's raw-memory copy back (amp_C's multi_tensor_scale) would permute the gradients of
    channels_last 3x3 convolutions; under real apex the parameters are kept contiguous."""
    for result in results(one_gpu_two_ranks, "apex_channels_last"):
        assert "real apex.parallel" in result["describe"] and "parameters contiguous" in result["describe"]
        assert result["contiguous"]
        assert_averaged(result, 1e-5)


@needs_apex
def test_apex_ddp_averages_bfloat16_gradients_natively(one_gpu_two_ranks):
    """Real apex all-reduces half, float and double only: bfloat16 weights take kd's averager."""
    for result in results(one_gpu_two_ranks, "apex_bfloat16"):
        assert "native delayed all-reduce (bfloat16 weights" in result["describe"]
        assert_averaged(result, 5e-2)  # bfloat16 gradients against a float32 reference


@needs_apex
def test_apex_ddp_averages_natively_where_parameters_get_no_gradient(one_gpu_two_ranks):
    for result in results(one_gpu_two_ranks, "apex_unused"):
        assert "native delayed all-reduce (find_unused_parameters (detected: the student leaves 2" in result["describe"]
        assert result["got"]["spare.weight"] is None
        assert_averaged(result, 1e-5)


# ----------------------------------------------------------------------------- the command line
@pytest.fixture(scope="module")
def data3(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("data3"), classes=3, train_per_class=8, val_per_class=3)


def train(data, out, *extra):
    """``kd train`` of a LayerNorm student (no BatchNorm: two ranks equal one), TF32 off."""
    r = run_kd(
        "train",
        "--data",
        data,
        "--no-teacher",
        "--student",
        "timm:test_convnext",
        "--image-size",
        32,
        "-b",
        8,
        "--epochs",
        1,
        "--device",
        "cuda",
        "--lr-schedule",
        "constant",
        "--lr",
        0.05,
        "--log-every",
        1,
        "--no-progress",
        "-j",
        0,
        "--out",
        out,
        *extra,
        env={**NO_TF32, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stderr, torch.load(Path(out) / "checkpoints" / "last.pt", weights_only=True)["student"]


@pytest.mark.parametrize("backend", ["torch_ddp", "apex_ddp"])
def test_two_ranks_on_one_gpu_equal_one_rank(backend, data3, tmp_path):
    """``--nproc 2 --gpus 0``: two processes on GPU 0 over gloo; after the same steps on the same
    global batch the student equals that of one process (channels_last parameters included)."""
    log, two = train(data3, tmp_path / "two", "--backend", backend, "--gpus", 0, "--nproc", 2)
    _, one = train(data3, tmp_path / "one", "--backend", "single", "--gpus", 0)
    assert f"backend {backend}: 2 process(es) over gloo (2 processes share 1 GPU(s))" in log
    if backend == "apex_ddp" and APEX is not None:
        assert "real apex.parallel" in log
    assert two.keys() == one.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5)


def test_nccl_refuses_ranks_that_share_a_gpu(data3, tmp_path):
    r = run_kd(
        "train",
        "--data",
        data3,
        "--no-teacher",
        "--student",
        "timm:test_convnext",
        "--device",
        "cuda",
        "--backend",
        "torch_ddp",
        "--gpus",
        0,
        "--nproc",
        2,
        "--set",
        "dist_backend=nccl",
        "--out",
        tmp_path / "run",
    )
    assert r.returncode == 2 and "dist_backend=nccl runs one process per GPU, and 2 processes share 1 GPU" in r.stderr


# ----------------------------------------------------------------------------- in this process
@needs_apex
def test_apex_sync_bn_layers_are_the_ones_that_train(tmp_path, capfd):
    """apex's conversion makes new Parameters; made before the optimizer, they are the ones it steps."""
    data = make_image_folder(tmp_path / "data", classes=3, train_per_class=4, val_per_class=2)
    kd.train(
        tb.tiny_cfg(
            data,
            tmp_path / "run",
            student="timm:kd_test_bn",
            backend="apex_ddp",
            nproc=1,
            device="cuda",
            gpus=[0],
            sync_bn=True,
            limit_train_batches=2,
        )
    )
    log = capfd.readouterr().err
    assert "real apex.parallel" in log and "sync_bn" in log
    state = tb.student_state(tmp_path / "run")
    for layer in ("body.1", "body.4"):  # BatchNorm starts at weight 1, bias 0
        assert not torch.equal(state[f"{layer}.weight"].cpu(), torch.ones(8)), layer
        assert not torch.equal(state[f"{layer}.bias"].cpu(), torch.zeros(8)), layer


def test_data_parallel_replicas_run_in_the_callers_autocast_dtype():
    """Each replica's thread enters autocast without a dtype (thread-local, float16 by default);
    kd's DataParallel runs every replica in the caller's dtype."""
    from backends.dp import _DataParallel

    dev = torch.device("cuda", 0)
    dp = _DataParallel(nn.Linear(8, 4).to(dev), [0, 0], 0, dev)  # two replicas, two threads, one GPU
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = dp(torch.randn(4, 8, device=dev))
    assert out.dtype == torch.bfloat16


def test_cuda_generator_state_is_this_process_gpus_and_old_lists_load():
    """A checkpoint holds the current GPU's state only; an older one's list of every GPU's state
    (saved where more GPUs were visible) gives the current GPU's entry instead of failing."""
    from kd.run.state import rng_state, set_rng_state

    torch.zeros(1, device="cuda")  # CUDA initialised, as in a run
    torch.cuda.manual_seed(5)
    wanted = torch.cuda.get_rng_state()
    state = rng_state()
    assert torch.equal(state["cuda"], wanted)
    torch.cuda.manual_seed(6)
    other = torch.cuda.get_rng_state()
    set_rng_state(state)
    assert torch.equal(torch.cuda.get_rng_state(), wanted)
    entries = [other] * (torch.cuda.device_count() + 1)
    entries[torch.cuda.current_device()] = wanted
    torch.cuda.manual_seed(6)
    set_rng_state(dict(state, cuda=entries))
    assert torch.equal(torch.cuda.get_rng_state(), wanted)
