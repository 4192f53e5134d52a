"""A lane's rules around its steps (kd/run/lane.py, with kd/run/step.py's gradients and buffer guard):
a skipped step changes nothing (weights, optimizer, BatchNorm statistics, the loss scale where the
scale did not cause it), every skipped step counts towards --max-nonfinite-steps and the limit does
not depend on the number of processes; an unreadable file counts once; a lane's set-up that fails
closes what it opened, and a stop before its first epoch still saves."""

from __future__ import annotations

import json
import math
import re
import signal
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from conftest import in_process_trainer, kd_main, make_image_folder, run_kd, tiny_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import kd.run.build
from kd.errors import NonFinite
from kd.losses import DistillInputs, DistillLoss, MethodCard
from kd.precision import MasterWeightPrecision
from kd.run.step import BufferGuard, StepHook

#: the student of the runs that need no BatchNorm: what they count is the same for any model, and
#: squeezenet1_1's checkpoint, written each epoch, is a tenth of resnet18's
SMALL_STUDENT = "squeezenet1_1"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("policy_data"), classes=3, train_per_class=8, val_per_class=2)


def tiny_cfg(data, out, **kw):
    return tiny_config(data, out, **{"no_teacher": True, "lr": 0.05, "lr_schedule": "constant", "log_every": 1, **kw})


trainer = in_process_trainer


def inf_pixel_on_call(model: nn.Module, call: int) -> None:
    """One inf pixel in the ``call``-th training forward's input of ``model`` (evaluation untouched)."""
    calls: List[int] = []

    def hook(module, args):
        if not module.training:
            return None
        calls.append(1)
        if len(calls) != call:
            return None
        images = args[0].clone()
        images[0, 0, 0, 0] = float("inf")
        return (images, *args[1:])

    model.register_forward_pre_hook(hook)


class Snapshots(StepHook):
    """The student side's whole state (weights and buffers) and the step's verdict, after each step."""

    def __init__(self):
        self.states: List[Dict[str, torch.Tensor]] = []
        self.skipped: List[bool] = []
        self.scales: List[float] = []

    def on_step(self, trainer, out):
        self.states.append({k: v.detach().clone() for k, v in trainer.lane.side.state_dict().items()})
        self.skipped.append(bool(out.skipped))
        self.scales.append(float(trainer.lane.precision.loss_scale()))


def test_a_skipped_step_leaves_batchnorm_statistics_as_they_were(data, tmp_path):
    cfg = tiny_cfg(data, tmp_path / "bn")
    t = trainer(cfg)
    snaps = Snapshots()
    t.hooks.append(snaps)
    inf_pixel_on_call(t.lane.side.student, 2)
    record = t.fit()
    t.close()
    assert snaps.skipped == [False, True, False]
    before, after = snaps.states[0], snaps.states[1]
    assert any("running_var" in k for k in before)
    for key in before:  # the skipped step: weights and every buffer as after step 1, bit for bit
        assert torch.equal(before[key], after[key]), key
    state = torch.load(Path(cfg.out) / "checkpoints" / "last.pt", weights_only=True)
    buffers = {k: v for k, v in state["student"].items() if "running" in k}
    assert buffers and all(torch.isfinite(v).all() for v in buffers.values())
    for key, value in buffers.items():
        assert torch.equal(value, snaps.states[-1][f"student.{key}"]), key
    assert math.isfinite(record["val_loss"])  # evaluated on the kept statistics
    assert record["train_skipped_steps"] == 1.0


def test_buffer_guard_restores_only_where_skipped():
    bn = nn.BatchNorm1d(3)
    guard = BufferGuard(bn)
    guard.refresh()
    guard.save()
    bn(torch.randn(4, 3))
    moved = {k: v.clone() for k, v in bn.state_dict().items()}
    assert guard.check() is not None and bool(guard.check())
    guard.restore(torch.tensor(False))
    assert all(torch.equal(moved[k], v) for k, v in bn.state_dict().items())
    guard.save()
    bn(torch.full((4, 3), float("inf")))
    assert not bool(guard.check())
    guard.restore(torch.tensor(True))
    assert all(torch.equal(moved[k], v) for k, v in bn.state_dict().items())


