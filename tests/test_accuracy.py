"""An accuracy over the whole validation set (kd.utils.accuracy): unreadable val images count as
errors, are named, count under --max-bad-images, and every accuracy says how many images it is over."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import HANG_GUARD, kd_main, make_image_folder, run_kd

from kd import config as kd_config
from kd.errors import KDError
from kd.run.step import StepHook

#: the student of the runs: any model counts the images alike; this one checkpoints a fifth of
#: resnet18's weights
STUDENT = "mobilenet_v3_small"

#: a fast student-alone run on the CPU
ARGS = ["--no-teacher", "--student", STUDENT, "--image-size", 32, "-b", 8, "--device", "cpu", "--log-every", 1]


def damaged_val(root: Path) -> Path:
    """20 val images (2 classes of 10), one truncated and one of zero bytes."""
    data = make_image_folder(root, classes=2, train_per_class=4, val_per_class=10, size=(16, 16))
    truncated = data / "val" / "class_00" / "003.jpg"
    truncated.write_bytes(truncated.read_bytes()[:40])
    (data / "val" / "class_01" / "007.jpg").write_bytes(b"")
    return data


def UNREADABLE(data: Path):  # noqa: N802  (the files damaged_val damages)
    return [data / "val" / "class_00" / "003.jpg", data / "val" / "class_01" / "007.jpg"]


def records(out: Path):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> Path:
    return damaged_val(tmp_path_factory.mktemp("damaged"))


@pytest.fixture(scope="module")
def one_process(damaged, tmp_path_factory):
    """One process, two epochs on the damaged folder: its result and run folder."""
    out = tmp_path_factory.mktemp("runs") / "one"
    r = kd_main("train", "--data", damaged, *ARGS, "-j", 0, "--epochs", 2, "--out", out)
    return r, out


def test_unreadable_val_images_count_as_errors(one_process, damaged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r, out = one_process
    assert r.returncode == 0, r.stderr
    recs = records(out)
    for rec in recs:
        assert rec["val_images"] == 20 and rec["val_unreadable"] == 2, rec
        assert rec["val_top1"] * 20 / 100 == pytest.approx(round(rec["val_top1"] * 20 / 100), abs=1e-6)
        assert rec["val_top1"] <= 90.0  # at most 18 of 20
    # named once, not at every validation
    for name in ("val/class_00/003.jpg", "val/class_01/007.jpg"):
        assert r.stderr.count(name) == 1, r.stderr
    assert "2 of 20 val images unreadable" in r.stderr
    assert "val top-1" in r.stderr and "(20 images, 2 unreadable)" in r.stderr
    assert "20 val images, 2 unreadable" in r.stdout.splitlines()[-1], r.stdout
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    assert events.Scalars("epoch/val_images")[-1].value == 20
    assert events.Scalars("epoch/val_unreadable")[-1].value == 2


def test_kd_eval_and_report_count_every_image(one_process, damaged):
    r, out = one_process
    assert r.returncode == 0, r.stderr
    e = kd_main("eval", "--weights", out / "checkpoints" / "last.pt", "--data", damaged, "-j", 0)
    assert e.returncode == 0, e.stderr
    line = e.stdout.splitlines()[-1]
    assert "(20 images, 2 unreadable, counted as errors)" in line, line
    assert "val/class_00/003.jpg" in e.stderr + e.stdout
    last = records(out)[-1]
    assert f"top-1 {last['val_top1']:.2f}" in line
    rep = kd_main("report", out)
    assert rep.returncode == 0, rep.stderr
    assert "val_images" in rep.stdout and "20 (2 unreadable)" in rep.stdout, rep.stdout


def test_unreadable_val_images_count_under_max_bad_images(damaged, tmp_path):
    out = tmp_path / "strict"
    r = kd_main("train", "--data", damaged, *ARGS, "-j", 0, "--epochs", 1, "--max-bad-images", 1, "--out", out)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("kd: error: 2 unreadable images") and "--max-bad-images 1" in last, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_two_processes_count_as_one(damaged, tmp_path):
    """The val sampler shards without padding and the counts are summed: a 2-process run logs the
    val_images and val_top1 that one process (kd eval) gives for its checkpoint, and names each
    unreadable file once. An unreadable training image in the batch of one image of the second
    process (-b 2) is named by the first, and a readable batch stands in for that batch: the run goes on."""
    data = tmp_path / "data"
    shutil.copytree(damaged, data)
    (data / "train" / "class_01" / "001.jpg").write_bytes(b"")
    out = tmp_path / "two"
    args = ["--no-teacher", "--student", "timm:test_convnext", "--image-size", 32, "-b", 2, "--device", "cpu"]
    r = run_kd(
        *["train", "--data", data, *args, "-j", 0, "--epochs", 1, "--max-bad-images", 10, "--out", out],
        *["--backend", "torch_ddp", "--nproc", 2],
        env={"OMP_NUM_THREADS": "1"},
        timeout=HANG_GUARD,
    )
    assert r.returncode == 0, r.stderr
    (rec,) = records(out)
    assert rec["val_images"] == 20 and rec["val_unreadable"] == 2, rec
    for name in ("val/class_00/003.jpg", "val/class_01/007.jpg"):
        assert r.stderr.count(name) == 1, r.stderr
    assert f"skipped unreadable image {data / 'train' / 'class_01' / '001.jpg'} (process 1)" in r.stderr, r.stderr
    assert rec["train_bad_images"] == 1, rec
    e = kd_main("eval", "--weights", out / "checkpoints" / "last.pt", "--data", damaged, "-j", 0)
    assert e.returncode == 0, e.stderr
    assert f"top-1 {rec['val_top1']:.2f}  top-5 {rec['val_top5']:.2f}" in e.stdout, (rec, e.stdout)


def test_the_log_names_the_val_resize_used(tmp_path):
    """--val-resize 10 with --image-size 32 is logged as resize 10, not the data config's 37. A resize
    smaller than the crop is what torchvision does too (its CenterCrop pads with black; kd's crop
    equals it bit for bit), so it is used and said, not refused."""
    data = make_image_folder(tmp_path / "data", classes=2, train_per_class=4, val_per_class=1, size=(16, 16))
    r = kd_main("train", "--data", data, *ARGS, "-j", 0, "--epochs", 1, "--val-resize", 10, "--out", tmp_path / "r")
    assert r.returncode == 0, r.stderr
    (line,) = [line for line in r.stderr.splitlines() if line.startswith(f"student {STUDENT}:")]
    assert "eval: bilinear resize 10 (--val-resize), centre crop 32" in line, line
    assert "resize 37" not in line and "padded with black" in line, line


class _Deleter(StepHook):
    """Deletes ``paths`` after the run's first step: files gone after the listing was made."""

    def __init__(self, paths):
        self.paths = list(paths)

    def on_step(self, trainer, out) -> None:
        for path in self.paths:
            if path.exists():
                path.unlink()


