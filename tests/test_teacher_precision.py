"""The teacher's own precision (kd.teacher.precision) and non-finite losses at every opt level, on the CPU.

The teachers are trained by kd itself (``--no-teacher``), then given a classifier bias that a
reduced precision cannot carry: 3.40e38 is finite in float32 but rounds to inf in bfloat16
(non-finite logits), and 1e5 leaves the class signal below bfloat16's resolution there (its
top-1 drops to chance). Real runs through kd.train and the CLI; no mocks.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import kd_main, make_image_folder, train_args
from torch import nn

import backends
import kd
from kd import config as kd_config
from kd.errors import KDError
from kd.losses import DistillInputs, DistillLoss, MethodCard
from kd.run.loop import Trainer
from kd.run.students import Students

NET = "timm:resnet10t"
BASE = dict(
    image_size=32,
    batch_size=8,
    workers=0,
    lr=0.05,
    lr_schedule="constant",
    device="cpu",
    log_every=1,
    epochs=1,
    progress_bar=False,
)


def cfg_for(data, out, **kw):
    return kd_config.resolve(options={**BASE, "data": str(data), "out": str(out), "teacher": NET, "student": NET, **kw})


def records(out: Path):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("tp_data"), classes=3, train_per_class=8, val_per_class=8)


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> Path:
    """A teacher trained by kd (val top-1 100 here): its best.pt."""
    out = tmp_path_factory.mktemp("teacher") / "run"
    kd.train(cfg_for(data, out, no_teacher=True, teacher=None, epochs=4))
    return out / "checkpoints" / "best.pt"


def with_bias(trained: Path, bias: float, folder: Path) -> Path:
    """The trained teacher's checkpoint with ``bias`` added to every logit."""
    state = torch.load(trained, weights_only=True)
    state["student"]["fc.bias"] = state["student"]["fc.bias"] + bias
    path = folder / f"teacher_bias_{bias:g}.pt"
    torch.save(state, path)
    return path


def test_overflowing_teacher_falls_back_to_float32_and_trains(data, trained, tmp_path):
    weights = with_bias(trained, 3.40e38, tmp_path)
    out = tmp_path / "o1"
    r = kd_main(*train_args(data, out, teacher=NET, teacher_weights=weights, student=NET, opt="O1", epochs=2, lr=0.05))
    assert r.returncode == 0, r.stderr
    assert "runs in float32 (auto:" in r.stderr and "bfloat16 was refused: non-finite logits" in r.stderr, r.stderr
    # where the start went: the refused probe and the chosen one, each with its seconds
    assert re.search(rf"teacher {NET}: probes bfloat16 \d+\.\d s, float32 \d+\.\d s\n", r.stderr), r.stderr
    saved = (out / "config.yaml").read_text()
    assert yaml.safe_load(saved)["teacher_precision"] == "float32"
    assert "# teacher timm:resnet10t: runs in float32" in saved
    for rec in records(out):
        assert math.isfinite(rec["train_loss"]) and math.isfinite(rec["train_kd"]) and rec["train_skipped_steps"] == 0


def test_teacher_that_loses_its_accuracy_in_bfloat16_falls_back(data, trained, tmp_path):
    cfg = cfg_for(data, tmp_path / "acc", teacher_weights=str(with_bias(trained, 1e5, tmp_path)), opt="O1")
    kd.train(cfg)
    saved = (tmp_path / "acc" / "config.yaml").read_text()
    assert yaml.safe_load(saved)["teacher_precision"] == "float32"
    assert "bfloat16 was refused: top-1" in saved and "in float32" in saved


def test_a_healthy_teacher_keeps_the_run_precision(data, trained, tmp_path):
    kd.train(cfg_for(data, tmp_path / "ok", teacher_weights=str(trained), opt="O1"))
    assert yaml.safe_load((tmp_path / "ok" / "config.yaml").read_text())["teacher_precision"] == "bfloat16"


def test_explicit_precision_that_fails_is_one_line_exit_2(data, trained, tmp_path):
    weights = with_bias(trained, 3.40e38, tmp_path)
    pair = dict(teacher=NET, teacher_weights=weights, student=NET)
    r = kd_main(*train_args(data, tmp_path / "x", **pair, opt="O1", teacher_precision="bfloat16", epochs=None))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("kd: error:")]
    assert len(lines) == 1 and "teacher timm:resnet10t cannot run in bfloat16" in lines[0]
    assert "--teacher-precision float32" in lines[0]
    assert not (tmp_path / "x" / "config.yaml").exists()


def test_explicit_float32_teacher_under_o1(data, trained, tmp_path):
    kd.train(cfg_for(data, tmp_path / "f32", teacher_weights=str(trained), opt="O1", teacher_precision="float32"))
    saved = (tmp_path / "f32" / "config.yaml").read_text()
    assert yaml.safe_load(saved)["teacher_precision"] == "float32" and "# teacher" not in saved


