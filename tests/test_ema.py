"""The moving average of a student's weights (kd.run.ema, --model-ema): timm's ModelEmaV3 after real
steps, still on a skipped step, float32 from the master weights, evaluated, logged, checkpointed,
resumed exactly, reported and exported."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from conftest import (
    TEST_RESNET,
    TEST_RESNET_PAIR,
    THREADS,
    cli_options,
    in_process_trainer,
    kd_main,
    make_image_folder,
    tiny_config,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from kd.run.ema import ModelEma
from kd.run.step import StepHook
from kd.utils import checkpoint_io

# 24 training images at batch 4: 6 steps an epoch; a step checkpoint at step 4 (epoch 1) and 8 (epoch 2)
RUN = cli_options(**TEST_RESNET_PAIR, image_size=32, batch_size=4, epochs=2)
RUN += cli_options(device="cpu", workers=0, lr=0.05, save_every_steps=4, keep_last=2, no_progress=True)
RUN += ["--model-ema", "--model-ema-decay", "0.9"]
ALONE = dict(no_teacher=True, student=TEST_RESNET)  # the in-process trainers' student, without a teacher


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("ema_data"), classes=3, train_per_class=8, val_per_class=2)


@pytest.fixture(scope="module")
def ema_run(data, tmp_path_factory):
    """One finished two-epoch run with --model-ema, in this process: (its result, its folder)."""
    out = tmp_path_factory.mktemp("ema") / "run"
    r = kd_main("train", "--data", data, *RUN, "--out", out, threads=THREADS)
    assert r.returncode == 0, r.stderr
    return r, out


def load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


class EmaSnapshots(StepHook):
    """After each step: whether it was skipped, and the average's state."""

    def __init__(self):
        self.skipped: List[bool] = []
        self.states: List[Dict[str, torch.Tensor]] = []

    def on_step(self, trainer, out):
        self.skipped.append(bool(out.skipped))
        self.states.append({k: v.clone() for k, v in trainer.lane.ema.state_dict().items()})


class TimmEma(StepHook):
    """timm's ModelEmaV3 of the same student, updated after each step kd took (a skipped one left out),
    with timm's train.py step count."""

    def __init__(self, student: nn.Module, decay: float, warmup: bool):
        from timm.utils import ModelEmaV3

        self.ema = ModelEmaV3(copy.deepcopy(student), decay=decay, use_warmup=warmup)

    def on_step(self, trainer, out):
        if not bool(out.skipped):
            self.ema.update(trainer.lane.side.student, step=trainer.lane.state.global_step)


def inf_pixel_on_training_call(model: nn.Module, call: int) -> None:
    """One inf pixel in the ``call``-th training forward's input of ``model``: that step is skipped."""
    calls: List[int] = []

    def hook(module, args):
        if module.training:
            calls.append(1)
            if len(calls) == call:
                images = args[0].clone()
                images[0, 0, 0, 0] = float("inf")
                return (images, *args[1:])
        return None

    model.register_forward_pre_hook(hook)


def test_the_decay_of_each_step_is_model_ema_v3s():
    from timm.utils import ModelEmaV3

    from kd.precision import Precision

    for decay, warmup in ((0.9998, False), (0.9998, True), (0.99, True)):
        ours = ModelEma(nn.Linear(2, 2), Precision(torch.device("cpu")), decay, warmup)
        theirs = ModelEmaV3(nn.Linear(2, 2), decay=decay, use_warmup=warmup)
        assert [ours.decay_at(n) for n in range(1, 3000)] == [theirs.get_decay(n) for n in range(1, 3000)]


def test_the_average_is_timms_model_ema_v3_after_real_steps_and_still_on_a_skipped_one(data, tmp_path):
    # warm-up below the decay, then the decay: the steps' decays are 0, 0.37, (skipped), 0.5 (0.60 capped)
    decay, warmup = 0.5, True
    ema = dict(model_ema=True, model_ema_decay=decay, model_ema_warmup=warmup)
    cfg = tiny_config(data, tmp_path / "run", **ALONE, batch_size=4, lr=0.05, limit_train_batches=4, **ema)
    trainer = in_process_trainer(cfg)
    timm_ema, snaps = TimmEma(trainer.lane.side.student, decay, warmup), EmaSnapshots()
    trainer.hooks += [snaps, timm_ema]
    inf_pixel_on_training_call(trainer.lane.side.student, 3)
    trainer.fit()
    trainer.close()
    assert snaps.skipped == [False, False, True, False]
    for key, value in snaps.states[1].items():  # the skipped step left the average as it was, bit for bit
        assert torch.equal(value, snaps.states[2][key]), key
    ours, theirs = trainer.lane.ema.state_dict(), timm_ema.ema.module.state_dict()
    student = trainer.lane.side.student.state_dict()
    assert list(ours) == list(theirs)
    moved = 0
    for key, value in ours.items():
        assert value.dtype == theirs[key].dtype, key
        if value.is_floating_point():  # to float32 rounding (1.2e-7 here): ema * (1 - w) + w * x against lerp
            torch.testing.assert_close(value, theirs[key], rtol=1e-6, atol=1e-7, msg=key)
            moved += not torch.allclose(value, student[key], rtol=1e-3, atol=1e-4)
        else:  # BatchNorm's counter, copied
            assert torch.equal(value, theirs[key]), key
    assert moved > len(ours) // 4  # an average of several steps, not the student's last weights