def _disappearing_run(tmp_path, workers: int, max_bad_images: int):
    """Two epochs of a real run in this process on a folder whose listing loses a training and a
    val image after the first step: (the run's folder, the two paths); the Trainer closed after."""
    import backends
    from kd.run.loop import Trainer
    from kd.run.students import Students

    data = make_image_folder(tmp_path / "data", classes=2, train_per_class=4, val_per_class=3, size=(16, 16))
    gone = [data / "train" / "class_01" / "002.jpg", data / "val" / "class_00" / "001.jpg"]
    options = dict(
        data=str(data), out=str(tmp_path / "run"), no_teacher=True, student=STUDENT, image_size=32,
        batch_size=4, workers=workers, device="cpu", epochs=2, log_every=1, max_bad_images=max_bad_images,
    )  # fmt: skip
    cfg = kd_config.resolve(options=options)
    backend = backends.get("single")(cfg)
    backend.setup()
    trainer = Trainer(Students.alone(cfg), backend, hooks=[_Deleter(gone)])
    try:
        trainer.fit()
    finally:
        trainer.close()
    return tmp_path / "run", gone


def test_images_that_disappear_mid_run_count_as_unreadable(tmp_path, capfd):
    """A training and a val image deleted after the first step (a DataLoader worker reads them):
    each counts as unreadable (named, under --max-bad-images), the val accuracy stays over every
    listed image, and the run ends."""
    out, (train_gone, val_gone) = _disappearing_run(tmp_path, 1, max_bad_images=2)
    err = capfd.readouterr().err
    assert f"skipped unreadable image {train_gone}" in err and f"unreadable val image {val_gone}" in err, err
    recs = records(out)
    assert recs[-1]["train_bad_images"] == 1
    assert [(r["val_images"], r["val_unreadable"]) for r in recs] == [(6, 1), (6, 1)]


