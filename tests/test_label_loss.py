"""The label term: softmax cross-entropy by default, timm's BinaryCrossEntropy under --bce-loss (held
equal to timm's own on hard, smoothed, mixed and thresholded targets), for every method and both views."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import kd_main, one_error_line, resumes_bit_for_bit, train_args
from timm.data.mixup import mixup_target
from timm.loss import BinaryCrossEntropy

from kd.losses import DistillInputs, build_loss

CLASSES = 7


def student_logits(seed: int, n: int = 5) -> torch.Tensor:
    return 3 * torch.randn(n, CLASSES, generator=torch.Generator().manual_seed(seed))


def hard_labels(seed: int, n: int = 5) -> torch.Tensor:
    return torch.randint(0, CLASSES, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("threshold", [None, 0.2])
@pytest.mark.parametrize("mixed", [False, True])
def test_bce_is_timms_binary_cross_entropy(smoothing, threshold, mixed):
    """KD's loss with --bce-loss: its label term is timm's BinaryCrossEntropy as timm's train.py builds
    it (hard labels smoothed by it; mixed targets, smoothed by the mixer, as they come), the KD part as
    with cross-entropy."""
    z, y, teacher = student_logits(1), hard_labels(2), student_logits(3)
    if mixed:  # timm's Mixup targets: the batch and its flip, smoothed by the mixer
        targets = mixup_target(y, CLASSES, lam=0.7, smoothing=smoothing)
        args, theirs = {}, BinaryCrossEntropy(target_threshold=threshold)
    else:
        targets = y
        args, theirs = {"label_smoothing": smoothing}, BinaryCrossEntropy(smoothing, target_threshold=threshold)
    loss = build_loss("kd", CLASSES, args)
    plain = loss(DistillInputs(z, targets, teacher))
    loss.use_bce(threshold)
    ours = loss(DistillInputs(z, targets, teacher))
    assert "ce" not in ours
    assert torch.equal(ours["bce"], theirs(z, targets))
    assert torch.equal(ours["kd"], plain["kd"])
    assert torch.equal(ours["loss"], loss.hparams["ce_weight"] * ours["bce"] + loss.hparams["kd_weight"] * ours["kd"])


def test_bce_takes_both_views_of_a_two_view_method():
    weak, strong, y = student_logits(4), student_logits(5), hard_labels(6)
    loss = build_loss("mlkd", CLASSES, {})
    loss.use_bce()
    inputs = DistillInputs(weak, y, student_logits(7), second_student_logits=strong, second_teacher_logits=weak)
    theirs = BinaryCrossEntropy(0.0)
    assert torch.equal(loss.label_term(inputs), theirs(weak, y) + theirs(strong, y))


def test_a_run_with_bce_logs_it_resumes_bit_for_bit_and_its_threshold_needs_it(image_folder, tmp_path):
    """Mixed targets through --bce-loss with a threshold: logged as bce; resumed from its fourth step
    (mid-epoch) it ends bit for bit where the whole run ended."""
    args = ["--data", image_folder, "--student", "timm:test_resnet", "--teacher", "timm:test_resnet"]
    args += ["--teacher-weights", "none", "--image-size", "32", "-b", "8", "--device", "cpu", "--workers", "0"]
    args += ["--epochs", "2", "--save-every-steps", "2", "--keep-last", "9", "--mixup", "0.8", "--cutmix", "1.0"]
    args += ["--limit-val-batches", "1", "--bce-loss", "--bce-target-thresh", "0.2"]
    resumes_bit_for_bit(tmp_path, args)
    record = json.loads((tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["train_bce"] > 0 and "train_ce" not in record
    r = kd_main(*train_args(image_folder, tmp_path / "thresh", "--bce-target-thresh", "0.2"))
    assert one_error_line(r) == (
        "kd: error: --bce-target-thresh thresholds the targets of --bce-loss; give --bce-loss too"
    )
    r = kd_main(*train_args(image_folder, tmp_path / "range", "--bce-loss", "--bce-target-thresh", "1.5"))
    assert one_error_line(r) == "kd: error: --bce-target-thresh must be in [0, 1), got 1.5"
    assert not (tmp_path / "thresh").exists() and not (tmp_path / "range").exists()
