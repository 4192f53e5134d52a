"""Each model gets the crop normalised its own way: a timm teacher with (0.5, 0.5, 0.5) beside a
torchvision student with ImageNet's mean and std, in training (one crop, renormalised on the
device) and in its own validation, whose crops and normalisation equal timm's own eval transform."""

from __future__ import annotations

import pytest
import timm
import torch
import yaml
from conftest import make_image_folder
from PIL import Image
from timm.data import create_transform, resolve_data_config

import backends
from kd import config as kd_config
from kd.run.loop import Trainer
from kd.run.students import Students

TEACHER = "timm:test_resnet"  # timm's own test model: mean and std 0.5, bilinear, crop_pct 0.95


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(
        tmp_path_factory.mktemp("dc"), classes=3, train_per_class=4, val_per_class=3, size=(45, 37)
    )


def trainer(data, out):
    cfg = kd_config.resolve(
        options=dict(
            data=str(data), out=str(out), teacher=TEACHER, teacher_weights="none", student="resnet18",
            image_size=32, batch_size=6, workers=0, device="cpu", epochs=1, progress_bar=False,
        )
    )  # fmt: skip
    backend = backends.get("single")(cfg)
    backend.setup()
    return Trainer(Students.alone(cfg), backend)


def first_conv_inputs(model):
    seen = []
    conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    conv.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    return seen


def test_a_teacher_is_fed_the_crop_normalised_its_own_way(data, tmp_path, capfd):
    t = trainer(data, tmp_path / "run")
    try:
        teacher_in = first_conv_inputs(t.teacher.module)
        student_in = first_conv_inputs(t.lane.side.student)
        t.data.train.set_epoch(0)
        batch = next(iter(t.data.train))
        t.lane.side.train()
        t.step(batch)
        imagenet = (torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225]))
        pixels = batch.images * imagenet[1].view(1, 3, 1, 1) + imagenet[0].view(1, 3, 1, 1)  # 0-1
        torch.testing.assert_close(student_in[-1], batch.images)
        torch.testing.assert_close(teacher_in[-1], (pixels - 0.5) / 0.5, rtol=0, atol=1e-5)
    finally:
        t.close()
    err = capfd.readouterr().err
    assert f"teacher {TEACHER}: train 32; mean (0.5, 0.5, 0.5) std (0.5, 0.5, 0.5); eval: bilinear resize 33" in err
    assert (
        "student resnet18: train 32; mean (0.485, 0.456, 0.406) std (0.229, 0.224, 0.225); eval: bilinear resize 37"
        in err
    )
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["teacher_data"]["mean"] == [0.5, 0.5, 0.5] and saved["student_data"]["std"] == [0.229, 0.224, 0.225]


def test_the_teachers_validation_is_timms_eval_transform(data, tmp_path):
    """Its own crops (resize 33 for its crop_pct 0.95, not the student's 37) and its normalisation:
    what timm's create_transform makes of each val image, in the val order."""
    t = trainer(data, tmp_path / "val")
    try:
        seen = first_conv_inputs(t.teacher.module)
        t.teacher.validate()
        got = torch.cat(seen)
    finally:
        t.close()
    config = resolve_data_config(model=timm.create_model("test_resnet", pretrained=False))
    transform = create_transform(**{**config, "input_size": (3, 32, 32)})
    paths = sorted((data / "val").rglob("*.jpg"))
    expected = torch.stack([transform(Image.open(p).convert("RGB")) for p in paths])
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
