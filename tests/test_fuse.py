"""kd.teacher.fuse: the frozen teacher's inference rewrite gives the same outputs with fewer ops."""

from __future__ import annotations

import copy
import json
import operator

import pytest
import torch
import torchvision
from conftest import TEST_RESNET_PAIR, kd_main, train_args
from torch import nn

from kd.teacher.fuse import conv_bias_add_relu, conv_bias_relu, fuse_teacher, returned_taps
from kd.utils.taps import tap


def scrambled(name: str, seed: int = 0) -> nn.Module:
    """A torchvision model in eval mode with BatchNorm statistics and affines far from the identity."""
    torch.manual_seed(seed)
    model = torchvision.models.get_model(name, num_classes=10)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    return model.eval()


def fused_calls(gm) -> dict:
    """What the graph calls: fused convolutions, and the plain ops that are left."""
    counts = {"relu": 0, "add_relu": 0, "bn": 0, "conv": 0, "plain relu/add": 0}
    for node in gm.graph.nodes:
        counts["relu"] += node.target is conv_bias_relu
        counts["add_relu"] += node.target is conv_bias_add_relu
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        counts["bn"] += isinstance(module, nn.BatchNorm2d)
        counts["conv"] += isinstance(module, nn.Conv2d)
        counts["plain relu/add"] += isinstance(module, nn.ReLU) or node.target in (
            torch.relu,
            torch.nn.functional.relu,
            operator.add,
            operator.iadd,
        )
    return counts