def test_images_that_disappear_mid_run_count_under_max_bad_images(tmp_path):
    with pytest.raises(KDError, match=r"^2 unreadable images, more than --max-bad-images 1"):
        _disappearing_run(tmp_path, 0, max_bad_images=1)


class _Fp32:
    """A float32 precision: no autocast, no input cast."""

    def autocast(self):
        import contextlib

        return contextlib.nullcontext()

    def input_cast(self, images):
        return images


@pytest.mark.parametrize("decoder", ["cpu", "cpu-thread"])
def test_the_gpu_loader_counts_unreadable_val_images_as_the_pil_loader(damaged, monkeypatch, decoder):
    """--loader gpu on the CPU (its decode falls back there): the same images, unreadable ones and
    accuracy as the PIL loader, batches of one included (a batch of an unreadable image alone)."""
    import torch

    import backends
    from kd.data import gpu as gpu_mod
    from kd.data.gpu import make_gpu_loader
    from kd.data.layout import scan_split
    from kd.data.loader import Shard, make_pil_loader
    from kd.utils.accuracy import evaluate

    monkeypatch.setenv(gpu_mod.DECODER_ENV, decoder)
    cfg = kd_config.resolve(
        options=dict(
            data=str(damaged), out="unused", student="resnet18", no_teacher=True, image_size=32, workers=0, device="cpu"
        )
    )
    backend = backends.get("single")(cfg)
    backend.setup()
    _, val = scan_split(damaged, "val")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten(), torch.nn.Linear(12, 2)).eval()
    for batch in (1, 4):
        cpu = torch.device("cpu")
        got = evaluate(net, make_gpu_loader(cfg, val, False, Shard(1, 0, batch, cpu, False)), backend, _Fp32())
        ref = evaluate(net, make_pil_loader(cfg, val, False, Shard(1, 0, batch, cpu, False)), backend, _Fp32())
        assert got["images"] == ref["images"] == 20 and got["unreadable"] == ref["unreadable"] == 2
        assert got["unreadable_files"] == ref["unreadable_files"] == sorted(str(p) for p in UNREADABLE(damaged))
        assert got["top1"] == pytest.approx(ref["top1"], abs=5.0)  # one image in 20 may differ by a rounding


def test_a_prepared_copy_counts_the_val_images_it_left_out(one_process, damaged, tmp_path):
    """kd prepare leaves unreadable val images out of the copy (and says so); an accuracy on the
    copy is still over the whole val split, as on the folder: the same images, names and top-1."""
    from kd.data.prepared_writer import Settings, prepare

    r, out = one_process
    assert r.returncode == 0, r.stderr
    prepare(str(damaged), str(tmp_path / "copy"), Settings(max_side=32), progress=False, echo=lambda line: None)
    weights = out / "checkpoints" / "last.pt"
    on_copy = kd_main("eval", "--weights", weights, "--data", tmp_path / "copy", "-j", 0)
    on_folder = kd_main("eval", "--weights", weights, "--data", damaged, "-j", 0)
    assert on_copy.returncode == on_folder.returncode == 0, on_copy.stderr + on_folder.stderr
    assert "(20 images, 2 unreadable, counted as errors)" in on_copy.stdout, on_copy.stdout
    assert on_copy.stdout.splitlines()[-1].split(":", 1)[1] == on_folder.stdout.splitlines()[-1].split(":", 1)[1]
    for path in UNREADABLE(damaged):
        assert f"unreadable val image {path}" in on_copy.stderr, on_copy.stderr
    # training on the copy: the run's validation counts them too
    run = kd_main("train", "--data", tmp_path / "copy", *ARGS, "-j", 0, "--epochs", 1, "--out", tmp_path / "r")
    assert run.returncode == 0, run.stderr
    assert [(rec["val_images"], rec["val_unreadable"]) for rec in records(tmp_path / "r")] == [(20, 2)]
    # a limited pass is over its batches alone: the images the copy left out are in none of them
    limited = ["--limit-val-batches", 1, "--out", tmp_path / "limited"]
    run = kd_main("train", "--data", tmp_path / "copy", *ARGS, "-j", 0, "--epochs", 1, "-b", 6, *limited)
    assert run.returncode == 0, run.stderr
    assert [(rec["val_images"], rec["val_unreadable"]) for rec in records(tmp_path / "limited")] == [(6, 0)]
