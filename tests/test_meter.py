"""The run's meters (kd.run.meter): loss means over the steps with a finite loss, weighted by their images;
the streak of bad steps and which sources were not finite in it; their state across a resume; the epoch
line, the error of a run whose loss stayed non-finite, and the line that says a run is not learning."""

from __future__ import annotations

import io
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kd.run.meter import LearningWatch, Meter, format_record, nonfinite_flags, nonfinite_message, val_count
from kd.run.step import LOGITS_SUM

CPU = torch.device("cpu")
NAN = float("nan")


class OneProcess:
    """The reduction of a run of one process: the sums are already every process's."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        pass


def step(meter: Meter, loss: float, kd: float, n: int, skipped: bool = False, flags=None) -> None:
    parts = {"loss": torch.tensor(loss), "kd": torch.tensor(kd)}
    meter.add(parts, n, torch.tensor(skipped), None if flags is None else torch.tensor(flags))


def test_means_are_over_the_steps_with_a_finite_loss_weighted_by_their_images():
    meter = Meter(CPU)
    step(meter, 2.0, 1.0, 4)
    step(meter, 4.0, 3.0, 2)
    step(meter, NAN, 5.0, 4, skipped=True)  # its kd term is finite, but the step's loss was not
    got = meter.reduce(OneProcess(), extra=[7.0])
    assert got["loss"] == pytest.approx((2.0 * 4 + 4.0 * 2) / 6)
    assert got["kd"] == pytest.approx((1.0 * 4 + 3.0 * 2) / 6)
    assert got["images"] == 10 and got["skipped_steps"] == 1 and got["_extra"] == [7.0]
    empty = Meter(CPU)
    step(empty, math.inf, 1.0, 4)
    assert math.isnan(empty.reduce(OneProcess())["loss"]) and "_extra" not in empty.reduce(OneProcess())


def test_the_streak_counts_bad_steps_in_a_row_and_their_sources():
    """A step is bad where its loss is not finite or it was skipped (on its gradients); a good one ends
    the streak and forgets its sources; the worst streak stays."""
    meter = Meter(CPU)
    step(meter, 1.0, 1.0, 2, flags=[0.0, 0.0, 0.0])
    step(meter, NAN, 1.0, 2, flags=[1.0, 0.0, 0.0])
    step(meter, 1.0, 1.0, 2, skipped=True, flags=[0.0, 0.0, 1.0])
    assert meter.streak.item() == 2 and meter.worst.item() == 2
    assert meter.sources.tolist() == [1.0, 0.0, 1.0]  # every source seen in the streak
    step(meter, 1.0, 1.0, 2, flags=[0.0, 0.0, 0.0])
    assert meter.streak.item() == 0 and meter.worst.item() == 2 and meter.sources.tolist() == [0.0, 0.0, 0.0]
    step(meter, NAN, 1.0, 2, flags=[0.0, 1.0, 0.0])
    assert meter.streak.item() == 1 and meter.worst.item() == 2 and meter.sources.tolist() == [0.0, 1.0, 0.0]


def through_a_file(state: dict) -> dict:
    """``state`` saved and loaded as a checkpoint holds it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_meter_restored_from_its_state_goes_on_as_the_one_it_was_saved_from():
    kept = Meter(CPU)
    step(kept, 2.0, 1.0, 4)
    step(kept, NAN, 1.0, 4, flags=[1.0, 0.0])
    kept.wait = 1.5
    restored = Meter(CPU)
    restored.load_state_dict(through_a_file(kept.state_dict()))
    for meter in (kept, restored):
        step(meter, 3.0, 2.0, 2, flags=[0.0, 0.0])
    assert restored.reduce(OneProcess()) == kept.reduce(OneProcess())
    assert restored.worst.item() == kept.worst.item() == 1 and restored.wait == 1.5
    older = through_a_file(kept.state_dict())  # a checkpoint of a kd that kept no finite count and no sources
    del older["finite"], older["sources"]
    restored.load_state_dict(older)
    assert restored.finite.item() == kept.count.item() == 10


def test_global_state_adds_the_counters_up_and_keeps_the_streak():
    meter = Meter(CPU)
    step(meter, 2.0, 1.0, 4)
    step(meter, NAN, 1.0, 2)

    class TwoLikeProcesses:
        """Two processes that counted the same: every sum doubled."""

        def all_reduce_sum(self, tensor):
            tensor.mul_(2)

    state = meter.global_state(TwoLikeProcesses())
    assert state["count"].item() == 12 and state["finite"].item() == 8
    assert state["sums"]["loss"].item() == 16.0 and state["streak"].item() == 1
    assert meter.count.item() == 6  # the meter itself is left as it was


def test_nonfinite_flags_name_each_source_in_order():
    parts = {"loss": torch.tensor(NAN), "kd": torch.tensor(1.0), "ce": torch.tensor(math.inf)}
    parts[LOGITS_SUM] = torch.tensor(2.0)
    teacher = torch.tensor([[1.0, math.inf]])
    flags = nonfinite_flags(parts, teacher, ["kd", "ce"], buffers_finite=torch.tensor(False))
    assert flags.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]  # teacher, student, kd, ce, the student's buffers
    assert LOGITS_SUM not in parts
    parts[LOGITS_SUM] = torch.tensor(math.inf)
    assert nonfinite_flags(parts, None, []).tolist() == [0.0, 1.0, 0.0]  # no teacher, no buffers checked


