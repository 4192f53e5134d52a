"""Each model at its own resolution: a teacher whose weights were trained at another size gets the
run's crop resized on the device to it and is validated on its own crops at its published size
(timm's create_transform at that size), and ``kd eval`` evaluates named weights at their published
crop and resize (torchvision's ``Weights.transforms()``, timm's test size)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision.models as tvm
from conftest import kd_main, make_image_folder, train_args
from PIL import Image
from test_data_config import first_conv_inputs
from timm.data import create_transform, resolve_data_config
from timm.models import get_pretrained_cfg

import backends
from kd import config as kd_config
from kd.commands import evaluate
from kd.data.folder import ImageFolderPIL
from kd.data.model_data import data_config, with_data_configs
from kd.errors import KDError
from kd.run.loop import Trainer
from kd.run.students import Students

TEACHER = "timm:test_resnet"
TAG = "timm:r160_in1k"  # trained at 160 px: crop_pct 0.95, bilinear, mean and std 0.5


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(
        tmp_path_factory.mktemp("res"), classes=3, train_per_class=4, val_per_class=3, size=(45, 37)
    )


def trainer(data, out):
    """resnet18 at 32 px beside timm's test_resnet with the data config of its 160 px weights
    (random weights: the sizes are what is under test)."""
    cfg = kd_config.resolve(
        options=dict(
            data=str(data), out=str(out), teacher=TEACHER, teacher_weights="none", student="resnet18",
            image_size=32, batch_size=6, workers=0, device="cpu", epochs=1, progress_bar=False,
            teacher_data=data_config(TEACHER, TAG).to_dict(),
        )
    )  # fmt: skip
    backend = backends.get("single")(cfg)
    backend.setup()
    return Trainer(Students.alone(cfg), backend)


def test_the_teacher_sees_the_students_crop_at_its_own_size(data, tmp_path, capfd):
    t = trainer(data, tmp_path / "run")
    try:
        teacher_in = first_conv_inputs(t.teacher.module)
        student_in = first_conv_inputs(t.lane.side.student)
        t.data.train.set_epoch(0)
        batch = next(iter(t.data.train))
        t.lane.side.train()
        t.step(batch)
    finally:
        t.close()
    imagenet = (torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225]))
    pixels = batch.images * imagenet[1].view(1, 3, 1, 1) + imagenet[0].view(1, 3, 1, 1)  # 0-1
    assert student_in[-1].shape[-2:] == (32, 32)
    expected = F.interpolate((pixels - 0.5) / 0.5, (160, 160), mode="bilinear", align_corners=False)
    torch.testing.assert_close(teacher_in[-1], expected, rtol=0, atol=1e-5)
    err = capfd.readouterr().err
    assert f"teacher {TEACHER}: train 32->160 (resized on the device); mean (0.5, 0.5, 0.5)" in err
    assert "eval: bilinear resize 168, centre crop 160 (timm test_resnet.r160_in1k)" in err
    assert "student resnet18: train 32; " in err


def test_the_teachers_validation_is_timms_eval_transform_at_its_size(data, tmp_path):
    t = trainer(data, tmp_path / "val")
    try:
        seen = first_conv_inputs(t.teacher.module)
        t.teacher.validate()
        got = torch.cat(seen)
    finally:
        t.close()
    config = resolve_data_config({}, pretrained_cfg=get_pretrained_cfg("test_resnet.r160_in1k").to_dict())
    assert config["input_size"] == (3, 160, 160)
    transform = create_transform(**config)
    paths = sorted((data / "val").rglob("*.jpg"))
    expected = torch.stack([transform(Image.open(p).convert("RGB")) for p in paths])
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Non-square JPEGs of odd sizes, larger than the crops."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    paths = []
    for i, (w, h) in enumerate([(517, 333), (401, 599), (640, 480)]):
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        path = root / f"{i}.jpg"
        Image.fromarray(pixels).save(path, quality=92)
        paths.append(str(path))
    return paths


def kd_eval_crops(settings, paths):
    dataset = ImageFolderPIL(
        [(p, 0) for p in paths], settings.image_size, False, settings.val_resize, 0.08, settings.data.interpolation
    )
    mean, std = torch.tensor(settings.data.mean).view(3, 1, 1), torch.tensor(settings.data.std).view(3, 1, 1)
    return [(dataset[(i, 0)][0].float() / 255 - mean) / std for i in range(len(paths))]


@pytest.mark.parametrize(
    "name,member,size",
    [
        ("efficientnet_b3", tvm.EfficientNet_B3_Weights.IMAGENET1K_V1, 300),
        ("vit_b_16", tvm.ViT_B_16_Weights.IMAGENET1K_SWAG_E2E_V1, 384),
        ("inception_v3", tvm.Inception_V3_Weights.IMAGENET1K_V1, 299),
    ],
)
def test_kd_eval_of_torchvision_weights_is_their_published_transform(photos, name, member, size):
    settings = evaluate.resolve(name, f"torchvision:{member.name}")
    reference = member.transforms()
    assert (
        (settings.image_size, settings.val_resize)
        == (reference.crop_size[0], reference.resize_size[0])
        == (
            size,
            settings.val_resize,
        )
    )
    assert settings.sources["image size"].startswith("the weights'")
    for path, got in zip(photos, kd_eval_crops(settings, photos)):
        expected = reference(Image.open(path).convert("RGB"))
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert evaluate.resolve(name, f"torchvision:{member.name}", image_size=224).val_resize == round(
        224 * reference.resize_size[0] / reference.crop_size[0]
    )  # --image-size still rules


def test_kd_eval_of_timm_weights_is_timms_test_transform(photos):
    """timm's efficientnet_b3 trains at 288 and is evaluated at its test size 320 (crop_pct 1.0)."""
    settings = evaluate.resolve("timm:efficientnet_b3", "pretrained")
    config = resolve_data_config({}, pretrained_cfg=get_pretrained_cfg("efficientnet_b3").to_dict(), use_test_size=True)
    assert (settings.image_size, settings.val_resize) == (320, 320) and config["input_size"] == (3, 320, 320)
    transform = create_transform(**config)
    for path, got in zip(photos, kd_eval_crops(settings, photos)):
        torch.testing.assert_close(got, transform(Image.open(path).convert("RGB")), rtol=0, atol=1e-5)
    assert data_config("timm:efficientnet_b3", "pretrained").train_size(224) == 288


