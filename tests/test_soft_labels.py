"""kd teach and kd train --soft-labels: the teacher's logits stored once on kd's own crops, and
replayed without the teacher (kd.teacher.store)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import kd_main, make_image_folder, run_kd

from kd.teacher import store as kd_store

pytestmark = pytest.mark.slow


#: the teacher (its weights: ``world``'s) and the student of the runs: timm's test ResNet (0.4 M
#: parameters), a store, its replay and its refusals being the same for any model (with resnet18 each
#: training run trained and checkpointed 11 M parameters)
TEACHER = STUDENT = "timm:test_resnet"


def common(data, *extra):
    return ["--data", data, "--image-size", 32, "-b", 8, "--epochs", 2, "--device", "cpu", "--no-progress", *extra]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("soft")
    data = make_image_folder(root / "data", classes=4, train_per_class=6, val_per_class=2)
    torch.manual_seed(3)
    from kd import models

    weights = root / "teacher.pt"
    torch.save(models.build(TEACHER, 4).state_dict(), weights)
    return root, data, weights


@pytest.fixture(scope="module")
def store(world, tmp_path_factory):
    """A store of two epochs of ``world`` at kd teach's default --top-k and --logits-dtype, taught
    once: the tests below read it or are refused by it, none writes it."""
    root, data, weights = world
    out = tmp_path_factory.mktemp("store") / "store"
    r = kd_main("teach", *common(data, "--teacher", TEACHER, "--teacher-weights", weights, "-j", 0, "--out", out))
    assert r.returncode == 0, r.stderr
    return out


#: the options of a store of every logit in float32 (:func:`exact_store`)
EXACT = ["--top-k", "all", "--logits-dtype", "float32"]


@pytest.fixture(scope="module")
def exact_store(world, tmp_path_factory):
    """A store of every logit in float32 of two epochs of ``world``, taught once in one process:
    what a grown store and a store of two processes must equal."""
    root, data, weights = world
    out = tmp_path_factory.mktemp("exact") / "store"
    teacher = ["--teacher", TEACHER, "--teacher-weights", weights, "-j", 0, *EXACT]
    r = kd_main("teach", *common(data, *teacher), "--out", out)
    assert r.returncode == 0, r.stderr
    return out


def students(path: Path):
    return torch.load(path / "checkpoints" / "last.pt", weights_only=False)["student"]


def snapshot(root: Path):
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def one_line(r):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("kd: error: ") and "Traceback" not in r.stderr, r.stderr
    return lines[0]


# ----------------------------------------------------------------------------- the row format
def test_every_logit_stored_is_the_row():
    logits = torch.randn(5, 7) * 4
    values, classes, lse = kd_store.compress(logits, 7)
    assert classes is None and lse is None
    assert torch.equal(kd_store.expand(values, None, None, 7), logits)


def test_top_k_is_fkds_marginal_smoothing():
    """The k largest probabilities kept and the rest of the mass spread evenly over the other
    classes (FKD's marginal_smoothing_k soft labels), as a row of logits, also for confident
    1000-class rows stored in float16 (the default), at the temperatures the methods use."""
    torch.manual_seed(0)
    for classes, k, scale in ((10, 3, 3.0), (1000, 10, 8.0)):
        logits = torch.randn(64, classes) * scale
        logits[:, 0] += 3 * scale  # confident rows: almost all the mass in the top k
        values, kept, rest = kd_store.compress(logits, k)
        probs = F.softmax(logits, dim=1)
        top, where = probs.topk(k, dim=1)
        reference = ((1 - top.sum(1, keepdim=True)) / (classes - k)).expand(-1, classes).clone().scatter_(1, where, top)
        exact = kd_store.expand(values, kept, rest, classes)
        assert torch.allclose(F.softmax(exact, dim=1), reference, atol=1e-6, rtol=1e-4)
        stored = kd_store.expand(values.half(), kept.short(), rest, classes)  # as stored: float16, int16
        for t in (1.0, 4.0):
            target = F.log_softmax(kd_store.expand(values, kept, rest, classes) / t, dim=1)
            kl = F.kl_div(F.log_softmax(stored / t, dim=1), target, log_target=True, reduction="none").sum(1)
            assert kl.max() < 1e-3, (classes, t, kl.max())
    # one-hot-like rows: the k hold all the mass; the others stay below them, no NaN
    sharp = torch.tensor([[40.0, 0.0, -5.0, -9.0]])
    v, c, r = kd_store.compress(sharp, 2)
    full = kd_store.expand(v, c, r, 4)
    assert torch.isfinite(full).all() and full[0, 2:].max() <= full[0, :2].min()


# ----------------------------------------------------------------------------- end to end
def test_a_store_of_every_logit_trains_the_live_runs_student_bit_for_bit(world, tmp_path):
    """With every logit in float32, a student from the store is the student of the live teacher,
    bit for bit, on either loader (the store taught through the loader the students use: the two
    loaders' crops agree to rounding, not bit for bit)."""
    root, data, weights = world
    teacher = ["--teacher", TEACHER, "--teacher-weights", weights]
    for loader, workers in (("pil", 2), ("gpu", 0)):
        store = tmp_path / f"store_{loader}"
        crops = ["--loader", loader, "-j", workers]
        r = kd_main("teach", *common(data, *teacher, *crops, "--top-k", "all", "--logits-dtype", "float32",
                                     "--out", store))  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "kd teach: 2 epoch(s) of 24 samples" in r.stderr
        manifest = kd_store.read_manifest(store)
        assert manifest["epochs_done"] == 2 and manifest["k"] == 4 and manifest["dtype"] == "float32"
        assert manifest["teacher_weights_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
        live, replay = tmp_path / f"live_{loader}", tmp_path / f"replay_{loader}"
        args = common(data, "--student", STUDENT, *crops)
        r = kd_main("train", *args, *teacher, "--out", live)
        assert r.returncode == 0, r.stderr
        r = kd_main("train", *args, "--soft-labels", store, "--out", replay)
        assert r.returncode == 0, r.stderr
        assert "from the soft-label store" in r.stderr and "no teacher forward" in r.stderr
        a, b = students(live), students(replay)
        assert all(torch.equal(a[k], b[k]) for k in a), loader
    cfg = (tmp_path / "replay_pil" / "config.yaml").read_text()
    assert f"teacher: {TEACHER}" in cfg and f"soft_labels: {tmp_path / 'store_pil'}" in cfg
    r = kd_main("report", tmp_path / "replay_pil", tmp_path / "live_pil")
    assert r.returncode == 0 and f"{TEACHER} (stored)" in r.stdout


def test_a_store_on_synthetic_tensors_is_the_live_teacher_and_pins_the_batch(tmp_path):
    """kd bench's store rows: a store taught on synthetic tensors (its epoch: --limit-train-batches)
    trains the live run's student bit for bit, the store logs what teaching cost, and a run whose
    synthetic samples differ (another batch per process) is refused."""
    synthetic = ["--data", "synthetic", "--image-size", 32, "--device", "cpu", "--no-progress", "--epochs", 1]
    synthetic += ["--limit-train-batches", 3, "--num-classes", 10, "-b", 4]
    teacher = ["--teacher", TEACHER, "--teacher-weights", "none"]
    store = tmp_path / "store"
    r = kd_main("teach", *synthetic, *teacher, "--top-k", "all", "--logits-dtype", "float32", "--out", store)
    assert r.returncode == 0, r.stderr
    manifest = kd_store.read_manifest(store)
    assert manifest["samples"] == 12 and manifest["data"] == "synthetic" and manifest["loader"] == "synthetic"
    (log,) = kd_store.teaching_log(store)
    assert log["epochs"] == 1 and log["img_per_s"] > 0 and log["processes"] == 1 and log["device"] == "cpu"
    # kd bench's timer (--timed-after) times the teaching, not the teacher's validation after it
    timed = tmp_path / "timed"
    r = kd_main("teach", *synthetic, *teacher, "--limit-val-batches", 40, "--timed-after", 1, "--out", timed)
    assert r.returncode == 0, r.stderr
    (log,) = kd_store.teaching_log(timed)
    assert log["timed_steps"] == 2 and 0 < log["timed_seconds"] < log["seconds"], log
    assert kd_store.read_manifest(timed).get("teacher_val_top1") is None  # as a timed training, no validation
    student = [*synthetic, "--student", STUDENT]
    assert kd_main("train", *student, *teacher, "--out", tmp_path / "live").returncode == 0
    r = kd_main("train", *student, "--soft-labels", store, "--out", tmp_path / "replay")
    assert r.returncode == 0, r.stderr
    a, b = students(tmp_path / "live"), students(tmp_path / "replay")
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = [*student, "-b", 2, "--soft-labels", store, "--out", tmp_path / "other"]
    assert "must be the store's" in one_line(kd_main("train", *other))
    assert not (tmp_path / "other").exists()


def test_top_k_store_size_and_replay(world, tmp_path):
    """Every sample has its row, the last short batch's too (training drops it for some batch
    sizes, not others); a row never written is refused when a run asks for it."""
    root, data, weights = world
    store = tmp_path / "store"
    teacher = ["--teacher", TEACHER, "--teacher-weights", weights]
    args = common(data, *teacher, "-j", 0, "--top-k", 2, "--out", store)
    args[args.index("-b") + 1] = 16  # 24 images: a last batch of 8
    r = kd_main("teach", *args)
    assert r.returncode == 0, r.stderr
    values = np.load(store / "epoch-001.values.npy")
    classes = np.load(store / "epoch-001.classes.npy")
    rest = np.load(store / "epoch-001.rest.npy")
    assert values.shape == (24, 2) and values.dtype == np.float16
    assert classes.shape == (24, 2) and classes.dtype == np.int16 and rest.shape == (24,)
    # the others' mean mass is below the smallest kept one's
    assert (values[:, 0] >= values[:, 1]).all() and (rest - np.log(2) <= values[:, 1].astype(np.float32) + 1e-3).all()
    for e in (1, 2):
        assert np.load(store / f"epoch-00{e}.written.npy").all()
    assert "kd teach: 2 epoch(s) of 24 samples, 312 B an epoch" in r.stderr  # 24 x (2 x (2 + 2) + 4 + 1)
    run = common(data, "--student", STUDENT, "-j", 0, "--soft-labels", store, "--kd-loss", "dkd")
    r = kd_main("train", *run, "--out", tmp_path / "run")
    assert r.returncode == 0, r.stderr
    assert "the top 2 logits" in r.stderr
    written = np.load(store / "epoch-002.written.npy", mmap_mode="r+")
    written[5] = 0  # as an image unreadable when the store was taught
    written.flush()
    del written
    r = kd_main("train", *run, "--out", tmp_path / "run2")  # said at the start, stopped where it is read
    assert r.returncode == 2 and "Traceback" not in r.stderr and "1 row(s) missing" in r.stderr
    assert "kd: error: " in r.stderr.splitlines()[-1] and "no logits for training image 5 in epoch 2" in r.stderr


def test_a_stopped_or_shorter_store_is_continued_not_redone(world, exact_store, tmp_path):
    root, data, weights = world
    teacher = ["--teacher", TEACHER, "--teacher-weights", weights, "-j", 0, *EXACT]
    grown, fresh = tmp_path / "grown", exact_store  # fresh: the same teaching in one go
    args = [a if a != 2 else 1 for a in common(data, *teacher)]  # --epochs 1 (and -b 8 stays)
    r = kd_main("teach", *args, "--out", grown)
    assert r.returncode == 0, r.stderr
    first = (grown / "epoch-001.values.npy").stat()
    r = kd_main("teach", *common(data, *teacher), "--out", grown)
    assert r.returncode == 0, r.stderr
    assert "holds 1 epoch(s); continuing at epoch 2" in r.stderr
    again = (grown / "epoch-001.values.npy").stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    for e in (1, 2):
        assert np.array_equal(np.load(grown / f"epoch-00{e}.values.npy"), np.load(fresh / f"epoch-00{e}.values.npy"))
    assert not list(grown.glob("*.partial.npy"))
    r = kd_main("teach", *common(data, *teacher), "--out", grown)
    assert r.returncode == 0 and "already holds 2 epoch(s); nothing to do" in r.stderr


def test_two_processes_write_the_same_store(world, exact_store, tmp_path):
    root, data, weights = world
    teacher = ["--teacher", TEACHER, "--teacher-weights", weights, "-j", 0, *EXACT]
    one, two = exact_store, tmp_path / "two"
    r = run_kd("teach", *common(data, *teacher), "--backend", "torch_ddp", "--nproc", 2, "--out", two)
    assert r.returncode == 0, r.stderr
    for e in (1, 2):
        a, b = np.load(one / f"epoch-00{e}.values.npy"), np.load(two / f"epoch-00{e}.values.npy")
        assert np.allclose(a, b, atol=1e-4) and not (b == 0).all(axis=1).any()


def test_a_store_for_another_run_is_refused_in_one_line(world, store, tmp_path):
    root, data, weights = world
    teacher = ["--teacher", TEACHER, "--teacher-weights", weights]
    before = {**snapshot(tmp_path), **snapshot(store)}
    train = ["train", "--student", STUDENT, "-j", 0, "--soft-labels", store, "--out", tmp_path / "run"]
    cases = {
        "--image-size": (common(data)[:2] + ["--image-size", 48] + common(data)[4:], "--image-size differ"),
        "--seed": (common(data, "--seed", 5), "--seed differ"),
        "--epochs": ([a if a != 2 else 3 for a in common(data)], "holds 2 epoch(s)"),
        "fitnet": (common(data, "--kd-loss", "fitnet"), "needs the teacher's features"),
        "teacher": (common(data, "--teacher", "resnet34"), f"its teacher is {TEACHER}"),
    }
    for name, (args, why) in cases.items():
        line = one_line(kd_main(*train[:1], *args, *train[1:]))
        assert why in line, (name, line)
    other = make_image_folder(tmp_path / "other", classes=4, train_per_class=6, val_per_class=2, seed=1)
    (other / "train" / "class_00" / "000.jpg").rename(other / "train" / "class_00" / "zzz.jpg")
    assert "the training images (their listing) differ" in one_line(kd_main(*train[:1], *common(other), *train[1:]))
    damaged = tmp_path / "damaged"
    shutil.copytree(store, damaged)
    (damaged / "epoch-002.written.npy").unlink()
    args = common(data, "--student", STUDENT, "-j", 0, "--soft-labels", damaged, "--out", tmp_path / "d")
    line = one_line(kd_main("train", *args))
    assert "is damaged: epoch-002.written.npy cannot be read" in line
    not_store = tmp_path / "data_copy"
    not_store.mkdir()
    assert "not a soft-label store" in one_line(
        kd_main("train", *common(data, "--student", STUDENT, "--soft-labels", not_store, "--out", tmp_path / "r2"))
    )
    assert "holds a store for another teaching" in one_line(
        kd_main("teach", *common(data, *teacher, "-j", 0, "--top-k", 3, "--out", store))
    )
    assert "not a soft-label store" in one_line(kd_main("teach", *common(data, *teacher, "--out", data)))
    assert "needs --out" in one_line(kd_main("teach", *common(data, *teacher)))
    assert "conflicts with --no-teacher" in one_line(
        kd_main("teach", *common(data, "--no-teacher", "--out", tmp_path / "n"))
    )
    limited = common(data, *teacher, "--limit-train-batches", 1, "--out", tmp_path / "n")
    assert "no --limit-train-batches" in one_line(kd_main("teach", *limited))
    named = tmp_path / "named"  # named weights have no file to checksum: compared by name
    assert kd_main("teach", *common(data, "--teacher", "resnet18", "--teacher-weights", "none", "-j", 0,
                                    "--out", named)).returncode == 0  # fmt: skip
    other_weights = common(
        data, "--teacher", "resnet18", "--teacher-weights", "torchvision:IMAGENET1K_V1", "--out", named
    )
    assert "its teacher_weights is none" in one_line(kd_main("teach", *other_weights))
    (not_store / "x").write_text("x")
    assert {**snapshot(tmp_path), **snapshot(store)} == {
        **before,
        **snapshot(not_store),
        **snapshot(other),
        **snapshot(named),
        **snapshot(damaged),
    }
    assert not (tmp_path / "run").exists() and not (tmp_path / "r2").exists()
    assert os.listdir(not_store) == ["x"]


def test_a_run_from_a_store_resumes_as_it_would_have_run(world, store, tmp_path):
    """Stopped after epoch 1 and resumed, a student from a store ends as the run that went on."""
    root, data, weights = world
    student = ["--student", STUDENT, "-j", 0, "--soft-labels", store, "--lr-schedule", "constant"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert kd_main("train", *common(data, *student, "--out", whole)).returncode == 0
    one = [a if a != 2 else 1 for a in common(data, *student, "--out", parts)]  # --epochs 1
    assert kd_main("train", *one).returncode == 0
    r = kd_main("train", "--out", parts, "--resume", "--epochs", 2, "--no-progress")
    assert r.returncode == 0, r.stderr
    a, b = students(whole), students(parts)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_several_students_from_one_store_each_equal_their_own_run(world, store, tmp_path):
    root, data, weights = world
    student = ["--student", STUDENT, "-j", 0, "--soft-labels", store]
    r = kd_main("train", *common(data, *student, "--kd-loss", "kd,dkd", "--out", tmp_path / "both"))
    assert r.returncode == 0, r.stderr
    for method in ("kd", "dkd"):
        alone = tmp_path / f"alone_{method}"
        assert kd_main("train", *common(data, *student, "--kd-loss", method, "--out", alone)).returncode == 0
        a, b = students(alone), students(tmp_path / "both" / method)
        assert all(torch.equal(a[k], b[k]) for k in a), method