def test_a_nonfinite_loss_does_not_lower_the_loss_scale(data, tmp_path):
    """float16 O2 on the CPU (not offered by the CLI): the scale halves for overflowing gradients,
    not for a step whose loss itself is not finite (its scale has nothing to do with it)."""
    cfg = tiny_cfg(data, tmp_path / "scale", opt="O2", student="mobilenet_v3_small")
    t = trainer(cfg, MasterWeightPrecision(torch.device("cpu"), torch.float16))
    snaps = Snapshots()
    t.hooks.append(snaps)
    inf_pixel_on_call(t.lane.side.student, 2)
    t.fit()
    t.close()
    assert snaps.skipped == [False, True, False]
    assert snaps.scales == [2.0**16] * 3
    assert all(torch.equal(snaps.states[0][k], v) for k, v in snaps.states[1].items())


class NanGradients(DistillLoss):
    """Cross-entropy plus a term that is 0 forward and NaN backward (a square root at zero): the
    loss stays finite while every gradient is NaN. Not registered (see test_precision)."""

    card = MethodCard(needs_teacher=False)
    name = "nan_gradients"

    def forward(self, x: DistillInputs):
        ce = nn.functional.cross_entropy(x.student_logits.float(), x.labels)
        return {"loss": ce + torch.sqrt(0.0 * x.student_logits.float().sum())}


def test_finite_loss_with_nonfinite_gradients_stops_the_run(data, tmp_path, monkeypatch):
    monkeypatch.setattr(kd.run.build, "build_loss", lambda name, num_classes, args: NanGradients(num_classes))
    cfg = tiny_cfg(data, tmp_path / "grads", epochs=3, max_nonfinite_steps=4)
    t = trainer(cfg)
    with pytest.raises(
        NonFinite, match=r"the gradients were not finite for 4 consecutive steps .*\(with a finite loss\)"
    ):
        t.fit()
    t.close()
    assert t.lane.state.global_step == 4  # stopped at the limit (step 4 of 9)


def first_skip_and_stop(out: Path, stderr: str):
    """(the step of the first skipped step, the step the run stopped at) from TensorBoard and the error."""
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    skipped = [e.step for e in events.Scalars("train/skipped_steps") if e.value > 0]
    stop = re.search(r"not finite for (\d+) consecutive steps \(epoch \d+, step (\d+)\)", stderr)
    assert skipped and stop, stderr
    return skipped[0], int(stop.group(2))


@pytest.mark.slow
def test_the_streak_limit_does_not_shrink_with_the_number_of_processes(data, tmp_path):
    """Every step after the first diverges (lr 1e12); the run stops after --max-nonfinite-steps skipped
    steps, with one process and with two (the processes' streaks are not summed)."""
    args = ["train", "--data", data, "--no-teacher", "--student", SMALL_STUDENT, "--image-size", 32, "-b", 8]
    args += ["-j", 0, "--device", "cpu", "--lr", "1e12", "--log-every", 1, "--epochs", 4]
    args += ["--max-nonfinite-steps", 4]
    stops = []
    for nproc in (1, 2):
        out = tmp_path / f"n{nproc}"
        if nproc == 1:  # the one-process reference, in this process
            r = kd_main(*args, "--out", out, threads=1)
        else:
            r = run_kd(*args, "--backend", "torch_ddp", "--nproc", 2, "--out", out, env={"OMP_NUM_THREADS": "1"})
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        first, stop = first_skip_and_stop(out, r.stderr)
        stops.append(stop - first + 1)
    assert stops == [4, 4]


def test_no_checkpoint_holds_a_nonfinite_buffer(data, tmp_path):
    """The last guard, whatever put it there: a state with a NaN statistic is not written."""
    t = trainer(tiny_cfg(data, tmp_path / "guard"))
    t.lane.save(best=False)
    last = Path(t.lane.out) / "checkpoints" / "last.pt"
    written = last.read_bytes()
    t.lane.side.student.bn1.running_var[0] = float("nan")
    t.lane.state.global_step = 7
    t.lane.save(best=True)
    t.close()
    assert last.read_bytes() == written and not (Path(t.lane.out) / "checkpoints" / "best.pt").exists()


