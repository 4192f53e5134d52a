"""Models by name, weights by name (offline, from the local cache), and each model's data config,
held equal to the libraries' own: timm's ``resolve_data_config`` and transforms, torchvision's
weight transforms."""

from __future__ import annotations

import math
import urllib.error

import pytest
import timm
import torch
import torchvision.models as tvm
from conftest import TEST_RESNET_PAIR
from timm.data import create_transform, resolve_data_config

from kd import models
from kd.data.model_data import data_config, with_data_configs
from kd.errors import KDError
from kd.utils import weights


# models whose configs differ: normalisation (0.5 for ViT), crop_pct (0.875, 0.9, 0.95), interpolation
@pytest.mark.parametrize(
    "arch", ["vit_tiny_patch16_224", "resnet50", "resnet50.tv_in1k", "deit_tiny_patch16_224", "mobilenetv3_small_100"]
)
def test_timm_data_config_is_timms_own(arch):
    name, _, tag = arch.partition(".")
    ours = data_config(f"timm:{name}", f"timm:{tag}" if tag else "none")
    theirs = resolve_data_config(model=timm.create_model(arch, pretrained=False))
    assert ours.mean == pytest.approx(theirs["mean"]) and ours.std == pytest.approx(theirs["std"])
    assert ours.interpolation == theirs["interpolation"]
    resize = create_transform(**theirs).transforms[0]  # timm's eval transform: Resize, CenterCrop, ...
    assert ours.val_resize(224) == resize.size == math.floor(224 / theirs["crop_pct"])
    assert resize.interpolation.value == ours.interpolation


@pytest.mark.parametrize("weights,resize", [("pretrained", 232), ("torchvision:IMAGENET1K_V2", 232),
                                            ("torchvision:IMAGENET1K_V1", 256)])  # fmt: skip
def test_torchvision_weights_bring_their_published_eval_transform(weights, resize):
    member = models.torchvision_weights("resnet50", weights)
    reference = member.transforms()
    ours = data_config("resnet50", weights)
    assert ours.val_resize(224) == reference.resize_size[0] == resize and reference.crop_size[0] == 224
    assert ours.mean == pytest.approx(reference.mean) and ours.std == pytest.approx(reference.std)
    assert ours.interpolation == reference.interpolation.value
    assert data_config("resnet50", "none").val_resize(224) == 256  # no weights: ImageNet's usual


