"""Feature taps (kd.utils.taps): module outputs, pre-ReLU stage outputs and the pooled feature, on
every model family the feature methods support, held against the models' own arithmetic."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from torch import nn
from torchvision import models as tv

from kd.errors import KDError
from kd.utils.taps import pooled_key, pre_relu_keys, tap

PROBE = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))


def randomised(model: nn.Module) -> nn.Module:
    """``model`` in eval mode with random BatchNorm affine parameters and statistics (timm zero-inits
    the last BatchNorm of a block, which would make its residual sum non-negative)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(torch.randn(m.bias.shape, generator=g))
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
    return model.eval()


def tapped(model, keys):
    store = {}
    with torch.no_grad(), tap(model, keys, store):
        model(PROBE)
    return store


def block_sum_torchvision(block, x):
    """The pre-ReLU residual sum of a torchvision BasicBlock or Bottleneck, written out."""
    out = block.relu(block.bn1(block.conv1(x)))
    if hasattr(block, "conv3"):
        out = block.relu(block.bn2(block.conv2(out)))
        out = block.bn3(block.conv3(out))
    else:
        out = block.bn2(block.conv2(out))
    return out + (block.downsample(x) if block.downsample is not None else x)


@pytest.mark.parametrize("name,stage,key,norm", [
    ("resnet18", "layer1", "layer1.1.relu<2", "layer1.1.bn2"),
    ("resnet18", "layer4", "layer4.1.relu<2", "layer4.1.bn2"),
    ("resnet50", "layer2", "layer2.3.relu<3", "layer2.3.bn3"),
])  # fmt: skip
def test_torchvision_resnet_stage_before_its_relu_is_the_residual_sum(name, stage, key, norm):
    """torchvision's blocks apply one ReLU module twice (three times in a Bottleneck): a hook on a
    module's output is post-ReLU; the tap is the input of the last call, the sum itself."""
    model = randomised(tv.get_model(name, num_classes=10))
    assert pre_relu_keys(model, [stage], PROBE, "ofd", "student") == [(key, norm)]
    inputs = {}
    last = dict(model.named_modules())[stage][-1]
    last.register_forward_pre_hook(lambda m, i: inputs.__setitem__("x", i[0]))
    feats = tapped(model, [key, stage])
    with torch.no_grad():
        expected = block_sum_torchvision(last, inputs["x"])
    torch.testing.assert_close(feats[key], expected)
    assert (feats[key] < 0).any() and torch.equal(torch.relu(feats[key]), feats[stage])


@pytest.mark.parametrize("name,stage,key,norm", [
    ("resnet18", "layer2", "layer2.1.act2<1", "layer2.1.bn2"),
    ("resnet50", "layer3", "layer3.5.act3<1", "layer3.5.bn3"),
    ("mobilenetv1_100", "blocks.4", "blocks.4.1.bn2.act<1", "blocks.4.1.bn2"),
])  # fmt: skip
def test_timm_stage_before_its_relu(name, stage, key, norm):
    model = randomised(timm.create_model(name, num_classes=10))
    assert pre_relu_keys(model, [stage], PROBE, "reviewkd", "teacher") == [(key, norm)]
    feats = tapped(model, [key, stage])
    act = dict(model.named_modules())[key.split("<")[0]]  # a ReLU6 in timm's MobileNetV1
    assert (feats[key] < 0).any() and torch.equal(act(feats[key].clone()), feats[stage])
    if name == "mobilenetv1_100":  # BatchNormAct2d: the BatchNorm's own output, before its ReLU
        bn = dict(model.named_modules())[norm]
        inputs = {}
        bn.register_forward_pre_hook(lambda m, i: inputs.__setitem__("x", i[0]))
        tapped(model, [])
        with torch.no_grad():
            expected = nn.functional.batch_norm(
                inputs["x"], bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps
            )
        torch.testing.assert_close(tapped(model, [key])[key], expected)


def test_every_stage_from_one_forward_equals_each_alone():
    model = randomised(tv.resnet50(num_classes=10))
    stages = ["layer1", "layer2", "layer3", "layer4"]
    together = pre_relu_keys(model, stages, PROBE, "ofd", "teacher")
    assert together == [pre_relu_keys(model, [stage], PROBE, "ofd", "teacher")[0] for stage in stages]
    assert together[0] == ("layer1.2.relu<3", "layer1.2.bn3")  # each stage's BatchNorm its own


def test_a_stage_without_a_final_activation_is_its_own_output():
    """MobileNetV2's linear bottlenecks end without a ReLU: their output is pre-activation already."""
    model = randomised(tv.mobilenet_v2(num_classes=10))
    assert pre_relu_keys(model, ["features.13"], PROBE, "ofd", "student") == [("features.13", None)]


def test_a_functional_relu_kd_cannot_see_is_refused():
    class Hidden(nn.Module):
        def __init__(self):
            super().__init__()
            self.stage = nn.Conv2d(3, 4, 3)
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(torch.relu(self.stage(x)).mean((2, 3)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return torch.relu(self.conv(x))

    model = Hidden()
    model.stage = Block()
    with pytest.raises(KDError, match="KD loss 'ofd' distils pre-ReLU features, but student's 'stage'"):
        pre_relu_keys(model, ["stage"], PROBE, "ofd", "student")


@pytest.mark.parametrize("build,head", [
    (lambda: tv.resnet18(num_classes=10), "fc<1"),
    (lambda: tv.mobilenet_v2(num_classes=10), "classifier<1"),
    (lambda: timm.create_model("resnet18", num_classes=10), "fc<1"),
    (lambda: timm.create_model("mobilenetv1_100", num_classes=10), "classifier<1"),
])  # fmt: skip
def test_the_pooled_feature_is_the_classifier_input(build, head):
    model = randomised(build())
    assert pooled_key(model, "crd", "student") == head
    feats = tapped(model, [head])
    module = dict(model.named_modules())[head[:-2]]
    with torch.no_grad():
        torch.testing.assert_close(module(feats[head]), model(PROBE))
    assert feats[head].dim() == 2


def test_a_model_without_a_known_classifier_is_refused():
    with pytest.raises(KDError, match="KD loss 'crd' needs the pooled feature, but student x has no classifier"):
        pooled_key(nn.Sequential(nn.Conv2d(3, 4, 3)), "crd", "student x")


def test_a_pre_relu_tap_survives_the_teachers_fusion():
    from kd.teacher.fuse import fuse_teacher

    model = randomised(tv.resnet18(num_classes=10))
    [(key, _)] = pre_relu_keys(model, ["layer2"], PROBE, "ofd", "teacher")
    fused, _ = fuse_teacher(copy.deepcopy(model), taps=[key])
    with torch.no_grad():
        _, feats = fused(PROBE)
    torch.testing.assert_close(feats[key], tapped(model, [key])[key], rtol=1e-4, atol=1e-3)