@pytest.mark.slow
def test_one_unreadable_file_counts_once_over_epochs_and_processes(tmp_path):
    """A broken file is met every epoch, by either process or by both in one epoch: it is one
    unreadable image, so a run with --max-bad-images 2 lives through its 3 epochs (counted per epoch and
    process, the 4 meetings would pass the limit)."""
    from kd.data.sampler import SeededSampler

    data = make_image_folder(tmp_path / "data", classes=2, train_per_class=4, val_per_class=1, size=(16, 16))
    broken = data / "train" / "class_00" / "broken.jpg"
    broken.write_bytes(b"not a jpeg at all")
    files = sorted(p for p in (data / "train").rglob("*") if p.is_file())  # ImageFolder's order
    seed, epochs = 12, 3

    def ranks_meeting_it(epoch: int):
        met = []
        for rank in (0, 1):
            sampler = SeededSampler(len(files), 2, rank, True, seed, pad=True)
            sampler.set_epoch(epoch)
            met += [rank] if files.index(broken) in [index for index, _ in sampler] else []
        return tuple(met)

    # the seed makes every case happen: rank 1 alone, both ranks in one epoch (the padding), rank 0 alone
    assert {ranks_meeting_it(e) for e in range(epochs)} == {(0,), (1,), (0, 1)}
    out = tmp_path / "run"
    r = run_kd(
        *["train", "--data", data, "--no-teacher", "--student", SMALL_STUDENT, "--image-size", 32, "-b", 8, "-j", 0],
        *["--device", "cpu", "--epochs", epochs, "--eval-every", epochs, "--max-bad-images", 2, "--log-every", 1],
        *["--backend", "torch_ddp", "--nproc", 2, "--seed", seed, "--out", out],
        env={"OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [rec["train_bad_images"] for rec in records] == [1] * epochs
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=True)["bad_files"] == [str(broken)]


def test_an_epoch_line_without_its_checkpoint_is_not_kept_twice(data, tmp_path):
    """A stop between an epoch's metrics line and its checkpoint: the resumed run trains that epoch
    again and metrics.jsonl holds each epoch once."""
    out = tmp_path / "run"
    args = ["--data", data, "--no-teacher", "--student", SMALL_STUDENT, "--image-size", 32, "-b", 8, "-j", 0]
    r = kd_main("train", *args, "--device", "cpu", "--epochs", 1, "--out", out)
    assert r.returncode == 0, r.stderr
    metrics = out / "metrics.jsonl"
    line = json.loads(metrics.read_text())
    metrics.write_text(metrics.read_text() + json.dumps({**line, "epoch": 2}) + "\n")  # epoch 2's line, no checkpoint
    r = kd_main("train", "--out", out, "--resume", "--epochs", 2)
    assert r.returncode == 0, r.stderr
    assert [json.loads(x)["epoch"] for x in metrics.read_text().splitlines()] == [1, 2]


def test_a_failed_folder_start_closes_what_the_set_up_opened(data, tmp_path, monkeypatch):
    """Writing the run folder is the set-up's last part: where it fails (a full disk, a read-only
    --out) the data's workers and the teacher's val loader are closed, as for any failed start."""
    import kd.run.loop
    from kd.data.pipeline import Data

    closed = []
    real_close = Data.close
    monkeypatch.setattr(Data, "close", lambda self: (closed.append(self), real_close(self)))

    def full_disk(lane, resumed):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kd.run.loop, "start_folder", full_disk)
    with pytest.raises(OSError, match="No space left"):
        trainer(tiny_cfg(data, tmp_path / "full"))
    assert len(closed) == 1


def test_a_stop_before_the_first_epoch_begins_still_saves(data, tmp_path):
    """A resumed run whose pending validation is stopped again interrupts before any epoch began."""
    t = trainer(tiny_cfg(data, tmp_path / "early"))
    try:
        stopped = t.lane.interrupt()
        assert "stopped by" in str(stopped) and (Path(t.lane.out) / "checkpoints" / "last.pt").is_file()
    finally:
        t.close()


def test_a_checkpoint_that_cannot_be_resumed_fails_before_the_data_is_read(data, tmp_path, monkeypatch):
    import backends
    import kd.run.loop
    from kd.errors import KDError
    from kd.run.loop import Trainer
    from kd.run.students import Students

    built = []
    monkeypatch.setattr(kd.run.loop, "build_data", lambda *args: built.append(args))
    broken = tmp_path / "last.pt"
    broken.write_bytes(b"PK\x03\x04 not a whole archive")
    cfg = tiny_cfg(data, tmp_path / "resume")
    backend = backends.get("single")(cfg)
    backend.setup()
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(KDError, match="cannot load checkpoint"):
        Trainer(Students.alone(cfg, broken), backend)
    assert built == []
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers  # none left installed
