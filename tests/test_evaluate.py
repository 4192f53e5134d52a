"""kd eval (kd.commands.evaluate): a kd checkpoint brings its run's model and preprocessing, options
override them, a plain weights file needs --model, the class count must fit the data."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import kd_main, make_image_folder, one_error_line

from kd.errors import KDError


@pytest.fixture(scope="module")
def trained(teacher_run, image_folder):
    """The shared short run (image size 32, val resize 32: the demo's preprocessing): its data,
    last.pt and last logged record."""
    _, out = teacher_run
    logged = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    return image_folder, out / "checkpoints" / "last.pt", logged


def test_eval_cli_takes_model_and_preprocessing_from_the_checkpoint(trained):
    data, ckpt, logged = trained
    r = kd_main("eval", "--weights", ckpt, "--data", data, "-b", 8, "-j", 0, "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "timm:resnet10t" in r.stdout and "image size 32" in r.stdout and "val resize 32" in r.stdout, r.stdout
    assert "checkpoint" in r.stdout
    assert f"top-1 {logged['val_top1']:.2f}" in r.stdout
    assert f"loss {logged['val_loss']:.4f}" in r.stdout  # the mean validation loss, as timm's validate prints


def test_eval_of_a_checkpoint_is_the_runs_own_validation(trained):
    from kd.commands.evaluate import evaluate_model

    data, ckpt, logged = trained
    r = evaluate_model(None, str(ckpt), str(data), batch_size=8, device="cpu", workers=0)
    assert (r["model"], r["image_size"], r["val_resize"], r["num_classes"]) == ("timm:resnet10t", 32, 32, 3)
    assert r["loss"] == pytest.approx(logged["val_loss"], abs=1e-5)


def test_eval_options_override_the_checkpoint(trained):
    from kd.commands.evaluate import evaluate_model

    data, ckpt, logged = trained
    r = evaluate_model(None, str(ckpt), str(data), batch_size=8, device="cpu", workers=0, image_size=48)
    # a new size: the model's own resize for it (timm's floor(48 / 0.875) for resnet10t), not the run's 32
    assert (r["image_size"], r["val_resize"]) == (48, 54)
    assert "image size 48 (option)" in r["settings"]
    assert r["loss"] != pytest.approx(logged["val_loss"], abs=1e-5)
    r = evaluate_model("timm:resnet10t", str(ckpt), str(data), batch_size=8, device="cpu", workers=0, val_resize=40)
    assert (r["image_size"], r["val_resize"]) == (32, 40)


def test_eval_plain_weights_file_needs_model(trained, tmp_path):
    from kd.commands.evaluate import evaluate_model

    data, ckpt, _ = trained
    plain = tmp_path / "plain.pt"
    torch.save(torch.load(ckpt, weights_only=True)["student"], plain)
    with pytest.raises(KDError, match="--model"):
        evaluate_model(None, str(plain), str(data), device="cpu", workers=0)
    r = evaluate_model(
        "timm:resnet10t", str(plain), str(data), batch_size=8, device="cpu", image_size=32, val_resize=32, workers=0
    )
    assert "image size 32 (option)" in r["settings"] and r["num_classes"] == 3


def test_eval_class_count_must_fit_the_data(trained, tmp_path):
    data, ckpt, _ = trained
    other = make_image_folder(tmp_path / "four", classes=4, train_per_class=1, val_per_class=1)
    r = kd_main("eval", "--weights", ckpt, "--data", other, "-j", 0, "--device", "cpu")
    line = one_error_line(r)
    assert "3 classes" in line and "4 class folders" in line, line


def test_eval_workers_default_to_the_cores(trained):
    from kd.commands.evaluate import resolve
    from kd.data.loader import default_workers

    _, ckpt, _ = trained
    assert resolve(None, str(ckpt)).workers == default_workers(1)
    assert resolve(None, str(ckpt), workers=0).workers == 0
