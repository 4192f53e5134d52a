"""kd.run.record and kd.run.sides: a student's inputs for one step, made once from the batch and the
teacher's targets (:func:`kd.run.record.step_inputs`), and the student side that takes them whole and
hands its loss :class:`kd.losses.DistillInputs`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kd.data.loader import Batch
from kd.losses import DistillInputs, build_loss
from kd.run.record import StepInputs, step_inputs
from kd.run.sides import StudentSide
from kd.teacher.source import Targets

BATCH, CLASSES = 4, 3


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, CLASSES))


def batch_and_targets(second: bool = False):
    g = torch.Generator().manual_seed(1)
    images = torch.randn(BATCH, 3, 8, 8, generator=g)
    views = torch.randn(BATCH, 3, 8, 8, generator=g) if second else None
    batch = Batch(images, torch.tensor([0, 2, 1, 0]), indices=torch.tensor([5, 1, 7, 3]), second_images=views)
    feats = {"a": torch.randn(BATCH, 2, generator=g), "b": torch.randn(BATCH, 5, generator=g)}
    second_logits = torch.randn(BATCH, CLASSES, generator=g) if second else None
    return batch, Targets(torch.randn(BATCH, CLASSES, generator=g), feats, second_logits)


def double(images: torch.Tensor) -> torch.Tensor:
    return images * 2


def test_a_logit_method_gets_the_labels_the_teachers_logits_as_given_and_its_taps_only():
    batch, targets = batch_and_targets()
    x = step_inputs(batch, targets, build_loss("kd", CLASSES, {}), ["b"], double, 1.5, 7)
    assert torch.equal(x.images, batch.images * 2) and x.second_images is None
    assert set(x.loss_inputs) == {"labels", "teacher_logits", "teacher_feats"}
    assert x.loss_inputs["labels"] is batch.labels
    assert x.loss_inputs["teacher_logits"] is targets.logits  # float32 from the source: not cast (copied) again
    assert list(x.loss_inputs["teacher_feats"]) == ["b"] and x.loss_inputs["teacher_feats"]["b"] is targets.feats["b"]


def test_a_student_alone_gets_no_teacher_fields():
    batch, _ = batch_and_targets()
    x = step_inputs(batch, None, build_loss("ce", CLASSES, {}), [], double, 0.0, 0)
    assert set(x.loss_inputs) == {"labels"}


def test_the_progress_and_the_step_go_to_the_methods_that_read_them():
    """Not to the others: a compiled step guards on every number its record hands the loss, and these
    change every step (a second compilation at the second step, for nothing). The progress goes as its
    whole part, an int (the epochs completed: every method reads the epoch)."""
    batch, targets = batch_and_targets()
    dkd = step_inputs(batch, targets, build_loss("dkd", CLASSES, {}), [], double, 1.5, 7)
    assert dkd.loss_inputs["progress"] == 1 and type(dkd.loss_inputs["progress"]) is int
    assert "step" not in dkd.loss_inputs
    crd = step_inputs(batch, targets, build_loss("crd", CLASSES, {}), [], double, 1.5, 7)
    assert crd.loss_inputs["step"] == 7 and "progress" not in crd.loss_inputs
    # a user's subclass that says no card of its own may read either: it is handed both
    kd_class = type(build_loss("kd", CLASSES, {}))
    mine = step_inputs(batch, targets, type("MyKD", (kd_class,), {})(CLASSES), [], double, 1.5, 7)
    assert (mine.loss_inputs["progress"], mine.loss_inputs["step"]) == (1, 7)


def test_the_methods_needs_of_a_batch_are_read_where_the_record_is_made():
    batch, targets = batch_and_targets(second=True)
    crd = step_inputs(batch, targets, build_loss("crd", CLASSES, {}), [], double, 0.0, 0)
    assert torch.equal(crd.loss_inputs["indices"], batch.indices) and crd.second_images is None
    mlkd = step_inputs(batch, targets, build_loss("mlkd", CLASSES, {}), [], double, 0.0, 0)
    assert "indices" not in mlkd.loss_inputs
    assert batch.second_images is not None and torch.equal(mlkd.second_images, batch.second_images * 2)
    assert mlkd.loss_inputs["second_teacher_logits"] is targets.second_logits
    assert crd.classifier is None and mlkd.classifier is None
    sdd = build_loss("sddkd", CLASSES, {})
    sdd.setup_classifiers("4", torch.zeros(CLASSES, 2), None)
    assert step_inputs(batch, targets, sdd, [], double, 0.0, 0).classifier == "4"  # each replica hands the loss its own


@pytest.mark.parametrize("method", ["kd", "mlkd"])
def test_the_student_side_hands_its_loss_the_records_fields_by_name(method):
    batch, targets = batch_and_targets(second=method == "mlkd")
    loss = build_loss(method, CLASSES, {})
    student = net()
    parts = StudentSide(student, loss, [])(step_inputs(batch, targets, loss, [], double, 0.5, 3))
    second = {}
    if batch.second_images is not None:
        second = dict(
            second_student_logits=student(batch.second_images * 2), second_teacher_logits=targets.second_logits
        )
    expected = loss(
        DistillInputs(student(batch.images * 2), batch.labels, targets.logits, progress=0.5, step=3, **second)
    )
    assert parts.keys() - {"_student_logits_sum"} == expected.keys()
    for key in expected:
        torch.testing.assert_close(parts[key], expected[key], rtol=0, atol=0)


def test_a_field_the_loss_does_not_know_is_refused_not_dropped():
    batch, _ = batch_and_targets()
    side = StudentSide(net(), build_loss("ce", CLASSES, {}), [])
    with pytest.raises(TypeError, match="mixed_labels"):
        side(StepInputs(batch.images, {"labels": batch.labels, "mixed_labels": batch.labels}))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_data_parallel_scatters_the_record_along_the_batch_and_copies_its_numbers():
    batch, targets = batch_and_targets(second=True)
    x = step_inputs(batch, targets, build_loss("mlkd", CLASSES, {}), ["a"], double, 0.25, 9)
    parts = torch.nn.parallel.scatter((x,), [0, 1])
    assert len(parts) == 2
    for i, (part,) in enumerate(parts):
        rows = slice(2 * i, 2 * i + 2)
        assert isinstance(part, StepInputs) and part.images.device == torch.device("cuda", i)
        torch.testing.assert_close(part.images.cpu(), x.images[rows], rtol=0, atol=0)
        torch.testing.assert_close(part.second_images.cpu(), x.second_images[rows], rtol=0, atol=0)
        for key in ("labels", "teacher_logits", "second_teacher_logits"):
            torch.testing.assert_close(part.loss_inputs[key].cpu(), x.loss_inputs[key][rows], rtol=0, atol=0)
        torch.testing.assert_close(part.loss_inputs["teacher_feats"]["a"].cpu(), targets.feats["a"][rows])
        assert (part.loss_inputs["progress"], part.loss_inputs["step"]) == (0.25, 9)
