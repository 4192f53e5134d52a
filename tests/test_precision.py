"""Opt levels O0-O3: through ``kd train`` on the CPU in bfloat16, and the precision objects
in-process (float16 on the CPU where only the scaler is under test). GPU tests carry ``gpu``."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    HANG_GUARD,
    ROOT,
    has_apex_amp,
    in_process_trainer,
    kd_main,
    last_checkpoint,
    make_image_folder,
    run_kd,
    tiny_config,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from kd import config as kd_config
from kd.errors import KDError
from kd.losses import DistillInputs, DistillLoss, MethodCard
from kd.precision import AutocastPrecision, CastPrecision, MasterWeightPrecision, Precision, make_precision
from kd.run.loop import Trainer
from kd.run.record import StepInputs
from kd.run.sides import StudentSide
from kd.run.step import apply_gradients

LEVELS = ["O0", "O1", "O2", "O3"]
EPOCHS = 5
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # deterministic and unhurt by other jobs


def kd_one_thread(*args):
    """``kd ARGS`` in this process on one thread."""
    return kd_main(*args, env=ONE_THREAD, threads=1)


TRAIN = [
    "--teacher",
    "resnet18",
    "--teacher-weights",
    "none",
    "--student",
    "mobilenet_v3_small",
    "--image-size",
    32,
    "-b",
    8,
    "-j",
    0,
    "--lr",
    0.03,
    "--lr-schedule",
    "constant",
    "--device",
    "cpu",
    "--log-every",
    1,
]
CPU = torch.device("cpu")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_apex = pytest.mark.skipif(not has_apex_amp(), reason="needs NVIDIA apex with apex.amp (25.05 or older)")


def train(data, out, *args):
    r = kd_one_thread("train", "--data", data, *TRAIN, "--out", out, *args)
    assert r.returncode == 0, r.stderr
    return r


def records(out: Path):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def scalars(out: Path, tag: str):
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    return [e.value for e in events.Scalars(tag)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("precision_data"))


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """One uninterrupted run per level, {level: (out, stderr)}, shared by the tests below."""
    root = tmp_path_factory.mktemp("levels")
    return {opt: (root / opt, train(data, root / opt, "--epochs", EPOCHS, "--opt", opt).stderr) for opt in LEVELS}


def tiny_cfg(data, out, **kw):
    return tiny_config(
        data, out, **{"student": "mobilenet_v3_small", "lr": 0.03, "lr_schedule": "constant", "log_every": 1, **kw}
    )


def trainer(cfg, precision=None) -> Trainer:
    """A Trainer for ``cfg``; ``precision`` replaces the one kd would choose (levels the CLI does not offer)."""
    return in_process_trainer(cfg, precision)


# ----------------------------------------------------------------------------- kd train, per level
@pytest.mark.parametrize("opt", LEVELS)
def test_level_learns_through_the_cli(runs, opt):
    out, stderr = runs[opt]
    described = {
        "O0": "precision O0 (native, float32, no loss scaling)",
        "O1": "precision O1 (native, float32 weights, autocast to bfloat16, no loss scaling)",
        "O2": "precision O2 (native, bfloat16 weights, BatchNorm float32, float32 master weights, no loss scaling)",
        "O3": "precision O3 (native, bfloat16 weights, no loss scaling)",
    }[opt]
    assert described in stderr
    losses = [r["train_loss"] for r in records(out)]
    assert len(losses) == EPOCHS and all(math.isfinite(x) for x in losses)
    assert min(losses[-2:]) < 0.85 * losses[0], losses
    reference = [r["train_loss"] for r in records(runs["O0"][0])]
    assert losses == pytest.approx(reference, rel=0.15)  # reduced precision tracks float32


@pytest.mark.parametrize("opt", LEVELS)
def test_tensorboard_logs_skipped_steps_and_loss_scale(runs, opt):
    out, _ = runs[opt]
    steps = EPOCHS * 3  # 24 images, batch 8
    assert scalars(out, "train/skipped_steps") == [0.0] * steps
    assert scalars(out, "train/loss_scale") == [1.0] * steps  # bfloat16 (and O0) need no scaling
    assert [r["train_skipped_steps"] for r in records(out)] == [0.0] * EPOCHS


@pytest.mark.parametrize("opt", LEVELS)
def test_checkpoints_hold_float32_weights(runs, opt):
    state = last_checkpoint(runs[opt][0])
    floats = [v for v in state["student"].values() if v.is_floating_point()]
    assert floats and all(v.dtype == torch.float32 for v in floats)
    assert state["precision"]["opt"] == opt and state["precision"]["impl"] == "native"


def test_o2_checkpoint_evaluates_at_o0(runs, data):
    out, _ = runs["O2"]
    r = kd_one_thread(
        "eval",
        "--model",
        "mobilenet_v3_small",
        "--weights",
        out / "checkpoints" / "last.pt",
        "--data",
        data,
        "--image-size",
        32,
        "-b",
        8,
        "-j",
        0,
        "--device",
        "cpu",
    )
    assert r.returncode == 0, r.stderr
    assert "top-1" in r.stdout and "(12 images)" in r.stdout


@pytest.mark.parametrize("opt", LEVELS)
def test_evaluate_model_at_each_level(runs, data, opt):
    from kd.commands.evaluate import evaluate_model

    weights = runs["O2"][0] / "checkpoints" / "last.pt"
    r = evaluate_model(
        "mobilenet_v3_small", str(weights), str(data), batch_size=8, device="cpu", image_size=32, workers=0, opt=opt
    )
    assert r["count"] == 12 and 0.0 <= r["top1"] <= 100.0 and math.isfinite(r["loss"])


@pytest.mark.parametrize("opt", ["O1", "O2"])
def test_resume_equals_uninterrupted_run(runs, data, tmp_path, opt):
    full, _ = runs[opt]
    part = tmp_path / "part"
    train(data, part, "--epochs", 1, "--opt", opt)
    r = kd_one_thread("train", "--out", part, "--resume", "--epochs", EPOCHS)
    assert r.returncode == 0, r.stderr
    a, b = last_checkpoint(full), last_checkpoint(part)
    assert a["global_step"] == b["global_step"] == EPOCHS * 3
    for key in a["student"]:
        assert torch.equal(a["student"][key], b["student"][key]), key
    assert a["precision"] == b["precision"]
    assert [r["train_loss"] for r in records(full)] == [r["train_loss"] for r in records(part)]


def test_a_checkpoint_resumes_at_another_level(data, tmp_path):
    out = tmp_path / "o1_then_o2"
    train(data, out, "--epochs", 1, "--opt", "O1")
    r = kd_one_thread("train", "--out", out, "--resume", "--epochs", 2, "--opt", "O2")
    assert r.returncode == 0, r.stderr
    assert "precision O2 (native" in r.stderr
    state = last_checkpoint(out)
    assert state["epoch"] == 2 and state["precision"]["opt"] == "O2"
    assert all(math.isfinite(rec["train_loss"]) for rec in records(out))


# ----------------------------------------------------------------------------- dtypes in the Trainer
def _dtypes(module: nn.Module, bn: bool):
    from torch.nn.modules.batchnorm import _BatchNorm

    return {p.dtype for m in module.modules() if isinstance(m, _BatchNorm) == bn for p in m.parameters(recurse=False)}


def test_o1_teacher_stores_the_weights_autocast_would_use(data, tmp_path):
    """At O1 the frozen teacher's conv/linear weights are kept in the autocast dtype (BatchNorm
    float32), and its logits equal those of the float32 teacher under autocast."""
    import copy

    t = trainer(tiny_cfg(data, tmp_path / "o1", opt="O1", fuse_teacher=False))
    teacher = t.teacher.module.teacher
    assert _dtypes(teacher, bn=False) == {torch.bfloat16} and _dtypes(teacher, bn=True) == {torch.float32}
    reference = copy.deepcopy(teacher).float()  # bf16 -> float32 is exact: the weights autocast casts back
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(teacher(x), reference(x))


def test_o2_weights_bfloat16_batchnorm_float32_masters_float32(data, tmp_path):
    t = trainer(tiny_cfg(data, tmp_path / "o2", opt="O2", fuse_teacher=False))
    student, teacher = t.lane.side.student, t.teacher.module.teacher
    assert _dtypes(student, bn=False) == {torch.bfloat16} and _dtypes(student, bn=True) == {torch.float32}
    assert _dtypes(teacher, bn=False) == {torch.bfloat16} and _dtypes(teacher, bn=True) == {torch.float32}
    assert all(b.dtype == torch.float32 for n, b in student.named_buffers() if "running" in n)
    masters = [p for g in t.lane.optimizer.param_groups for p in g["params"]]
    assert masters and all(p.dtype == torch.float32 for p in masters)
    assert not {id(p) for p in masters} & {id(p) for p in student.parameters() if p.dtype == torch.bfloat16}
    t.fit()
    assert all(p.dtype == torch.float32 for g in t.lane.optimizer.param_groups for p in g["params"])
    assert _dtypes(student, bn=False) == {torch.bfloat16} and _dtypes(student, bn=True) == {torch.float32}
    state = t.lane.precision.model_state(t.lane.side)
    for name, p in student.named_parameters():
        assert state[f"student.{name}"].dtype == torch.float32
        assert torch.equal(state[f"student.{name}"].to(p.dtype), p.detach())  # the model is its masters, rounded


def test_o3_everything_bfloat16_no_masters(data, tmp_path):
    t = trainer(tiny_cfg(data, tmp_path / "o3", opt="O3", fuse_teacher=False))
    assert {p.dtype for p in t.lane.side.student.parameters()} == {torch.bfloat16}
    teacher = t.teacher.module.teacher  # its own precision (kd.teacher.precision): weights in bfloat16 under autocast
    assert _dtypes(teacher, bn=False) == {torch.bfloat16} and _dtypes(teacher, bn=True) == {torch.float32}
    opt_params = {id(p) for g in t.lane.optimizer.param_groups for p in g["params"]}
    assert opt_params == {id(p) for p in t.lane.side.parameters() if p.requires_grad}


class ConnectorLoss(DistillLoss):
    """A feature-style loss with a trainable connector (not registered)."""

    def __init__(self):
        super().__init__(num_classes=3)
        self.proj = nn.Linear(4, 4)
        self.seen = []

    def forward(self, x):
        self.seen = [x.student_logits.dtype, x.student_feats["3"].dtype]
        feat = self.proj(x.student_feats["3"].flatten(1))
        return {"loss": nn.functional.cross_entropy(x.student_logits, x.labels) + feat.pow(2).mean()}


def test_loss_module_stays_float32_and_sees_float32():
    torch.manual_seed(0)
    student = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)
    )
    side = StudentSide(student, ConnectorLoss(), layers=["3"])
    optimizer = torch.optim.SGD(side.parameters(), lr=0.1)
    precision = MasterWeightPrecision(CPU, torch.bfloat16)
    side, optimizer = precision.convert(side, optimizer)
    assert side.loss.proj.weight.dtype == torch.float32
    images = precision.input_cast(torch.randn(4, 3, 8, 8))
    parts = side(StepInputs(images, {"labels": torch.tensor([0, 1, 2, 0])}))
    assert side.loss.seen == [torch.float32, torch.float32]
    before = side.loss.proj.weight.detach().clone()
    apply_gradients(precision, parts["loss"], optimizer, side.parameters(), lambda: None, None)
    assert not torch.equal(before, side.loss.proj.weight)  # connectors train, in float32


# ----------------------------------------------------------------------------- master weights, skips, scaler
def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def setup_small(cls, dtype):
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True)
    precision = cls(CPU, dtype)
    model, optimizer = precision.convert(model, optimizer)
    return precision, model, optimizer


def one_step(precision, model, optimizer, seed=0, clip=1.0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
    with precision.autocast():
        out = model(precision.input_cast(x))
    loss = nn.functional.cross_entropy(out.float(), y)
    return apply_gradients(
        precision, loss, optimizer, [p for p in model.parameters() if p.requires_grad], lambda: None, clip
    )


def snapshot(model, optimizer):
    masters = [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]
    state = [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()]
    return [p.detach().clone() for p in model.parameters()], masters, state


@pytest.mark.parametrize(
    "cls,dtype",
    [
        (Precision, torch.float32),
        (AutocastPrecision, torch.bfloat16),
        (MasterWeightPrecision, torch.float16),
        (MasterWeightPrecision, torch.bfloat16),
        (CastPrecision, torch.bfloat16),
    ],
)
def test_every_level_skips_a_nan_loss_under_the_one_policy(cls, dtype):
    """The update's policy is kd.run.step.apply_gradients', not a level's: no level bundles its own
    step, and at each a NaN loss leaves weights, masters and optimizer state as they were, then the
    next step trains."""
    assert not any("step" in vars(c) for c in cls.__mro__)
    precision, model, optimizer = setup_small(cls, dtype)
    one_step(precision, model, optimizer, seed=1)  # optimizer state (momentum) to keep
    before = snapshot(model, optimizer)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 3, (8,))
    with precision.autocast():
        loss = nn.functional.cross_entropy(model(precision.input_cast(x)).float(), y) * float("nan")
    params = [p for p in model.parameters() if p.requires_grad]
    assert bool(apply_gradients(precision, loss, optimizer, params, lambda: None, 1.0))
    after = snapshot(model, optimizer)
    for a, b in zip(before[0] + before[1], after[0] + after[1]):
        assert torch.equal(a, b)
    assert all(torch.equal(v, after[2][i][k]) for i, s in enumerate(before[2]) for k, v in s.items())
    assert not bool(one_step(precision, model, optimizer, seed=2))
    assert not all(torch.equal(a, b) for a, b in zip(after[0], snapshot(model, optimizer)[0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_o2_masters_stay_float32_and_model_follows(dtype):
    precision, model, optimizer = setup_small(MasterWeightPrecision, dtype)
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    for seed in range(4):
        assert not bool(one_step(precision, model, optimizer, seed))
    assert all(m.dtype == torch.float32 and m.grad is None for m in masters)
    assert all(p.grad is None for p in model.parameters())
    conv = model[0].weight
    assert conv.dtype == dtype and model[1].weight.dtype == torch.float32
    state = precision.model_state(model)
    assert torch.equal(state["0.weight"].to(dtype), conv.detach())
    assert not torch.equal(state["0.weight"], conv.detach().float())  # the master holds more than the model


@pytest.mark.parametrize("cls", [AutocastPrecision, MasterWeightPrecision], ids=["O1", "O2"])
def test_overflow_skips_the_step_and_backs_off(cls):
    precision, model, optimizer = setup_small(cls, torch.float16)  # float16 scaler, on the CPU
    assert not bool(one_step(precision, model, optimizer, seed=0))  # optimizer state exists from here
    params, masters, state = snapshot(model, optimizer)
    assert state
    scale = float(precision.loss_scale())
    handle = model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    skipped = one_step(precision, model, optimizer, seed=1)
    handle.remove()
    assert skipped.dtype == torch.bool and skipped.shape == () and bool(skipped)
    assert float(precision.loss_scale()) == scale / 2
    params_after, masters_after, state_after = snapshot(model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(params + masters, params_after + masters_after))
    assert all(torch.equal(s[k], t[k]) for s, t in zip(state, state_after) for k in s)
    assert not bool(one_step(precision, model, optimizer, seed=2))
    assert not torch.equal(params[0], model[0].weight)


@pytest.mark.parametrize("cls", [AutocastPrecision, MasterWeightPrecision], ids=["O1", "O2"])
def test_float16_scaler_state_round_trips_through_a_checkpoint(cls, tmp_path):
    a, model_a, opt_a = setup_small(cls, torch.float16)
    for seed in range(3):
        one_step(a, model_a, opt_a, seed)
    handle = model_a[0].weight.register_hook(lambda g: g * float("nan"))
    one_step(a, model_a, opt_a, 3)  # skipped: scale 2**15, growth tracker reset
    handle.remove()
    for seed in range(4, 6):
        one_step(a, model_a, opt_a, seed)  # growth tracker 2
    torch.save(
        {"model": a.model_state(model_a), "optimizer": opt_a.state_dict(), "precision": a.state_dict()},
        tmp_path / "ckpt.pt",
    )
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["precision"]["scaler"]["scale"] == 2.0**15 and ckpt["precision"]["scaler"]["_growth_tracker"] == 2
    b, model_b, opt_b = setup_small(cls, torch.float16)
    b.load_model_state(model_b, ckpt["model"])
    opt_b.load_state_dict(ckpt["optimizer"])
    b.load_state_dict(ckpt["precision"])
    assert b.scaler.state_dict() == a.scaler.state_dict()
    for seed in range(6, 9):
        one_step(a, model_a, opt_a, seed)
        one_step(b, model_b, opt_b, seed)
    for (name, pa), pb in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert a.model_state(model_a).keys() == b.model_state(model_b).keys()
    assert all(torch.equal(x, y) for x, y in zip(a.model_state(model_a).values(), b.model_state(model_b).values()))
    assert b.scaler.state_dict() == a.scaler.state_dict()


def test_skipped_steps_are_counted_by_the_engine(data, tmp_path):
    """float16 O2 on the CPU (not offered by the CLI) in a real Trainer, with one poisoned gradient."""
    cfg = tiny_cfg(data, tmp_path / "skip", opt="O2")
    t = trainer(cfg, MasterWeightPrecision(CPU, torch.float16))
    calls = []

    def poison_once(grad):
        calls.append(1)
        return torch.full_like(grad, float("inf")) if len(calls) == 2 else grad

    t.lane.side.student.classifier[-1].weight.register_hook(poison_once)
    record = t.fit()
    assert record["train_skipped_steps"] == 1.0 and math.isfinite(record["train_loss"])
    assert scalars(Path(cfg.out), "train/skipped_steps")[:2] == [0.0, 1.0]
    assert scalars(Path(cfg.out), "train/loss_scale") == [2.0**16, 2.0**15, 2.0**15]
    assert last_checkpoint(Path(cfg.out))["precision"]["scaler"]["scale"] == 2.0**15


# ----------------------------------------------------------------------------- non-finite losses stop a run
class NanAfterEpoch1(DistillLoss):
    """Cross-entropy, then NaN from the second epoch on (a run going bad). Not registered: the
    registry is global, and every registered loss must have golden-value tests."""

    card = MethodCard(needs_teacher=False, reads_progress=True)
    name = "nan_after_epoch_1"

    def forward(self, x: DistillInputs):
        ce = nn.functional.cross_entropy(x.student_logits.float(), x.labels)
        return {"loss": ce * (float("nan") if x.progress >= 1.0 else 1.0)}


@pytest.mark.parametrize("opt", ["O1", "O2"])
def test_nonfinite_losses_stop_the_run_and_keep_the_last_good_checkpoint(data, tmp_path, opt, monkeypatch):
    import kd.run.build

    monkeypatch.setattr(kd.run.build, "build_loss", lambda name, num_classes, args: NanAfterEpoch1(num_classes))
    cfg = tiny_cfg(data, tmp_path / "nan", opt=opt, epochs=3, max_nonfinite_steps=2)
    t = trainer(cfg)
    with pytest.raises(KDError, match="not finite for 2 consecutive steps"):
        t.fit()
    t.close()
    state = last_checkpoint(Path(cfg.out))
    assert state["epoch"] == 1 and state["global_step"] == 3 and t.lane.state.global_step == 5
    # the two NaN steps after that checkpoint reached neither the weights nor the buffers
    held = t.lane.precision.model_state(t.lane.side)
    for key, value in state["student"].items():
        assert torch.equal(value, held[f"student.{key}"]), key
    assert len(records(Path(cfg.out))) == 1


# ----------------------------------------------------------------------------- choosing the implementation
def error_lines(r):
    assert "Traceback" not in r.stderr, r.stderr
    return [line for line in r.stderr.splitlines() if line.startswith("kd: error: ")] if r.returncode == 2 else []


def test_float16_on_the_cpu_is_a_clear_error(data, tmp_path):
    r = kd_one_thread(
        "train",
        "--data",
        data,
        *TRAIN,
        "--out",
        tmp_path / "f16",
        "--epochs",
        1,
        "--opt",
        "O1",
        "--amp-dtype",
        "float16",
    )
    lines = error_lines(r)
    assert len(lines) == 1 and "float16 needs CUDA" in lines[0], r.stderr
    assert not (tmp_path / "f16" / "config.yaml").exists()


@pytest.mark.skipif(has_apex_amp(), reason="apex.amp is installed here")
def test_amp_impl_apex_without_apex_is_one_line_exit_2(data, tmp_path):
    r = kd_one_thread(
        "train", "--data", data, *TRAIN, "--out", tmp_path / "apex", "--epochs", 1, "--opt", "O2", "--amp-impl", "apex"
    )
    lines = error_lines(r)
    assert len(lines) == 1, r.stderr
    assert "--amp-impl apex" in lines[0] and "25.05" in lines[0] and "--amp-impl native" in lines[0]
    assert not (tmp_path / "apex" / "config.yaml").exists()


@pytest.mark.skipif(has_apex_amp(), reason="apex.amp is installed here")
@pytest.mark.parametrize("opt", ["O1", "O2"])
def test_prefer_apex_without_apex_says_native(opt):
    cfg = dataclasses.replace(kd_config.RunConfig(), opt=opt)
    precision = make_precision(cfg, CPU, prefer_apex=True)
    assert precision.impl == "native" and precision.opt == opt
    assert "native" in precision.describe() and "not apex.amp" in precision.describe()
    assert "apex" not in make_precision(cfg, CPU).describe()


def test_amp_impl_apex_on_the_cpu_is_refused():
    from kd.precision import apex as apex_amp

    cfg = dataclasses.replace(kd_config.RunConfig(), opt="O1", amp_impl="apex")
    reason = apex_amp.unavailable(cfg, CPU)
    assert reason  # not installed, or needs CUDA
    with pytest.raises(KDError, match="--amp-impl apex: "):
        make_precision(cfg, CPU)


def test_without_the_apex_module_the_rest_works(monkeypatch):
    import kd.precision

    monkeypatch.setitem(sys.modules, "kd.precision.apex", None)  # as if kd/precision/apex.py were deleted
    monkeypatch.delattr(kd.precision, "apex", raising=False)
    cfg = dataclasses.replace(kd_config.RunConfig(), opt="O2")
    assert "not apex.amp" in make_precision(cfg, CPU, prefer_apex=True).describe()
    with pytest.raises(KDError, match="kd/precision/apex.py is not installed"):
        make_precision(dataclasses.replace(cfg, amp_impl="apex"), CPU)


def test_o0_is_plain_float32():
    p = make_precision(kd_config.RunConfig(), CPU)
    assert type(p) is Precision and p.dtype == torch.float32 and p.scaler is None
    assert float(p.loss_scale()) == 1.0


def test_slow_precision_warning_names_what_to_do():
    from kd.precision.cpu import slow_precision_warning

    cpu = torch.device("cpu")
    avx2 = {"sse4_2", "avx", "avx2", "fma"}
    warning = slow_precision_warning("O1", torch.bfloat16, cpu, flags=avx2)
    assert warning and "--opt O0" in warning and "bfloat16" in warning and "AMX" in warning, warning
    assert "\n" not in warning and "20-35x" in warning
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    warning = slow_precision_warning("O1", torch.bfloat16, cpu, flags=avx512)
    assert warning and "1.7x" in warning and "--opt O0" in warning, warning
    assert slow_precision_warning("O2", torch.bfloat16, cpu, flags=avx512 | {"avx512_bf16"}) is None
    assert slow_precision_warning("O1", torch.bfloat16, cpu, flags=avx2 | {"amx_bf16", "amx_tile"}) is None
    assert slow_precision_warning("O1", torch.bfloat16, cpu, flags={"fp", "asimd", "bf16"}) is None  # Arm with BF16
    assert slow_precision_warning("O0", torch.float32, cpu, flags=avx2) is None
    assert slow_precision_warning("O1", torch.bfloat16, torch.device("cuda", 0), flags=avx2) is None
    assert slow_precision_warning("O1", torch.bfloat16, cpu, flags=set()) is None  # flags unknown: no guess


def test_cpu_flags_of_this_machine():
    from kd.precision.cpu import cpu_flags

    if not Path("/proc/cpuinfo").is_file():
        pytest.skip("no /proc/cpuinfo: kd reads no flags here")
    flags = cpu_flags()
    assert flags and all(f == f.lower() and " " not in f for f in flags)


def test_precision_line_without_apex_closes_its_parentheses():
    import importlib.util

    from kd.config import RunConfig
    from kd.precision import make_precision

    if importlib.util.find_spec("apex"):
        pytest.skip("apex is installed: its reason differs")
    line = make_precision(RunConfig(opt="O1"), torch.device("cpu"), prefer_apex=True).describe()
    assert line.count("(") == line.count(")"), line


# ----------------------------------------------------------------------------- CUDA (float16) and real apex
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("opt", ["O1", "O2", "O3"])
def test_float16_levels_on_cuda(data, tmp_path, opt):
    cfg = tiny_cfg(data, tmp_path / opt, device="cuda", opt=opt, epochs=3)
    t = trainer(cfg)
    assert t.lane.precision.dtype == torch.float16 and "float16" in t.lane.precision.describe()
    if opt in ("O2", "O3"):
        assert t.lane.side.student.features[0][0].weight.dtype == torch.float16
        assert t.teacher.module.teacher.conv1.weight.dtype == torch.float16
    if opt == "O2":
        assert t.lane.side.student.features[0][1].weight.dtype == torch.float32
        assert all(p.dtype == torch.float32 for g in t.lane.optimizer.param_groups for p in g["params"])
    record = t.fit()
    first = records(Path(cfg.out))[0]["train_loss"]
    assert math.isfinite(record["train_loss"]) and record["train_loss"] < first * 1.2
    scale = scalars(Path(cfg.out), "train/loss_scale")
    skipped = sum(rec["train_skipped_steps"] for rec in records(Path(cfg.out)))
    assert scale[-1] == (1.0 if opt == "O3" else 2.0**16 / 2**skipped)
    state = last_checkpoint(Path(cfg.out))
    assert all(v.dtype == torch.float32 for v in state["student"].values() if v.is_floating_point())
    if opt != "O3":
        assert state["precision"]["scaler"]["scale"] == scale[-1]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("opt", ["O1", "O2"])
def test_fused_sgd_on_cuda_matches_foreach(data, tmp_path, opt, monkeypatch):
    """CUDA runs use fused SGD (the scaler's inf check stays on the device), and its steps are
    foreach SGD's: the same weights, masters and momentum after each of several float16 steps, one
    of them skipped, from the same gradients (a small model without atomics in its backward and
    deterministic cuDNN, so that both get the same gradients; two whole runs of a real student
    drift apart by cuDNN's nondeterminism alone)."""
    t = trainer(tiny_cfg(data, tmp_path / opt, device="cuda", opt=opt))
    assert t.lane.optimizer.defaults.get("fused") is True
    t.close()
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    cls = {"O1": AutocastPrecision, "O2": MasterWeightPrecision}[opt]
    cuda = torch.device("cuda")
    runs = []
    for fused in (True, False):
        model = small_model().cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, fused=fused)
        precision = cls(cuda, torch.float16)
        model, optimizer = precision.convert(model, optimizer)
        runs.append((precision, model, optimizer))
    for seed in range(6):
        skipped = []
        for precision, model, optimizer in runs:
            g = torch.Generator().manual_seed(seed)
            x, y = torch.randn(8, 3, 8, 8, generator=g).cuda(), torch.randint(0, 3, (8,), generator=g).cuda()
            with precision.autocast():
                out = model(precision.input_cast(x))
            loss = nn.functional.cross_entropy(out.float(), y) * (float("inf") if seed == 3 else 1.0)
            params = [p for p in model.parameters() if p.requires_grad]
            skipped.append(bool(apply_gradients(precision, loss, optimizer, params, lambda: None, 1.0)))
        assert skipped == [seed == 3] * 2
        (pa, ma, sa), (pb, mb, sb) = (snapshot(model, optimizer) for _, model, optimizer in runs)
        for x, y in zip(pa + ma, pb + mb):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        for x, y in zip(sa, sb):
            torch.testing.assert_close(x["momentum_buffer"], y["momentum_buffer"], rtol=1e-5, atol=1e-6)
    assert runs[0][0].scaler.state_dict() == runs[1][0].scaler.state_dict()


@pytest.mark.gpu
@needs_cuda
def test_skipped_step_on_cuda_float16():
    model = small_model().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precision = MasterWeightPrecision(torch.device("cuda"), torch.float16)
    model, optimizer = precision.convert(model, optimizer)
    x, y = torch.randn(8, 3, 8, 8, device="cuda"), torch.randint(0, 3, (8,), device="cuda")
    loss = nn.functional.cross_entropy(model(precision.input_cast(x)).float(), y)
    assert not bool(apply_gradients(precision, loss, optimizer, model.parameters(), lambda: None, 1.0))
    before = [p.detach().clone() for p in model.parameters()]
    loss = nn.functional.cross_entropy(model(precision.input_cast(x)).float(), y) * float("inf")
    assert bool(apply_gradients(precision, loss, optimizer, model.parameters(), lambda: None, 1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert float(precision.loss_scale()) == 2.0**15


@pytest.mark.gpu
@needs_cuda
@needs_apex
@pytest.mark.parametrize("opt", ["O1", "O2", "O3"])
def test_real_apex_amp_levels(data, tmp_path, opt):
    out = tmp_path / opt
    args = [a if a != "cpu" else "cuda" for a in TRAIN]
    # a fresh process for each run: amp.initialize can run once per process
    r = run_kd("train", "--data", data, *args, "--opt", opt, "--amp-impl", "apex", "--out", out, "--epochs", 1)
    assert r.returncode == 0, r.stderr
    assert f"precision {opt} (apex" in r.stderr
    r = run_kd("train", "--out", out, "--resume", "--epochs", 2)
    assert r.returncode == 0, r.stderr
    state = last_checkpoint(out)
    assert state["epoch"] == 2 and state["precision"]["impl"] == "apex"
    assert all(v.dtype == torch.float32 for v in state["student"].values() if v.is_floating_point())
    assert all(math.isfinite(rec["train_loss"]) for rec in records(out))
    if opt != "O3":
        assert "loss_scaler0" in state["precision"]["amp"]


APEX_NAN_STEP = """
import sys, torch
from types import SimpleNamespace
from torch import nn
from kd.precision.apex import ApexAmpPrecision
from kd.run.step import apply_gradients

opt = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3)).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
precision = ApexAmpPrecision(SimpleNamespace(opt=opt), torch.device("cuda"))
model, optimizer = precision.convert(model, optimizer)
x, y = torch.randn(8, 3, 8, 8, device="cuda"), torch.randint(0, 3, (8,), device="cuda")
params = [p for p in model.parameters() if p.requires_grad]
before = [p.detach().clone() for p in params]
loss = nn.functional.cross_entropy(model(precision.input_cast(x)).float(), y) * float("nan")
skipped = bool(apply_gradients(precision, loss, optimizer, params, lambda: None, None))
kept = all(torch.equal(a, b) for a, b in zip(before, params))
loss = nn.functional.cross_entropy(model(precision.input_cast(x)).float(), y)
stepped = not bool(apply_gradients(precision, loss, optimizer, params, lambda: None, None))
print(skipped, kept, stepped, all(bool(torch.isfinite(p).all()) for p in params))
"""


@pytest.mark.gpu
@needs_cuda
@needs_apex
@pytest.mark.parametrize("opt", ["O0", "O1", "O2", "O3"])
def test_real_apex_skips_nonfinite_gradients_at_every_level(opt):
    """apex skips only with a dynamic loss scale (O1/O2); at O0/O3 (static scale 1) kd checks the
    gradients itself, so a NaN step leaves the weights as they were (a fresh process per level:
    amp.initialize runs once per process)."""
    r = subprocess.run(
        [sys.executable, "-c", APEX_NAN_STEP, opt],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=HANG_GUARD,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "True", "True"], (r.stdout, r.stderr)


@pytest.mark.gpu
@needs_cuda
@needs_apex
def test_prefer_apex_picks_apex_for_float16_and_native_for_bfloat16():
    cuda = torch.device("cuda")
    cfg = dataclasses.replace(kd_config.RunConfig(), opt="O2")
    assert make_precision(cfg, cuda, prefer_apex=True).impl == "apex"
    native = make_precision(dataclasses.replace(cfg, amp_dtype="bfloat16"), cuda, prefer_apex=True)
    assert native.impl == "native" and "not apex.amp: apex.amp does float16 only" in native.describe()
    with pytest.raises(KDError, match="float16 only"):
        make_precision(dataclasses.replace(cfg, amp_dtype="bfloat16", amp_impl="apex"), cuda)


def test_apex_casts_come_back_on_after_a_teacher_forward_that_raises():
    """apex's own disable_casts() leaves its casts off for the rest of the process when the block
    raises (no try/finally); kd's turns them back on (the handle is apex's AmpHandle's one flag)."""
    from types import SimpleNamespace

    from kd.precision.apex import _casts_off

    handle = SimpleNamespace(_is_active=True)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        with _casts_off(handle):
            assert handle._is_active is False
            raise RuntimeError("CUDA out of memory (in the teacher's forward)")
    assert handle._is_active is True