def test_the_average_follows_the_float32_master_weights_at_o2(data, tmp_path):
    ema = dict(model_ema=True, model_ema_decay=0.9)
    cfg = tiny_config(data, tmp_path / "o2", **ALONE, opt="O2", limit_train_batches=1, limit_val_batches=1, **ema)
    trainer = in_process_trainer(cfg)
    lane = trainer.lane
    first: Dict[str, Dict[str, torch.Tensor]] = {}

    class AfterFirstStep(StepHook):
        def on_step(self, trainer, out):
            if not first:
                first["ema"] = {k: v.clone() for k, v in lane.ema.state_dict().items()}
                first["masters"] = {k: v.clone() for k, v in lane.precision.masters(lane.side.student).items()}

    trainer.hooks.append(AfterFirstStep())
    record = trainer.fit()  # the average validated at O2: autocast over its float32 weights
    trainer.close()
    assert first["masters"] and "val_top1_ema" in record
    for key, master in first["masters"].items():  # the first step copies the student: its float32 masters
        assert first["ema"][key].dtype == torch.float32
        assert torch.equal(first["ema"][key], master), key
    weights = dict(lane.side.student.named_parameters())
    assert any(weights[k].dtype == torch.bfloat16 for k in first["masters"])


def test_the_average_is_validated_logged_checkpointed_and_reported(ema_run):
    r, out = ema_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [rec["epoch"] for rec in records] == [1, 2]
    for rec in records:
        assert {"val_top1_ema", "val_top5_ema", "val_loss_ema", "val_s_ema"} <= set(rec)
    assert r.stderr.count(" | ema top-1 ") == 2
    assert "moving average: best top-1" in r.stdout
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    assert "epoch/val_top1_ema" in events.Tags()["scalars"]
    for name in ("last.pt", "best.pt"):
        state = load(out / "checkpoints" / name)
        ema, student = state["state_dict_ema"], state["student"]
        assert list(ema) == list(student)
        assert all(v.dtype == torch.float32 for v in ema.values() if v.is_floating_point())
        assert any(not torch.equal(ema[k], student[k]) for k in ema if ema[k].is_floating_point())
    import timm.models

    model = timm.create_model("test_resnet", num_classes=3)
    timm.models.load_checkpoint(model, str(out / "checkpoints" / "last.pt"), use_ema=True)  # timm finds it
    kept = load(out / "checkpoints" / "last.pt")["state_dict_ema"]
    assert all(torch.equal(v, kept[k]) for k, v in model.state_dict().items())
    report = kd_main("report", out)
    assert report.returncode == 0, report.stderr
    header, _, row = report.stdout.splitlines()[:3]
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in row.split("|")]))
    assert float(cells["last_top1_ema"]) == pytest.approx(records[-1]["val_top1_ema"], abs=0.01)


def test_a_run_resumed_mid_epoch_ends_with_the_same_average(ema_run, tmp_path):
    _, out = ema_run
    copy_ = tmp_path / "copy"
    shutil.copytree(out, copy_)
    step = copy_ / "checkpoints" / "step_00000004.pt"
    assert load(step)["batch_in_epoch"] == 4  # stopped in epoch 1
    r = kd_main("train", "--out", copy_, "--resume", step, threads=THREADS)
    assert r.returncode == 0, r.stderr
    ours, theirs = load(copy_ / "checkpoints" / "last.pt"), load(out / "checkpoints" / "last.pt")
    assert ours["global_step"] == theirs["global_step"] == 12
    for key, value in theirs["state_dict_ema"].items():
        assert torch.equal(ours["state_dict_ema"][key], value), key
    first = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(line) for line in (copy_ / "metrics.jsonl").read_text().splitlines()]
    assert [rec["val_top1_ema"] for rec in again] == [rec["val_top1_ema"] for rec in first]
    assert [rec["val_loss_ema"] for rec in again] == [rec["val_loss_ema"] for rec in first]


def test_export_writes_the_average(ema_run, tmp_path):
    _, out = ema_run
    r = kd_main("export", out, "-o", tmp_path / "ema.pt", "--ema")
    assert r.returncode == 0, r.stderr
    exported = load(tmp_path / "ema.pt")
    kept = load(out / "checkpoints" / "best.pt")["state_dict_ema"]
    assert list(exported) == list(kept) and all(torch.equal(exported[k], kept[k]) for k in kept)
    assert json.loads((tmp_path / "ema.json").read_text())["ema"] is True
    stripped = tmp_path / "no_ema.pt"
    state = load(out / "checkpoints" / "last.pt")
    del state["state_dict_ema"]
    checkpoint_io.save_atomic(state, stripped)
    r = kd_main("export", stripped, "-o", tmp_path / "w.pt", "--ema")
    assert r.returncode == 2 and "holds no moving average" in r.stderr
    assert not (tmp_path / "w.pt").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_update_takes_no_host_sync_on_a_gpu():
    import timm

    from kd.precision import Precision

    device = torch.device("cuda")
    student = timm.create_model("test_resnet", num_classes=4).to(device)
    ema = ModelEma(student, Precision(device), decay=0.9998, warmup=True)
    skipped = torch.zeros((), dtype=torch.bool, device=device)
    ema.update(1, skipped)  # the first block of weights, and the pairs
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(2, 6):
            ema.update(step, skipped)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
