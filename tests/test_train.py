"""kd train end to end on the CPU: outputs, TensorBoard, checkpoints, frozen teacher, resume, eval."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml
from conftest import kd_main, last_checkpoint, run_kd, tiny_config, train_args
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import kd
from kd.run.loop import Trainer
from kd.run.students import Students


def tiny_cfg(data, out, **kw):
    options = dict(teacher_weights="none", lr=0.05, log_every=1, seed=0, epochs=2, temperature=2.0)
    return tiny_config(data, out, **{**options, **kw})


def test_cli_run_writes_metrics_tensorboard_checkpoints(image_folder, tmp_path):
    out = tmp_path / "run"
    models = dict(teacher="squeezenet1_1", student="squeezenet1_1")  # a tenth of resnet18's checkpoints to write
    r = run_kd(*train_args(image_folder, out, epochs=2, log_every=1, **models))
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [rec["epoch"] for rec in records] == [1, 2]
    for key in ("epoch", "train_loss", "train_ce", "train_kd", "val_top1", "val_top5", "lr", "img_per_s", "seconds"):
        assert key in records[-1]
    assert 0.0 <= records[-1]["val_top1"] <= 100.0
    # the time from the command (its process start, interpreter and imports included) to the first step
    assert records[0]["startup_s"] > records[0]["startup_setup_s"] > 0 and "startup_s" not in records[1]
    # the set-up's parts add up to it, and the rest of the way to the first step is in the record
    parts = [records[0][f"startup_{p}_s"] for p in ("launch", "data", "models", "teacher", "optimizer", "folder")]
    assert min(parts) >= 0 and sum(parts) == pytest.approx(records[0]["startup_setup_s"], abs=1e-3)
    after = ("startup_setup_s", "startup_epoch_start_s", "startup_first_batch_s", "startup_step_s")
    assert sum(records[0][k] for k in after) == pytest.approx(records[0]["startup_s"], abs=0.05)
    assert "first step done" in r.stderr and "(set-up " in r.stderr and ": launch " in r.stderr
    # the teacher's top-1 is measured after the first epoch, not before the first step
    assert r.stderr.index("first step done") < r.stderr.index("teacher squeezenet1_1: val top-1")
    assert r.stderr.index("teacher squeezenet1_1: val top-1") < r.stderr.index("epoch 1/2")
    assert "teacher_top1" in records[0] and "teacher_top1" not in records[1]
    assert (out / "checkpoints" / "last.pt").is_file() and (out / "checkpoints" / "best.pt").is_file()
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["student"] == "squeezenet1_1" and saved["batch_size"] == 8 and saved["epochs"] == 2

    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    for tag in ("train/loss", "train/ce", "train/kd", "train/lr", "epoch/val_top1", "epoch/train_loss"):
        assert tag in tags, tags
    steps = [e.step for e in events.Scalars("train/loss")]
    assert steps == sorted(steps) and len(steps) == 2 * 3  # 24 images / batch 8 = 3 steps per epoch
    val = [e.value for e in events.Scalars("epoch/val_top1")]
    assert val == pytest.approx([rec["val_top1"] for rec in records])


def test_teacher_is_frozen_and_unchanged(image_folder, tmp_path):
    weights = tmp_path / "teacher.pt"
    torch.manual_seed(1)
    torch.save(kd.models.build("resnet18", 3).state_dict(), weights)
    before = torch.load(weights, weights_only=True)
    # the loaded state itself is compared below, so without fusion (which folds BatchNorm)
    cfg = tiny_cfg(image_folder, tmp_path / "run", teacher_weights=str(weights), fuse_teacher=False)
    import backends

    backend = backends.get("single")(cfg)
    backend.setup()
    trainer = Trainer(Students.alone(cfg), backend)
    teacher = trainer.teacher.module.teacher
    assert not teacher.training
    assert all(not p.requires_grad for p in teacher.parameters())
    opt_params = {id(p) for g in trainer.lane.optimizer.param_groups for p in g["params"]}
    assert not opt_params & {id(p) for p in teacher.parameters()}
    student_before = {k: v.clone() for k, v in trainer.lane.side.student.state_dict().items()}
    trainer.fit()
    after = teacher.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key  # BatchNorm running stats included
    changed = [k for k, v in trainer.lane.side.student.state_dict().items() if not torch.equal(v, student_before[k])]
    assert changed, "the student did not train"


def test_fused_teacher_gives_the_same_logits_and_stays_frozen(image_folder, tmp_path, capsys):
    weights = tmp_path / "teacher.pt"
    torch.manual_seed(1)
    reference = kd.models.build("resnet18", 3)
    for m in reference.modules():  # BatchNorm statistics far from the identity, so folding matters
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    torch.save(reference.state_dict(), weights)
    reference.eval()
    cfg = tiny_cfg(image_folder, tmp_path / "run", teacher_weights=str(weights), fuse_teacher=True)
    import backends

    backend = backends.get("single")(cfg)
    backend.setup()
    trainer = Trainer(Students.alone(cfg), backend)
    teacher = trainer.teacher.module.teacher
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in teacher.modules())  # all 20 folded
    assert all(not p.requires_grad for p in teacher.parameters())
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(teacher(x), reference(x), rtol=1e-4, atol=1e-4)
    state = {k: v.clone() for k, v in teacher.state_dict().items()}
    trainer.fit()
    assert all(torch.equal(v, state[k]) for k, v in teacher.state_dict().items())
    assert "teacher: 20 BatchNorm layers folded, 9 conv+ReLU and 8 conv+add+ReLU fused" in capsys.readouterr().err


def test_resume_equals_uninterrupted_run(image_folder, tmp_path):
    # squeezenet1_1 (its classifier's dropout draws from the resumed generators) saves a tenth of resnet18
    schedule = dict(lr_schedule="cosine", warmup_epochs=1, teacher="squeezenet1_1", student="squeezenet1_1")
    full = tiny_cfg(image_folder, tmp_path / "full", epochs=3, **schedule)
    kd.train(full)
    part = tiny_cfg(image_folder, tmp_path / "part", epochs=1, **schedule)
    kd.train(part)
    r = kd_main("train", "--out", tmp_path / "part", "--resume", "--epochs", 3)
    assert r.returncode == 0, r.stderr
    a, b = last_checkpoint(tmp_path / "full"), last_checkpoint(tmp_path / "part")
    assert a["epoch"] == b["epoch"] == 3 and a["global_step"] == b["global_step"]
    for key in a["student"]:
        assert torch.equal(a["student"][key], b["student"][key]), key
    ma = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    mb = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert len(mb) == 3
    for ra, rb in zip(ma, mb):
        for key in ("train_loss", "train_kd", "val_top1", "val_top5", "lr"):
            assert ra[key] == rb[key], (key, ra, rb)


def test_no_teacher_then_eval_matches_metrics(image_folder, tmp_path):
    out = tmp_path / "base"
    kd.train(tiny_cfg(image_folder, out, no_teacher=True, teacher=None, epochs=1))
    rec = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert "train_kd" not in rec and "train_ce" in rec
    r = kd_main(
        "eval",
        "--model",
        "resnet18",
        "--weights",
        out / "checkpoints" / "last.pt",
        "--data",
        image_folder,
        "--image-size",
        32,
        "-b",
        5,
        "-j",
        0,
        "--device",
        "cpu",
    )
    assert r.returncode == 0, r.stderr
    assert f"top-1 {rec['val_top1']:.2f}" in r.stdout
    assert "(12 images)" in r.stdout


def test_kd_checkpoint_as_teacher_weights(image_folder, tmp_path):
    """A teacher trained with --no-teacher is a valid --teacher-weights file (the demo's path)."""
    kd.train(tiny_cfg(image_folder, tmp_path / "t", no_teacher=True, teacher=None, epochs=1))
    r = kd.train(
        tiny_cfg(image_folder, tmp_path / "s", teacher_weights=str(tmp_path / "t/checkpoints/best.pt"), epochs=1)
    )
    assert r["teacher_top1"] == pytest.approx(
        json.loads((tmp_path / "t/metrics.jsonl").read_text().splitlines()[-1])["val_top1"]
    )


def test_a_kd_checkpoint_as_teacher_names_its_model(image_folder, teacher_run, tmp_path):
    _, teacher = teacher_run
    ckpt = teacher / "checkpoints" / "best.pt"
    r = kd_main(*train_args(image_folder, tmp_path / "s", teacher=None, teacher_weights=ckpt, no_progress=True))
    assert r.returncode == 0, r.stderr
    assert "teacher timm:resnet10t: runs in" in r.stderr
    r = kd_main(*train_args(image_folder, tmp_path / "t", teacher=None, teacher_weights=None, no_progress=True))
    assert r.returncode == 2 and "--teacher is required" in r.stderr


@pytest.mark.slow
def test_compiled_run_trains_like_the_eager_one(image_folder, tmp_path):
    """--compile (torch.compile of teacher and student; inductor's C++ backend on the CPU). The feature
    methods' compiled graphs against eager: tests/test_compile.py."""
    runs = {}
    for name, extra, runner in (("eager", (), kd_main), ("compiled", ("--compile",), run_kd)):  # compiled apart
        # batch 12: each of the 24 training and 12 val images' batches is as large, so each graph compiles
        # once (a last val batch of another size would compile the teacher and the student again)
        args = train_args(image_folder, tmp_path / name, *extra, batch_size=12, no_progress=True)
        r = runner(*args)
        assert r.returncode == 0, r.stderr
        # the first step's line says how much of it torch.compile took
        assert bool(re.search(r"and the step [\d.]+ s \(torch\.compile [\d.]+ s of it\)", r.stderr)) == bool(extra)
        assert "graph break" not in r.stderr  # the step compiles whole (a graph break is said in one line)
        runs[name] = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[-1])
    assert runs["compiled"]["train_loss"] == pytest.approx(runs["eager"]["train_loss"], rel=1e-3)
    assert runs["compiled"]["val_top1"] == pytest.approx(runs["eager"]["val_top1"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_o1_on_cuda(image_folder, tmp_path):
    r = kd.train(tiny_cfg(image_folder, tmp_path / "gpu", device="cuda", opt="O1", epochs=2))
    assert r["train_loss"] == r["train_loss"]  # finite
    assert "gpu_mem_gb" in r


@pytest.mark.parametrize("method", ["fitnet", "at"])
def test_feature_method_connectors_are_trained_and_checkpointed(image_folder, tmp_path, method):
    out = tmp_path / method
    kd.train(tiny_cfg(image_folder, out, kd_loss=method, student="timm:resnet10t", epochs=1, temperature=None))
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert not any(k.startswith(("connectors", "loss.")) for k in state["student"])  # export drops them
    if method == "fitnet":
        assert any(k.startswith("connectors.") for k in state["loss"])
    r = kd_main("train", "--out", out, "--resume", "--epochs", 2)
    assert r.returncode == 0, r.stderr


def test_the_logged_lr_is_the_one_the_epoch_trained_at(image_folder, tmp_path):
    """A milestone after epoch 1: epoch 1 trained at the base lr and is logged so, not at the decayed
    lr (the optimizer's value for the next step), in TensorBoard too."""
    cfg = tiny_cfg(
        image_folder, tmp_path / "lr", no_teacher=True, teacher=None, lr=0.05, lr_schedule="step", lr_milestones=[1]
    )
    kd.train(cfg)
    records = [json.loads(line) for line in (tmp_path / "lr" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records] == pytest.approx([0.05, 0.005])
    events = EventAccumulator(str(tmp_path / "lr" / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("epoch/lr")] == pytest.approx([0.05, 0.005])
    steps = events.Scalars("train/lr")  # each interval's last step
    assert steps[0].value == pytest.approx(0.05) and steps[-1].value == pytest.approx(0.005)


def test_a_missing_bytecode_cache_is_named_with_its_fix(tmp_path):
    """Without bytecode for torch every process compiles its sources again (7.5 s of an H200
    machine's start): the first-step line's companion says so and how to make the cache."""
    import importlib.util
    import py_compile
    import sys
    import types

    from kd.run.log import bytecode_note

    source = tmp_path / "fakepkg" / "__init__.py"
    source.parent.mkdir()
    source.write_text("X = 1\n")
    module = types.ModuleType("fakepkg")
    module.__file__ = str(source)
    note = bytecode_note(module)
    assert note is not None and "no bytecode for fakepkg" in note
    assert f"python -m compileall -q -j 0 {source.parent}" in note
    py_compile.compile(str(source), cfile=importlib.util.cache_from_source(str(source)))
    assert bytecode_note(module) is None
    assert bytecode_note(types.ModuleType("builtin_like")) is None  # no source file: nothing to say
    assert sys.modules.get("fakepkg") is None


def test_a_run_that_cannot_learn_says_so_once_while_it_trains(tmp_path):
    """The same images in every class at an lr too small to memorise their crops: the cross-entropy
    cannot leave log C, nor val top-1 chance. After the second epoch one line says the run is not
    learning, with what to try (a teacher at chance for 10 epochs said nothing)."""
    import shutil

    from conftest import make_image_folder

    data = make_image_folder(tmp_path / "same", classes=4, train_per_class=6, val_per_class=3)
    for split in ("train", "val"):
        first, *others = sorted((data / split).iterdir())
        for folder in others:
            shutil.rmtree(folder)
            shutil.copytree(first, folder)
    r = kd_main(*train_args(data, tmp_path / "run", no_teacher=True, epochs=2, lr=0.0001))
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stderr.splitlines() if line.startswith("not learning:")]
    assert len(said) == 1 and "after 2 epoch(s) is still at chance (chance is log 4 = 1.39)" in said[0], r.stderr
    assert "try --lr 5e-05 --lr-schedule cosine --warmup-epochs 1 --min-crop-scale 0.25" in said[0]