def test_named_weights_load_from_torchs_cache_offline(tmp_path, monkeypatch):
    """torchvision:IMAGENET1K_V1 maps to its published file in torch's hub cache; a file placed
    there (here generated) is what the model gets, with no download."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    member = tvm.ResNet18_Weights.IMAGENET1K_V1
    torch.manual_seed(0)
    state = tvm.resnet18(num_classes=1000).state_dict()
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(state, tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth")
    assert member.url.endswith("/resnet18-f37072fd.pth")

    def no_network(*args, **kwargs):
        raise AssertionError("downloaded although the file was in the cache")

    monkeypatch.setattr(tvm.ResNet18_Weights.IMAGENET1K_V1.__class__, "get_state_dict", no_network)
    model = models.build("resnet18", 1000, "torchvision:IMAGENET1K_V1")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    with pytest.raises(KDError, match="torchvision:IMAGENET1K_V1 resnet18 has 1000 classes but the data has 10"):
        models.build("resnet18", 10, "torchvision:IMAGENET1K_V1")


def test_named_weights_offline_and_not_cached_say_which_file_to_place(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setattr(weights, "reachable", lambda host: True)  # the host answers; the download fails

    def offline(self, *args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(tvm.ResNet50_Weights.IMAGENET1K_V1.__class__, "get_state_dict", offline)
    with pytest.raises(KDError) as err:
        models.build("resnet50", 1000, "torchvision:IMAGENET1K_V1")
    message = str(err.value)
    assert "\n" not in message and message.startswith("cannot get torchvision:IMAGENET1K_V1 for resnet50 (URLError")
    assert message.endswith(
        f"offline, place resnet50-0676ba61.pth (from https://download.pytorch.org/models/resnet50-0676ba61.pth) "
        f"in {tmp_path / 'hub' / 'checkpoints'}"
    )


def test_unknown_weight_names_list_the_choices():
    with pytest.raises(
        KDError, match=r"resnet50 has no torchvision weights 'IMAGENET1K_V3'.*IMAGENET1K_V1, IMAGENET1K_V2"
    ):
        models.torchvision_weights("resnet50", "torchvision:IMAGENET1K_V3")
    with pytest.raises(KDError, match="timm:resnet50 is a timm model"):
        models.torchvision_weights("timm:resnet50", "torchvision:IMAGENET1K_V1")


def test_the_papers_mobilenet_v1_has_relu_where_timms_has_relu6():
    from kd.utils import model_names

    ours = models.build("timm:mobilenetv1_100_relu", 10)
    activations = [type(m) for m in ours.modules() if isinstance(m, (torch.nn.ReLU, torch.nn.ReLU6))]
    assert activations == [torch.nn.ReLU] * 27  # the stem and both convs of each of the 13 blocks
    theirs = timm.create_model("mobilenetv1_100", num_classes=10)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert {type(m) for m in theirs.modules() if isinstance(m, (torch.nn.ReLU, torch.nn.ReLU6))} == {torch.nn.ReLU6}
    # named before timm knows it (lists kept by an earlier kd lack it), and refused with a tag
    assert model_names.refusal("timm:mobilenetv1_100_relu", lambda library, key: []) is None
    with pytest.raises(KDError, match="no weights for mobilenetv1_100_relu"):
        models.build("timm:mobilenetv1_100_relu.ra4_e3600_r224_in1k", 10)


def test_the_teacher_line_of_pretrained_v2_weights_names_the_papers_v1():
    from types import SimpleNamespace

    from kd import config as kd_config
    from kd.run.lane import Lane

    lines = []
    for weights in ("pretrained", "torchvision:IMAGENET1K_V1"):
        cfg = kd_config.resolve(options={"data": "/d", "teacher": "resnet50", "teacher_weights": weights,
                                         "student": "resnet18"})  # fmt: skip
        logger = SimpleNamespace(info=lines.append)
        Lane.log_data_configs(SimpleNamespace(cfg=with_data_configs(cfg), logger=logger))  # type: ignore[arg-type]
    v2, v1 = [line for line in lines if line.startswith("teacher resnet50:")]
    assert v2.endswith(
        "(torchvision ResNet50_Weights.IMAGENET1K_V2); pretrained is torchvision's default IMAGENET1K_V2, "
        "not the papers' IMAGENET1K_V1: --teacher-weights torchvision:IMAGENET1K_V1"
    ), v2
    assert v1.endswith("(torchvision ResNet50_Weights.IMAGENET1K_V1)"), v1


@pytest.mark.parametrize(
    "name", ["timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k", "timm:deit_tiny_distilled_patch16_224"]
)
def test_a_vit_at_another_size_is_built_for_it_with_its_own_shapes(name):
    model = models.build(name, 4, "none", image_size=32).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 4)
    own = timm.create_model(name[len("timm:") :], num_classes=4)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in own.state_dict().items()}
    line = models.other_size_line("teacher", name, model, 32)
    assert line is not None and line.startswith(f"teacher {name} is a 224 px model: built with timm's dynamic_img_size")
    assert models.other_size_line("teacher", name, model, 224) is None
    assert models.other_size_line("student", "timm:convnext_atto", model, 32) is None  # takes any size as it is


def test_a_model_of_one_size_without_timms_option_is_built_as_timm_builds_it():
    model = models.build("timm:xcit_nano_12_p16_224", 4, "none", image_size=32)  # XCiT takes any size as it is
    assert models.other_size_line("student", "timm:xcit_nano_12_p16_224", model, 32) is None


def test_drop_path_reaches_the_students_drop_path_modules_and_never_the_teachers():
    from kd import config as kd_config
    from kd.run.build import build_models

    cfg = kd_config.resolve(options={"data": "synthetic", **TEST_RESNET_PAIR, "drop_path": 0.2})
    student, _, teacher, _, _ = build_models(cfg, 4)
    assert max(models.drop_path_rates(student)) == pytest.approx(0.2)  # timm's rule: the last block's
    assert models.drop_path_rates(teacher) == []


# built on the meta device: modules without memory or initialisation
@pytest.mark.parametrize("name,top", [("convnext_tiny", 0.3), ("efficientnet_b0", 0.3 * 15 / 16), ("swin_t", 0.3),
                                      ("maxvit_t", 0.3)])  # fmt: skip
def test_torchvision_models_get_their_stochastic_depth_prob(name, top):
    with torch.device("meta"):
        rates = models.drop_path_rates(models.construct(name, 10, drop_path=0.3))
    assert max(rates) == pytest.approx(top)
    if name == "swin_t":  # a builder that fixes it (as maxvit's): rescaled, its linear rule kept
        assert sorted(rates) == pytest.approx([0.3 * i / (len(rates) - 1) for i in range(len(rates))])


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "timm:vgg11"])
def test_a_model_without_stochastic_depth_is_refused(name):
    # mobilenet_v3_small's builder takes the argument and drops it: its modules tell
    with pytest.raises(KDError, match=f"^--drop-path: {name} has no stochastic depth; it applies to"):
        models.check_drop_path(name, 0.0)


def test_the_recipes_train_without_drop_path_or_an_average_as_before():
    from kd import config as kd_config

    for path in sorted(kd_config.RECIPE_DIR.rglob("*.yaml")):
        cfg = kd_config.resolve(recipe=str(path), options={"data": "synthetic"})
        if cfg.optimizer != "sgd":  # the ViT recipes (AdamW) set their sources' (tests/test_vit_recipes.py)
            continue
        assert cfg.drop_path is None and not cfg.model_ema, path
        with torch.device("meta"):
            assert models.drop_path_rates(models.construct(cfg.student, 1000)) == [], path
    with torch.device("meta"):  # None leaves a model's own default: torchvision's convnext_tiny has 0.1
        assert max(models.drop_path_rates(models.construct("convnext_tiny", 10))) == pytest.approx(0.1)
