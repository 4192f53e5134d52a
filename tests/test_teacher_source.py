"""The teacher source (kd.teacher.source): the live teacher's :class:`Targets` of a batch are its model's
float32 logits and the tapped features, of the second view too where the batch has one; both sources
answer the protocol's three calls."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import TEST_RESNET_PAIR, in_process_trainer, tiny_config

from kd.data.loader import Batch
from kd.teacher.frozen import Teacher
from kd.teacher.source import Targets, TeacherSource
from kd.teacher.store import SoftLabels

#: the layer a FitNet student taps on its teacher
LAYER = "layer2"


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A run of timm's test_resnet teaching itself (random weights), FitNet on ``LAYER``, on synthetic tensors."""
    out = tmp_path_factory.mktemp("source")
    options = dict(kd_loss="fitnet", feature_layers=[LAYER], num_classes=5, batch_size=4, **TEST_RESNET_PAIR)
    cfg = tiny_config("synthetic", out, **options)
    t = in_process_trainer(cfg)
    yield t
    t.close()


def model_outputs(model, images):
    """``model``'s logits on ``images`` and the output of its ``LAYER``, read by a forward hook."""
    seen = {}
    handle = dict(model.named_modules())[LAYER].register_forward_hook(lambda m, args, out: seen.update(out=out))
    try:
        with torch.no_grad():
            logits = model(images)
    finally:
        handle.remove()
    return logits, seen["out"]


def test_the_live_teacher_gives_its_models_float32_logits_and_taps(trainer):
    source = trainer.source
    assert isinstance(source, Teacher) and source is trainer.teacher
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    got = source.targets(Batch(images, torch.arange(4)))
    assert isinstance(got, Targets) and got.second_logits is None
    logits, feature = model_outputs(source.module.teacher, images)
    assert got.logits.dtype == torch.float32 and got.logits.shape == (4, 5)
    assert torch.equal(got.logits, logits.float())
    assert list(got.feats) == [LAYER] and torch.equal(got.feats[LAYER], feature)
    source.set_epoch(3)  # a live teacher's outputs do not depend on the epoch
    assert torch.equal(source.targets(Batch(images, torch.arange(4))).logits, got.logits)


def test_a_second_view_gets_its_own_logits_from_the_same_teacher(trainer):
    source = trainer.source
    gen = torch.Generator().manual_seed(1)
    first, second = torch.randn(4, 3, 32, 32, generator=gen), torch.randn(4, 3, 32, 32, generator=gen)
    got = source.targets(Batch(first, torch.arange(4), second_images=second))
    teacher = source.module.teacher
    assert torch.equal(got.logits, model_outputs(teacher, first)[0].float())
    assert got.second_logits is not None and got.second_logits.dtype == torch.float32
    assert torch.equal(got.second_logits, model_outputs(teacher, second)[0].float())
    assert not torch.equal(got.second_logits, got.logits)


@pytest.mark.parametrize("source", [Teacher, SoftLabels])
def test_each_source_answers_the_protocols_calls(source):
    for name in ("set_epoch", "targets", "close"):
        wanted = list(inspect.signature(getattr(TeacherSource, name)).parameters)
        assert list(inspect.signature(getattr(source, name)).parameters) == wanted, (source, name)