@pytest.mark.parametrize(
    "name, expected",
    [
        ("resnet18", (20, 9, 8, 3)),  # the 3 downsample convs have no ReLU of their own
        ("resnet50", (53, 33, 16, 4)),
        ("regnet_y_400mf", (53, 49, 16, 20)),  # squeeze-excitation convs end in a sigmoid
        ("mobilenet_v2", (52, 0, 0, 52)),  # ReLU6: folded only
    ],
)
def test_fused_model_matches_the_original(name, expected):
    model = scrambled(name)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = model(x)
        fused, note = fuse_teacher(copy.deepcopy(model))
        out = fused(x)
    folded, relus, adds, convs = expected
    assert note.startswith(f"{folded} BatchNorm layers folded, {relus} conv+ReLU and {adds} conv+add+ReLU fused")
    plain = 0 if name.startswith("resnet") else fused_calls(fused)["plain relu/add"]  # no dead ops left behind
    assert fused_calls(fused) == {"relu": relus, "add_relu": adds, "bn": 0, "conv": convs, "plain relu/add": plain}
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_tapped_layers_are_returned_and_fused_around():
    """Stage outputs tapped: the fused model returns them beside the logits, equal to what hooks see
    on the original, and the fusion is as whole as without taps (each is the value of a fused op)."""
    model = scrambled("resnet18", seed=1)
    x = torch.randn(2, 3, 64, 64)
    ref_feats = {}
    with torch.no_grad(), tap(model, ["layer2", "layer3"], ref_feats):
        ref = model(x)
    fused, note = fuse_teacher(copy.deepcopy(model), taps=["layer3", "layer2"])
    with torch.no_grad():
        out, feats = fused(x)
    assert returned_taps(fused) == returned_taps(copy.deepcopy(fused)) == ("layer3", "layer2")
    assert list(feats) == ["layer3", "layer2"] and returned_taps(model) == ()
    for name in ("layer2", "layer3"):
        torch.testing.assert_close(feats[name], ref_feats[name], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert note == fuse_teacher(copy.deepcopy(model))[1]  # 20 BatchNorms folded, 9 conv+ReLU, 8 conv+add+ReLU
    assert fused_calls(fused)["bn"] == 0


def test_a_pre_relu_tap_keeps_its_sum_from_the_in_place_relu():
    """torchvision's block applies its one in-place ReLU module to its sum: tapped, the sum is a
    value of the graph and that ReLU runs out of place; every other block stays fused."""
    model = scrambled("resnet18", seed=2)
    x = torch.randn(2, 3, 64, 64)
    key = "layer2.1.relu<2"
    ref_feats = {}
    with torch.no_grad(), tap(model, [key], ref_feats):
        ref = model(x)
    assert bool((ref_feats[key] < 0).any())  # before the ReLU
    fused, note = fuse_teacher(copy.deepcopy(model), taps=[key])
    with torch.no_grad():
        out, feats = fused(x)
    torch.testing.assert_close(feats[key], ref_feats[key], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert note.startswith("20 BatchNorm layers folded, 9 conv+ReLU and 7 conv+add+ReLU fused"), note
    assert fused_calls(fused)["plain relu/add"] == 2  # the tapped block's sum and its ReLU, out of place


def test_a_stage_output_and_its_pre_relu_sum_tapped_together():
    """Students of one run may tap a stage's output (AT) and its sum before the ReLU (OFD): the output
    is the ReLU that now runs out of place, and both come back as the original model's."""
    model = scrambled("resnet18", seed=3)
    x = torch.randn(2, 3, 64, 64)
    keys = ["layer2", "layer2.1.relu<2", "layer3"]
    ref_feats = {}
    with torch.no_grad(), tap(model, keys, ref_feats):
        ref = model(x)
    fused, note = fuse_teacher(copy.deepcopy(model), taps=keys)
    assert note.startswith("20 BatchNorm layers folded"), note
    with torch.no_grad():
        out, feats = fused(x)
    assert list(feats) == keys and bool((feats["layer2"] >= 0).all()) and bool((feats[keys[1]] < 0).any())
    for key in keys:
        torch.testing.assert_close(feats[key], ref_feats[key], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_a_tap_the_forward_never_reaches_leaves_the_model_unfused():
    model = scrambled("resnet18")
    same, note = fuse_teacher(model, taps=["layer2.1.relu<3"])
    assert same is model and note == "not fused (the forward never reached tap 'layer2.1.relu<3')"


class Shared(nn.Module):
    """A convolution whose output has two users, and one called twice: neither may be fused."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.b = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        y = self.a(x)
        z = torch.relu(y) + y  # y is used twice
        return torch.relu(self.b(torch.relu(self.b(self.bn(z)))))  # b is called twice


def test_shared_outputs_and_modules_are_left_alone():
    model = Shared().eval()
    model.bn.running_mean.uniform_(-1, 1)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        ref = model(x)
        fused, note = fuse_teacher(copy.deepcopy(model))
        out = fused(x)
    assert note.startswith("0 BatchNorm layers folded, 0 conv+ReLU and 0 conv+add+ReLU fused"), note
    torch.testing.assert_close(out, ref)


class Dynamic(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x  # data-dependent control flow: torch.fx cannot trace it


def test_untraceable_model_is_returned_unchanged():
    model = Dynamic().eval()
    same, note = fuse_teacher(model)
    assert same is model and note.startswith("not fused (torch.fx cannot trace it")


def test_training_mode_is_refused():
    with pytest.raises(ValueError, match="eval mode"):
        fuse_teacher(torchvision.models.resnet18())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cudnn_fused_convolutions_match_the_plain_ops(dtype):
    """On CUDA the fused calls are cuDNN's fused kernels: same logits as the unfused teacher
    run as kd's O1 runs it (conv weights in the dtype, channels_last)."""
    model = scrambled("resnet50").cuda().to(memory_format=torch.channels_last)
    x = torch.randn(16, 3, 128, 128, device="cuda").contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = model(x).float()  # float32 reference
        fused, note = fuse_teacher(copy.deepcopy(model))
        assert "cuDNN fused convolutions" in note
        fused = fused.to(memory_format=torch.channels_last)
        for m in fused.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                for p in m.parameters(recurse=False):
                    p.data = p.data.to(dtype)
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            out = fused(x).float()
    tol = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]  # TF32 / half rounding
    assert (out - ref).abs().max().item() <= tol * ref.abs().max().item()
    assert (out.argmax(1) == ref.argmax(1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("method", ["at", "ofd"])
def test_a_feature_method_trains_from_the_fused_teacher_as_from_the_plain_one(image_folder, tmp_path, method):
    """The run a user's GPU makes (the teacher fused and the maps channels-last by default there), on the
    CPU: at O1 the teacher's precision is chosen on copies of the fused model, which return its taps
    (stage outputs; pre-ReLU sums) as the model does, and the student trains as from the unfused teacher."""
    losses = {}
    for fused in (True, False):
        out = tmp_path / f"fused_{fused}"
        fuse = f"fuse_teacher={str(fused).lower()}"
        r = kd_main(
            *train_args(
                image_folder,
                out,
                "--set",
                fuse,
                **TEST_RESNET_PAIR,
                kd_loss=method,
                opt="O1",
                limit_train_batches=2,
                channels_last=True,
            )
        )
        assert r.returncode == 0, r.stderr
        assert ("BatchNorm layers folded" in r.stderr) is fused, r.stderr
        losses[fused] = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["train_loss"]
    assert losses[True] == pytest.approx(losses[False], rel=5e-3)  # the teacher in bfloat16, fused or not
