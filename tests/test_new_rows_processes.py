"""The 2024 rows whose loss reads more than one sample, on two gloo processes against one process of the
same global batch: CRLD's confidence masks are per sample, so two processes train the one process's
student; LumiNet standardises each class over the batch each process holds (as each official
DataParallel replica over its share), so two processes differ from one, as docs/methods.md says."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as tmp
from conftest import free_port, make_image_folder
from test_backends import TINY, _run_jobs, errors_of

import kd
from kd import config as kd_config

pytestmark = pytest.mark.slow

#: a random teacher on 7 classes is at most ~0.2 sure: thresholds where it is sure of some samples only
#: (a quarter to a half of the weak views, three quarters or more of the strong ones, in these steps)
CRLD_ARGS = {"weak_threshold": 0.17, "strong_threshold": 0.16}
METHODS = {"crld": CRLD_ARGS, "luminet": {}}


def options(data, out, method, **more):
    base = {k: v for k, v in TINY.items() if k != "no_teacher"}
    return {**base, "data": str(data), "out": str(out), "teacher": "timm:kd_test_net", "teacher_weights": "none",
            "kd_loss": method, "loss_args": METHODS[method], "limit_train_batches": 2, **more}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each method on two processes (torch_ddp, gloo) and on one, from the same seed and global batch."""
    root = tmp_path_factory.mktemp("rows")
    data = make_image_folder(root / "data", classes=7, train_per_class=4, val_per_class=3)
    jobs = []
    for method in METHODS:
        cfg = kd_config.resolve(options=options(data, root / "two" / method, method, backend="torch_ddp"))
        (root / "two" / method).mkdir(parents=True)
        jobs.append({"kind": "train", "name": method, "cfg": cfg, "port": free_port()})
    tmp.spawn(_run_jobs, args=(2, jobs, str(root / "errors")), nprocs=2, join=True)
    for method in METHODS:
        kd.train(kd_config.resolve(options=options(data, root / "one" / method, method)))
    return root


def student(out):
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert state["global_step"] == 2
    return state["student"]


def test_crld_on_two_processes_equals_one(runs):
    assert not errors_of(runs, "crld")
    one, two = student(runs / "one" / "crld"), student(runs / "two" / "crld")
    assert one.keys() == two.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-6)


def test_luminet_takes_each_processs_batch_statistics(runs):
    """Its per-class statistics over 4 samples on each process, not over the 8 of the global batch: the
    students part (by far more than the rounding that CRLD's runs stay within)."""
    assert not errors_of(runs, "luminet")
    one, two = student(runs / "one" / "luminet"), student(runs / "two" / "luminet")
    apart = max((two[k].float() - one[k].float()).abs().max().item() for k in one)
    assert apart > 1e-3, apart
