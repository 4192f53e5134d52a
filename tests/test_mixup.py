"""Mixup and cutmix (kd.run.mixup): timm's Mixup draw for draw, from a generator keyed by the step; the
teacher forwards the mixed batch; a resumed run mixes as the uninterrupted one; what cannot mix is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import in_process_trainer, kd_main, one_error_line, resumes_bit_for_bit, tiny_config
from timm.data import Mixup

from kd import config as kd_config
from kd.data.loader import Batch
from kd.errors import KDError
from kd.run.mixup import BatchMixer

SETTINGS = {
    "mixup": dict(mixup=0.8),
    "cutmix": dict(cutmix=1.0),
    "switch": dict(mixup=0.8, cutmix=1.0, mixup_switch_prob=0.5),
    "sometimes": dict(mixup=0.8, cutmix=1.0, mixup_prob=0.5),
}


def batch(second: bool = False) -> Batch:
    g = torch.Generator().manual_seed(0)
    images = torch.randn(6, 3, 16, 16, generator=g)
    labels = torch.randint(0, 5, (6,), generator=g)
    return Batch(images, labels, second_images=images.flip(3) + 1 if second else None)


@pytest.mark.parametrize("setting", SETTINGS)
def test_kd_mixes_as_timms_mixup_with_the_same_numpy_state(setting):
    """Each step's mixed images and soft targets equal timm's Mixup called with numpy seeded by (seed,
    epoch, step, rank), whatever numpy's global generator held; the loader's batch and that generator
    are left as they were."""
    options = SETTINGS[setting]
    cfg = kd_config.RunConfig(seed=7, smoothing=0.1, **options)
    mixer = BatchMixer(cfg, num_classes=5)
    timm_mixup = Mixup(
        mixup_alpha=cfg.mixup,
        cutmix_alpha=cfg.cutmix,
        prob=cfg.mixup_prob,
        switch_prob=cfg.mixup_switch_prob,
        label_smoothing=0.1,
        num_classes=5,
    )
    b = batch()
    before = b.images.clone()
    np.random.seed(123)
    outer = np.random.get_state()[1].copy()
    mixed_steps = 0
    for step in range(8):
        np.random.rand(step)  # the global generator moved by whatever ran before: no effect
        state = np.random.get_state()
        got = mixer(b, epoch=2, step=step)
        assert np.array_equal(np.random.get_state()[1], state[1])
        np.random.seed([7, 0, 2, step, 0])  # the seed's two 32-bit words, epoch, step, rank
        images, target = timm_mixup(b.images.clone(), b.labels)
        np.random.set_state(state)
        assert torch.equal(got.images, images) and torch.equal(got.labels, target), step
        mixed_steps += not torch.equal(got.images, before)
    assert torch.equal(b.images, before) and not np.array_equal(np.random.get_state()[1], outer)
    assert mixed_steps == 8 if cfg.mixup_prob == 1 else 0 < mixed_steps < 8  # --mixup-prob: some batches only


def test_any_seed_torch_takes_keys_the_draws():
    """A negative seed or one past 32 bits (torch takes both) mixes, each seed its own draws."""
    b = batch()
    mixed = [BatchMixer(kd_config.RunConfig(seed=seed, mixup=1.0), 5)(b, 0, 0).labels for seed in (-1, 2**40, 0)]
    assert not torch.equal(mixed[0], mixed[1]) and not torch.equal(mixed[1], mixed[2])


def test_a_second_view_is_mixed_with_the_same_draw():
    """MLKD's strong view: the same lambda, box and partner as the first view's, one set of targets."""
    cfg = kd_config.RunConfig(cutmix=1.0)
    b = batch(second=True)
    got = BatchMixer(cfg, num_classes=5)(b, epoch=0, step=1)
    alone = BatchMixer(cfg, num_classes=5)(Batch(b.second_images, b.labels), epoch=0, step=1)
    assert torch.equal(got.second_images, alone.images) and torch.equal(got.labels, alone.labels)
    assert not torch.equal(got.second_images, b.second_images)


def test_the_teacher_forwards_the_mixed_batch_the_student_trains_on(image_folder, tmp_path):
    """Consistent teaching: the teacher's targets are of the mixed images, and the student's loss gets
    the mixed soft targets."""
    cfg = tiny_config(
        image_folder, tmp_path / "r", mixup=0.8, cutmix=1.0, student="timm:test_resnet", teacher="timm:test_resnet"
    )
    trainer = in_process_trainer(cfg)
    try:
        seen = {}
        forward = trainer.source.forward
        trainer.source.forward = lambda images: (seen.setdefault("teacher", images), forward(images))[1]
        step = trainer.lane.step
        trainer.lane.step = lambda b, t: (seen.setdefault("student", b), step(b, t))[1]
        loaded = next(iter(trainer.data.train))
        trainer.step(loaded)
        assert seen["teacher"] is seen["student"].images and not torch.equal(seen["teacher"], loaded.images)
        assert seen["student"].labels.shape == (len(loaded), 3)
    finally:
        trainer.close()


def test_nkd_takes_a_mixed_images_larger_part_as_its_class_and_says_so(image_folder, tmp_path):
    """NKD under mixup trains on the mixed targets' argmax (as cls_KD's NKDLoss does), and its log says so;
    the values are held against the official code in tests/test_nkd.py."""
    cfg = tiny_config(
        image_folder, tmp_path / "r", mixup=0.8, kd_loss="nkd", student="timm:test_resnet", teacher="timm:test_resnet"
    )
    trainer = in_process_trainer(cfg)
    try:
        assert [n for n in trainer.lane.notes if "larger part of its mixed target" in n] == [
            "--kd-loss nkd: a mixed image's target class is the larger part of its mixed target (the argmax), "
            "as the method's official code takes it"
        ]
        seen = {}
        step = trainer.lane.step
        trainer.lane.step = lambda b, t: (seen.setdefault("labels", b.labels), step(b, t))[1]
        trainer.step(next(iter(trainer.data.train)))
        assert seen["labels"].dim() == 2 and trainer.lane.state.global_step == 1
    finally:
        trainer.close()


def test_a_mixed_run_resumes_bit_for_bit(tmp_path, image_folder):
    """--mixup 0.8 --cutmix 1.0 resumed from a checkpoint of its fourth step (mid-epoch) ends bit for bit
    where it ended: the resumed process mixes each step as the uninterrupted one did."""
    args = ["--data", image_folder, "--student", "timm:test_resnet", "--teacher", "timm:test_resnet"]
    args += ["--teacher-weights", "none", "--image-size", "32", "-b", "8", "--device", "cpu", "--workers", "0"]
    args += ["--epochs", "2", "--save-every-steps", "2", "--keep-last", "9", "--mixup", "0.8", "--cutmix", "1.0"]
    args += ["--limit-val-batches", "1"]
    resumes_bit_for_bit(tmp_path, args)


def test_a_soft_label_store_is_refused_with_mixup_in_one_line(tmp_path, image_folder):
    store = tmp_path / "store"
    store.mkdir()
    r = kd_main("train", "--data", image_folder, "--student", "resnet18", "--soft-labels", store, "--mixup", "0.8")
    line = one_error_line(r)
    assert "--soft-labels" in line and "unmixed" in line, line


@pytest.mark.parametrize(
    "options, words",
    [
        (dict(mixup=0.8, kd_loss="crd"), "crd"),
        (dict(cutmix=1.0, kd_loss="kd,dkd"), "dkd"),
        (dict(mixup=0.8, label_smoothing=0.1), "--smoothing"),
        (dict(smoothing=0.1), "--label-smoothing"),
        (dict(mixup=0.8, mixup_prob=1.5), "--mixup-prob"),
        (dict(cutmix=-1.0), "--cutmix"),
    ],
)
def test_what_cannot_mix_is_refused(tmp_path, image_folder, options, words):
    with pytest.raises(KDError, match=words):
        tiny_config(image_folder, tmp_path / "r", **options)
