"""The 2024 rows and kd teach's store (``--soft-labels``): the logit methods (ttm, wttm, luminet) train from
it as from the live teacher, bit for bit; crld (a second view) and the SDD methods (feature maps) are
refused in one line."""

from __future__ import annotations

import pytest
import torch
from conftest import TEST_RESNET, THREADS, kd_main, last_checkpoint

#: a store's epoch on synthetic tensors: three batches of four 32 px images of 10 classes
SYNTHETIC = ["--data", "synthetic", "--image-size", 32, "--device", "cpu", "--no-progress", "--epochs", 1]
SYNTHETIC += ["--limit-train-batches", 3, "--limit-val-batches", 1, "--num-classes", 10, "-b", 4]
TEACHER = ["--teacher", TEST_RESNET, "--teacher-weights", "none"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Every logit in float32, taught once, on as many threads as the tests' runs (conftest's
    ``_few_threads`` comes after a module's fixtures): the teacher's forward to the last bit."""
    torch.set_num_threads(THREADS)
    out = tmp_path_factory.mktemp("store") / "store"
    r = kd_main("teach", *SYNTHETIC, *TEACHER, "--top-k", "all", "--logits-dtype", "float32", "--out", out)
    assert r.returncode == 0, r.stderr
    return out


def test_the_logit_rows_from_a_store_are_the_live_teachers_students(store, tmp_path):
    """ttm, wttm and luminet (its per-class statistics over the stored logits of the batch) from the
    store: each the student of the live teacher, bit for bit."""
    methods = ["ttm", "wttm", "luminet"]
    train = ["train", *SYNTHETIC, "--student", TEST_RESNET, "--kd-loss", ",".join(methods)]
    r = kd_main(*train, *TEACHER, "--out", tmp_path / "live")
    assert r.returncode == 0, r.stderr
    r = kd_main(*train, "--soft-labels", store, "--out", tmp_path / "replay")
    assert r.returncode == 0, r.stderr
    assert "no teacher forward" in r.stderr
    for method in methods:
        live, replay = (
            last_checkpoint(tmp_path / "live" / method)["student"],
            last_checkpoint(tmp_path / "replay" / method)["student"],
        )
        assert live.keys() == replay.keys()
        assert all(torch.equal(live[k], replay[k]) for k in live), method


@pytest.mark.parametrize(
    "methods, why",
    [
        ("wttm,crld", "--kd-loss crld also needs them on a second, strongly augmented view"),
        ("sdkd", "--kd-loss sdkd needs the teacher's features"),
        ("luminet,sddkd", "--kd-loss sddkd needs the teacher's features"),
        ("sdnkd", "--kd-loss sdnkd needs the teacher's features"),
    ],
)
def test_crld_and_the_sdd_rows_are_refused_in_one_line(store, tmp_path, methods, why):
    out = tmp_path / "run"
    r = kd_main(
        "train", *SYNTHETIC, "--student", TEST_RESNET, "--kd-loss", methods, "--soft-labels", store, "--out", out
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("kd: error: --soft-labels "), r.stderr
    assert why in lines[0] and "train it with the live teacher" in lines[0], lines[0]
    assert not out.exists()