def test_teacher_broken_even_in_float32_stops_before_training(data, trained, tmp_path):
    """Such a teacher stops the run before its first step, not after epochs of NaN: at O0 on the CPU
    (nothing to choose) its weights are checked, and its logits on the probe batches, which finite weights can
    overflow; under O1 its float32 fallback's probe says so."""
    weights = with_bias(trained, float("inf"), tmp_path)
    with pytest.raises(KDError, match="teacher timm:resnet10t has non-finite weights .*its weights are broken"):
        kd.train(cfg_for(data, tmp_path / "broken", teacher_weights=str(weights), opt="O0"))
    with pytest.raises(KDError, match="non-finite logits even in float32"):
        kd.train(cfg_for(data, tmp_path / "broken1", teacher_weights=str(weights), opt="O1"))
    assert not (tmp_path / "broken" / "metrics.jsonl").exists()
    state = torch.load(trained, weights_only=True)
    state["student"]["fc.weight"] = torch.full_like(state["student"]["fc.weight"], 3e38)  # finite; its logits inf
    torch.save(state, tmp_path / "overflowing.pt")
    pair = dict(teacher=NET, teacher_weights=tmp_path / "overflowing.pt", student=NET)
    r = kd_main(*train_args(data, tmp_path / "broken2", **pair, opt="O0"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("kd: ")]
    assert len(lines) == 1 and f"teacher {NET} gives non-finite logits in float32" in lines[0], r.stderr
    assert "epoch 1" not in r.stderr and not (tmp_path / "broken2" / "metrics.jsonl").exists()


@pytest.mark.parametrize("how", [dict(opt="O0"), dict(opt="O1", teacher_precision="float32")])
def test_nothing_to_choose_where_float32_is_the_only_choice(data, trained, tmp_path, how):
    """On the CPU at O0 (or with --teacher-precision float32) there is nothing to choose: the
    teacher's probe batches run in float32 alone, to check its logits, the log says so, and the
    run trains."""
    r = kd_main(*train_args(data, tmp_path / "run", teacher=NET, teacher_weights=trained, student=NET, **how))
    assert r.returncode == 0, r.stderr
    why = "as given" if "teacher_precision" in how else "auto: the only precision at O0 on the CPU"
    assert f"teacher {NET}: runs in float32 ({why}; nothing to choose: top-1 100.00 on " in r.stderr, r.stderr
    assert re.search(r"probes float32 [\d.]+ s\n", r.stderr), r.stderr  # float32's alone
    assert records(tmp_path / "run")[-1]["teacher_top1"] == pytest.approx(100.0)


# ----------------------------------------------------------------------------- non-finite losses
class KdTermNanFrom(DistillLoss):
    """Cross-entropy plus a 'kd' term that turns NaN from a given step on (not registered)."""

    card = MethodCard(needs_teacher=False)

    def __init__(self, num_classes: int, bad_from: int):
        super().__init__(num_classes)
        self.bad_from = bad_from
        self.calls = 0

    def forward(self, x: DistillInputs):
        self.calls += 1
        ce = nn.functional.cross_entropy(x.student_logits.float(), x.labels)
        kd_term = x.student_logits.float().pow(2).mean() * (float("nan") if self.calls >= self.bad_from else 0.0)
        return {"loss": ce + kd_term, "ce": ce, "kd": kd_term}


@pytest.mark.parametrize("opt", ["O0", "O3"])
def test_nonfinite_loss_never_reaches_the_weights_and_names_its_source(data, tmp_path, opt, monkeypatch):
    """Levels without a loss scaler skip a non-finite step too; the stop names the loss term."""
    import kd.run.build

    monkeypatch.setattr(kd.run.build, "build_loss", lambda name, n, args: KdTermNanFrom(n, bad_from=4))
    cfg = cfg_for(data, tmp_path / "nan", no_teacher=True, teacher=None, opt=opt, epochs=3, max_nonfinite_steps=3)
    backend = backends.get("single")(cfg)
    backend.setup()
    t = Trainer(Students.alone(cfg), backend)
    with pytest.raises(KDError, match=r"not finite for 3 consecutive steps .*the loss term 'kd' was not finite") as err:
        t.fit()
    t.close()
    assert "skipped" in str(err.value)
    state = torch.load(tmp_path / "nan" / "checkpoints" / "last.pt", weights_only=True)
    assert state["global_step"] == 3 and t.lane.state.global_step == 6  # epoch 1, before the first bad step
    held = t.lane.precision.model_state(t.lane.side)  # the three skipped steps changed nothing since
    for key, value in state["student"].items():
        assert torch.equal(value, held[f"student.{key}"]), key


def test_a_run_ending_on_nonfinite_steps_does_not_succeed(data, tmp_path, monkeypatch):
    import kd.run.build

    monkeypatch.setattr(kd.run.build, "build_loss", lambda name, n, args: KdTermNanFrom(n, bad_from=5))
    cfg = cfg_for(data, tmp_path / "end", no_teacher=True, teacher=None, epochs=2, max_nonfinite_steps=100)
    with pytest.raises(KDError, match=r"in its last 2 step\(s\) \(epoch 2, step 6\)"):
        kd.train(cfg)
    rec = records(tmp_path / "end")
    assert rec[-1]["train_skipped_steps"] == 2 and math.isfinite(rec[-1]["train_loss"])  # means over finite steps


@pytest.mark.parametrize("opt", ["O2", "O3"])
def test_a_float32_teacher_is_fed_what_it_was_probed_with(data, trained, tmp_path, opt):
    """At O2/O3 the student's input is cast to bfloat16; a float32 teacher still gets the float32 crop
    (not the student's rounded one: its probe saw float32)."""
    cfg = cfg_for(data, tmp_path / opt, teacher_weights=str(trained), opt=opt, teacher_precision="float32")
    backend = backends.get("single")(cfg)
    backend.setup()
    t = Trainer(Students.alone(cfg), backend)
    seen = []
    first = next(m for m in t.teacher.module.modules() if isinstance(m, nn.Conv2d))
    first.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    t.data.train.set_epoch(0)
    batch = next(iter(t.data.train))
    t.lane.side.train()
    t.step(batch)
    t.close()
    assert t.teacher.dtype_name == "float32" and len(seen) == 1
    assert seen[0].dtype == torch.float32 and torch.equal(seen[0], batch.images)