def _inception_file(torch_home: Path) -> None:
    """A generated file of the real key set of torchvision's inception_v3 IMAGENET1K_V1 (its
    auxiliary head too) where torch's hub cache holds the published file."""
    member = tvm.Inception_V3_Weights.IMAGENET1K_V1
    torch.manual_seed(0)
    state = tvm.inception_v3(weights=None, aux_logits=True, init_weights=False, transform_input=True).state_dict()
    folder = torch_home / "hub" / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / Path(member.url).name)


@pytest.mark.slow
def test_an_inception_v3_teacher_beside_a_resnet18_student(tmp_path):
    """torchvision's inception_v3 (299 px) teaches resnet18 on 32 px crops: it is fed them at 299 and
    validated on its own crops (resize 342, crop 299); 1000 classes of one image each, as its weights have."""
    data = make_image_folder(tmp_path / "data", classes=1000, train_per_class=1, val_per_class=1, size=(20, 16))
    _inception_file(tmp_path / "torch")
    out = tmp_path / "run"
    args = train_args(
        data, out, teacher="inception_v3", teacher_weights="torchvision:IMAGENET1K_V1", batch_size=4,
        teacher_precision="float32", limit_train_batches=2, limit_val_batches=1, no_progress=True,
    )  # fmt: skip
    result = kd_main(*args, "--set", "val_cache_gb=0", env={"TORCH_HOME": str(tmp_path / "torch")})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "teacher inception_v3: train 32->299 (resized on the device); " in result.stderr
    assert (
        "eval: bilinear resize 342, centre crop 299 (torchvision Inception_V3_Weights.IMAGENET1K_V1)" in result.stderr
    )
    assert "teacher inception_v3: validated on its own crops (bilinear, resize 342, crop 299)" in result.stderr
    assert "student resnet18: train 32; " in result.stderr


def test_a_vit_student_of_weights_at_another_size_says_which_size(data, tmp_path):
    """A torchvision ViT takes the one size it was built at: its SWAG weights' 384, said at the start."""
    cfg = kd_config.resolve(
        options=dict(data=str(data), out=str(tmp_path), no_teacher=True, student="vit_b_16", image_size=224,
                     student_weights="torchvision:IMAGENET1K_SWAG_E2E_V1")
    )  # fmt: skip
    with pytest.raises(KDError, match="built for 384 px images only .*: pass --image-size 384"):
        with_data_configs(cfg)


@pytest.mark.slow
def test_a_kd_trained_teacher_is_fed_and_validated_at_its_runs_size(data, tmp_path):
    """A teacher kd trained at 48 px (val resize 50) beside a student at 32: fed the crops at 48 and
    validated as its own run validated it."""
    teacher = tmp_path / "teacher"
    args = train_args(data, teacher, no_teacher=True, image_size=48, val_resize=50, no_progress=True)
    assert kd_main(*args, "--limit-train-batches", "1").returncode == 0
    best = teacher / "checkpoints" / "best.pt"
    args = train_args(data, tmp_path / "student", teacher=None, teacher_weights=best, no_progress=True)
    result = kd_main(*args, "--limit-train-batches", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "teacher resnet18: train 32->48 (resized on the device); " in result.stderr
    assert "teacher resnet18: validated on its own crops (bilinear, resize 50, crop 48)" in result.stderr
    assert "so its top-1 here differs" not in result.stderr


def test_a_kd_trained_timm_teacher_is_compared_with_its_runs_own_val_resize(tmp_path):
    """A timm teacher kd trained at 64 px validated at its crop_pct's resize (DeiT III: 0.9, so 71), not the
    default 0.875's 73: a run at its sizes says nothing, a run at other sizes names the run's 71."""
    from types import SimpleNamespace

    from kd.data.model_data import data_config, teacher_preprocessing_note

    name = "timm:deit3_small_patch16_224"
    own = data_config(name, "none")
    assert own.val_resize(64) == 71
    path = tmp_path / "best.pt"
    config = {"image_size": 64, "val_resize": None, "student": name, "student_data": own.to_dict()}
    torch.save({"kd_version": "0", "student": {"w": torch.zeros(1)}, "student_name": name, "config": config}, path)
    cfg = SimpleNamespace(teacher=name, teacher_weights=str(path), teacher_data=own.to_dict(), image_size=64)
    assert teacher_preprocessing_note(cfg) is None
    cfg.image_size = 32
    assert "trained and validated at image size 64, val resize 71; this run validates at 32, 35" in (
        teacher_preprocessing_note(cfg) or ""
    )


def test_teacher_weights_beside_a_store_are_not_read_for_a_model_name(tmp_path):
    """With --soft-labels the store's manifest names the teacher: --teacher-weights without --teacher is not
    opened to find one (a plain state dict there is no mistake)."""
    plain = tmp_path / "plain.pth"
    torch.save({"fc.weight": torch.zeros(3, 4)}, plain)
    options = dict(
        data="synthetic", student="resnet18", soft_labels=str(tmp_path / "store"), teacher_weights=str(plain)
    )
    assert kd_config.resolve(options=options).teacher is None