def test_the_nonfinite_error_names_the_sources_and_what_to_try(tmp_path):
    last = tmp_path / "last.pt"
    teacher = ("resnet18", "float16")
    # hits: the teacher's logits, the student's, the loss term 'kd', the BatchNorm statistics, the gradients
    line = nonfinite_message("for 3 consecutive steps", [1, 0, 1, 0, 0], ["kd"], 2, 40, teacher, last)
    assert line == (
        "the loss was not finite for 3 consecutive steps (epoch 2, step 40): the teacher's logits and the loss "
        "term 'kd' were not finite; those steps were skipped and the run stopped, no checkpoint was written; "
        "the teacher resnet18 runs in float16: try --teacher-precision float32, and check --teacher-weights"
    )
    last.write_bytes(b"")
    line = nonfinite_message("in its last 2 step(s)", [0, 0, 0, 0, 1], ["kd"], 1, 5, teacher, last)
    assert line.startswith("the gradients were not finite in its last 2 step(s) (epoch 1, step 5): the gradients")
    assert f"the last good checkpoint is {last}" in line and "(--loss-arg), lower --lr, or try --amp-dtype" in line
    student = nonfinite_message("x", [0, 1, 0, 0, 0], ["kd"], 1, 5, None, Path(tmp_path / "none"))
    assert "the student's logits was not finite" in student and student.endswith("--amp-dtype bfloat16")
    assert "lower --lr, add --warmup-epochs or --grad-clip" in student
    unknown = nonfinite_message("x", [0, 0, 0, 0, 0], ["kd"], 1, 5, teacher, last)
    assert "source unknown" in unknown and unknown.endswith(
        "check the method's hyper-parameters (--loss-arg) and lower --lr"
    )


def test_the_epoch_line():
    record = dict(epoch=3, train_loss=1.23456, val_top1=40.0, val_top5=90.5, img_per_s=812.4, seconds=12.34)
    assert format_record(record, 10) == "epoch 3/10 | loss 1.2346 | val top-1 40.00 top-5 90.50 | 812 img/s | 12.3s"
    record.update(val_images=20, val_unreadable=2, val_top1_ema=41.0, val_top5_ema=91.0)
    assert format_record(record, 10) == (
        "epoch 3/10 | loss 1.2346 | val top-1 40.00 top-5 90.50 (20 images, 2 unreadable) "
        "| ema top-1 41.00 top-5 91.00 | 812 img/s | 12.3s"
    )
    assert format_record(dict(epoch=1, img_per_s=1.0, seconds=1.0), 1) == "epoch 1/1 | loss nan | 1 img/s | 1.0s"
    assert val_count({}) == "" and val_count({"val_images": 5}) == " (5 images, 0 unreadable)"


def test_a_loss_far_above_chance_is_said_with_a_smaller_lr_to_try():
    """A cross-entropy of 16.6 on 10 classes in the first epoch (MLKD at KD's lr): the steps are too large."""
    run = SimpleNamespace(lr=0.1, warmup_epochs=0.0, grad_clip=None)
    watch = LearningWatch(10, run)
    line = watch.see({"epoch": 1, "train_ce": 16.6, "val_top1": 27.0})
    assert line.startswith("not learning: training cross-entropy 16.60 after 1 epoch(s), far above where it started")
    assert line.endswith("try --lr 0.01 (a tenth), or --warmup-epochs 1 --grad-clip 5"), line
    assert watch.see({"epoch": 2, "train_ce": 20.0}) is None  # said once
    warmed = LearningWatch(10, SimpleNamespace(lr=0.1, warmup_epochs=1.0, grad_clip=None))  # what it does: not advised
    assert warmed.see({"epoch": 1, "train_ce": 16.6}).endswith("try --lr 0.01 (a tenth), or --grad-clip 5")
    learning = LearningWatch(10, run)  # still near log 10 after two epochs, but above chance on val: learning
    assert learning.see({"epoch": 2, "train_ce": 2.5, "val_top1": 20.5}) is None


def test_a_loss_still_at_chance_after_two_epochs_is_said_once():
    run = SimpleNamespace(lr=0.1, lr_schedule="cosine", warmup_epochs=0.0, min_crop_scale=0.08)
    watch = LearningWatch(4, run)
    assert watch.see({"epoch": 1, "train_ce": 1.39, "val_top1": 25.0}) is None  # one epoch is too early to say
    assert watch.see({"epoch": 2, "train_loss": math.nan}) is None  # nothing finite to judge
    line = watch.see({"epoch": 2, "train_ce": 1.38, "val_top1": 25.0})
    assert line == (
        "not learning: training cross-entropy 1.38 after 2 epoch(s) is still at chance (chance is log 4 = 1.39), "
        "val top-1 25.00; on a small folder try --lr 0.05 --warmup-epochs 1 --min-crop-scale 0.25"
    )
    assert watch.see({"epoch": 3, "train_ce": 1.38, "val_top1": 25.0}) is None
    assert LearningWatch(1, run).see({"epoch": 5, "train_ce": 9.0}) is None  # one class: no chance to be at
