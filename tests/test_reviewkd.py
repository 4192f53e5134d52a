"""ReviewKD held equal to the official code (and to mdistiller where the official code has no answer).

Golden values: dvlab-research/ReviewKD ``ImageNet/models/reviewkd.py`` (its ``ReviewKD.forward``
and ``hcl``, the loss of ``ImageNet/imagenet_amp.py``) at commit
cede6ea6387ae9b6127de0e561507177bf19c11e, and megvii-research/mdistiller
``mdistiller/distillers/ReviewKD.py`` (``forward_train``) at commit
a08d46f10d6102bd6e3f258ca5ac880b020ea259. A script outside this repository ran both unmodified
in float64 on the CPU with the deterministic fills below (features, logits and every ABF
parameter, in the official parameter order) and printed the numbers with ``repr``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from kd.errors import KDError
from kd.losses import LOSSES, DistillInputs, build_loss
from kd.losses.features import nearest
from kd.losses.reviewkd import ReviewKD, as_levels, context_mse, hcl, review
from kd.utils.taps import pre_relu_keys, tap

RTOL = 1e-9

# Scenario: batch 2, stage channels 3,4,5,6 (student) and 4,5,6,7 (teacher), the pooled
# feature with the last stage's channels, student maps 8,4,2,1, mid channels 6, weight 8.
STUDENT_C, TEACHER_C, STUDENT_HW = (3, 4, 5, 6), (4, 5, 6, 7), (8, 4, 2, 1)
STUDENT_MAPS = list(zip(STUDENT_C, STUDENT_HW))
BATCH, CLASSES, MID, WEIGHT = 2, 5, 6, 8.0
LABELS = torch.tensor([1, 3])

# The official code with the teacher's maps as large as the student's.
OFFICIAL = {
    "level_probes": [
        14.396960037897491,
        -2.9271711098273676,
        2.400590204559688,
        1.8432799185638404,
        0.28901371099437756,
    ],
    "hcl": 5.142658635512573,
    "total": 42.650262271782566,  # cross-entropy + WEIGHT * hcl
    "grad_sums": {
        "0.conv1.0.weight": -0.07654521999411207,
        "2.att_conv.0.weight": -0.6177779591275051,
        "3.att_conv.0.bias": 0.15740455854071905,
        "4.conv2.1.weight": 1.5644502286503643,
    },
}
# mdistiller with teacher maps 6,4,3,2 against the student's 8,4,2,1; WARMUP_EPOCHS 4 at epoch 2.
MDISTILLER_TEACHER_HW = (6, 4, 3, 2)
MDISTILLER = {
    "level_probes": [
        -9.50994499609899,
        -6.096190504716045,
        4.594591260659564,
        0.003511361401438151,
        0.28901371099437756,
    ],
    "hcl": 5.240412495932369,
    "loss_kd": 20.961649983729476,  # WEIGHT * min(2 / 4, 1) * hcl
    "total": 22.470643171411457,
    "grad_sums": {
        "0.conv1.0.weight": -0.05109384454938361,
        "2.att_conv.0.weight": -0.20989011054858325,
        "4.conv2.1.weight": 0.9363985702685456,
    },
}

# kd's ABF submodules under the official (and mdistiller's) names; the chain's index is the same.
OFFICIAL_NAMES = {
    "conv1.0": "reduce.conv",
    "conv1.1": "reduce.bn",
    "conv2.0": "expand.conv",
    "conv2.1": "expand.bn",
    "att_conv.0": "attention",
}


def official_parameter_order():
    """The official chain's parameter names in order: abfs[0] is the pooled level and does not fuse."""
    names = []
    for k in range(5):
        names += [f"{k}.conv1.0.weight", f"{k}.conv1.1.weight", f"{k}.conv1.1.bias"]
        names += [f"{k}.conv2.0.weight", f"{k}.conv2.1.weight", f"{k}.conv2.1.bias"]
        if k > 0:
            names += [f"{k}.att_conv.0.weight", f"{k}.att_conv.0.bias"]
    return names


def kd_name(official: str) -> str:
    index, rest = official.split(".", 1)
    module, kind = rest.rsplit(".", 1)
    return f"abfs.{index}.{OFFICIAL_NAMES[module]}.{kind}"


def fill(shape, seed, scale=1.0):
    n = math.prod(shape)
    return torch.sin(torch.arange(n, dtype=torch.float64) * 0.37 + seed).reshape(shape) * scale


def scenario(teacher_hw, **args):
    """The loss built, set up and filled as the golden script filled the official one, and its inputs."""
    student = {
        f"layer{i + 1}": fill((BATCH, c, hw, hw), 1 + i, 2.0) for i, (c, hw) in enumerate(zip(STUDENT_C, STUDENT_HW))
    }
    student["pooled"] = fill((BATCH, STUDENT_C[-1]), 5, 2.0)
    teacher = {
        f"layer{i + 1}": fill((BATCH, c, hw, hw), 11 + i, 1.5) for i, (c, hw) in enumerate(zip(TEACHER_C, teacher_hw))
    }
    teacher["pooled"] = fill((BATCH, TEACHER_C[-1]), 15, 1.5)
    loss = build_loss("reviewkd", CLASSES, {"mid_channels": MID, "reviewkd_weight": WEIGHT, **args})
    loss.setup_features({k: v.shape for k, v in student.items()}, {k: v.shape for k, v in teacher.items()})
    loss.double().train()
    params = dict(loss.named_parameters())
    assert list(params) == [kd_name(n) for n in official_parameter_order()]
    with torch.no_grad():
        for i, name in enumerate(official_parameter_order()):
            params[kd_name(name)].copy_(fill(params[kd_name(name)].shape, 100 + i, 0.4))
    logits = fill((BATCH, CLASSES), 21)
    return loss, DistillInputs(logits, LABELS, None, student, teacher, progress=0.0)


def check(loss, x, golden):
    outputs = review(loss.abfs, as_levels(x.student_feats), [t.shape[-2:] for t in as_levels(x.teacher_feats)])
    probes = [(o * fill(o.shape, 50 + i)).sum().item() for i, o in enumerate(outputs)]
    assert probes == pytest.approx(golden["level_probes"], rel=RTOL)
    assert hcl(outputs, as_levels(x.teacher_feats)).item() == pytest.approx(golden["hcl"], rel=RTOL)
    out = loss(x)
    assert out["reviewkd"].item() == pytest.approx(golden["hcl"], rel=RTOL)
    # kd's label term is float32 at every precision: the distillation part is held to float64's
    # digits, the cross-entropy to float32's
    ce = F.cross_entropy(x.student_logits, x.labels).item()
    assert (out["loss"] - out["ce"]).item() == pytest.approx(golden["total"] - ce, rel=RTOL)
    assert out["ce"].item() == pytest.approx(ce, rel=1e-6)
    out["loss"].backward()
    params = dict(loss.named_parameters())
    grads = {name: params[kd_name(name)].grad.sum().item() for name in golden["grad_sums"]}
    assert grads == pytest.approx(golden["grad_sums"], rel=RTOL)
    return out


def test_equal_to_the_official_code():
    loss, x = scenario(STUDENT_HW)
    check(loss, x, OFFICIAL)


def test_teacher_maps_of_another_size_as_mdistiller():
    loss, x = scenario(MDISTILLER_TEACHER_HW, warmup=4.0)
    x.progress = 1.5  # the second epoch
    out = check(loss, x, MDISTILLER)
    assert (out["loss"] - out["ce"]).item() == pytest.approx(MDISTILLER["loss_kd"], rel=RTOL)


def test_hcl_of_identical_maps_is_zero():
    maps = [fill((2, 3, hw, hw), hw) for hw in (7, 4, 2, 1)]
    assert hcl(maps, [m.clone() for m in maps]).item() == 0.0


def test_hcl_weights_the_pooled_context_by_halves():
    fs, ft = fill((2, 3, 4, 4), 1), fill((2, 3, 4, 4), 2)
    pooled = [F.mse_loss(F.adaptive_avg_pool2d(fs, s), F.adaptive_avg_pool2d(ft, s)) for s in (2, 1)]
    expected = (F.mse_loss(fs, ft) + pooled[0] / 2 + pooled[1] / 4) / 1.75  # 4x4 is not smaller than 4
    assert context_mse(fs, ft).item() == pytest.approx(expected.item(), rel=RTOL)


def test_the_pooled_level():
    loss, x = scenario(STUDENT_HW)
    pooled_abf = loss.abfs[0]
    assert pooled_abf.attention is None and all(abf.attention is not None for abf in loss.abfs[1:])
    assert (pooled_abf.reduce.conv.in_channels, pooled_abf.expand.conv.out_channels) == (STUDENT_C[-1], TEACHER_C[-1])
    levels = as_levels(x.student_feats)
    assert levels[-1].shape == (BATCH, STUDENT_C[-1], 1, 1) and torch.equal(
        levels[-1].flatten(1), x.student_feats["pooled"]
    )
    out, _ = pooled_abf(levels[-1], None, (1, 1))
    assert context_mse(out, as_levels(x.teacher_feats)[-1]).item() == pytest.approx(
        F.mse_loss(out.flatten(1), x.teacher_feats["pooled"]).item(), rel=RTOL
    )


def test_the_engine_is_asked_for_pre_relu_stages_and_the_pooled_feature():
    card = LOSSES.card("reviewkd")
    assert card.uses_features and card.uses_pooled and card.tap_point == "pre_relu"
    names = ["conv1", "layer1", "layer2", "layer3", "layer4", "fc"]
    assert ReviewKD.default_layers(names, names) == ["layer1", "layer2", "layer3", "layer4"]
    loss = build_loss("reviewkd", 10, {"teacher_tap": "output"})
    assert (loss.side_tap_point("student"), loss.side_tap_point("teacher")) == ("pre_relu", "output")
    with pytest.raises(KDError, match="student_tap must be one of pre_relu, output, got 'post'"):
        build_loss("reviewkd", 10, {"student_tap": "post"})


# The official ImageNet models (dvlab-research/ReviewKD@cede6ea ImageNet/models/resnet.py and
# mobilenet.py, forward(x, is_feat=True)), run outside this repository in float64 with the state
# dict of the kd model built here (torch.manual_seed(0)) and the input below: the sum of each stage
# feature. The ResNet's in-place ReLU overwrites its stored stage sums (each stage's minimum 0.0);
# the MobileNet's extract_feature(preReLU=True) keeps them before the ReLU.
OFFICIAL_RESNET18_STAGE_SUMS = [6017.659506437427, 3346.267581653367, 1391.0619245549274, 325.24717207184915]
OFFICIAL_MOBILENET_STAGE_SUMS = [7270.279195645158, -2458.5655062487876, 139.28204280655152, 63.55829941208265]
OFFICIAL_MOBILENET_POOLED_SUM = 13.626773794845624


def tapped(loss, student_name, teacher_name, size):
    """(the student seeded as in the golden run; its tap keys from the engine)."""
    from types import SimpleNamespace

    from kd import models
    from kd.run.build import setup_feature_layers

    torch.manual_seed(0)
    student = models.build(student_name, CLASSES_OFFICIAL[student_name]).eval()
    teacher = models.build(teacher_name, CLASSES_OFFICIAL[student_name]).eval()
    cfg = SimpleNamespace(feature_layers=None, student=student_name, teacher=teacher_name, image_size=size)
    keys, _ = setup_feature_layers(loss, student, teacher, cfg)
    return student, keys


CLASSES_OFFICIAL = {"resnet18": 10, "timm:mobilenetv1_100_relu": 1000}  # as the golden run built them


def forward_taps(model, keys, size):
    """The tapped tensors of one forward of the golden run's float64 input."""
    batch = 1 if size == 224 else 2
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    feats = {}
    with torch.no_grad(), tap(model, keys, feats):
        model(x)
    return feats


def test_output_taps_are_the_official_resnets_post_relu_stages():
    loss = build_loss("reviewkd", 10, {"student_tap": "output", "teacher_tap": "output"})
    student, keys = tapped(loss, "resnet18", "timm:test_resnet", 32)
    assert keys == ["layer1", "layer2", "layer3", "layer4", "fc<1"]
    probe = torch.randn(2, 3, 32, 32)
    pre_keys = [key for key, _ in pre_relu_keys(student, keys[:-1], probe, "reviewkd", "student")]
    feats = forward_taps(student.double(), keys, 32)
    before = forward_taps(student, pre_keys, 32)
    for key, pre_key, expected in zip(keys, pre_keys, OFFICIAL_RESNET18_STAGE_SUMS):
        assert feats[key].sum().item() == pytest.approx(expected, rel=RTOL)
        assert feats[key].min().item() == 0.0 and torch.equal(feats[key], torch.relu(before[pre_key]))
        assert before[pre_key].min().item() < 0.0


def test_the_mobilenet_students_pre_relu_taps_are_the_official_mobilenets():
    loss = build_loss("reviewkd", 1000, {"student_tap": "pre_relu", "teacher_tap": "output"})
    student, keys = tapped(loss, "timm:mobilenetv1_100_relu", "timm:test_resnet", 32)
    assert keys[-1] == "classifier<1" and all(key.endswith(".bn2.act<1") for key in keys[:-1])
    feats = forward_taps(student.double(), keys, 224)
    for key, expected in zip(keys, OFFICIAL_MOBILENET_STAGE_SUMS):
        assert feats[key].sum().item() == pytest.approx(expected, rel=RTOL)
    assert feats[keys[-1]].sum().item() == pytest.approx(OFFICIAL_MOBILENET_POOLED_SUM, rel=RTOL)


@pytest.mark.parametrize(
    "student, teacher, match",
    [
        ({"blocks.3": (2, 197, 8), "pooled": (2, 8)}, {"layer3": (2, 8, 4, 4), "pooled": (2, 8)}, "feature maps"),
        ({"layer3": (2, 8, 4, 4)}, {"layer3": (2, 8, 4, 4)}, "pooled"),
        ({"layer3": (2, 8, 4, 4), "pooled": (2, 8, 1, 1)}, {"layer3": (2, 8, 4, 4), "pooled": (2, 8)}, r"\(N, C\)"),
        ({"layer3": (2, 8, 4, 4), "pooled": (2, 8)}, {"pooled": (2, 8)}, "same non-zero number"),
    ],
)
def test_features_it_cannot_use_are_refused(student, teacher, match):
    loss = build_loss("reviewkd", 10, {})
    with pytest.raises(KDError, match=match):
        loss.setup_features(
            {k: torch.Size(v) for k, v in student.items()}, {k: torch.Size(v) for k, v in teacher.items()}
        )


@pytest.mark.parametrize("mid", [0, 2.5, True, "wide"])
def test_mid_channels_is_a_positive_whole_number(mid):
    with pytest.raises(KDError, match="mid_channels"):
        build_loss("reviewkd", 10, {"mid_channels": mid})


def test_reduced_precision_features_give_a_float32_loss():
    loss, x = scenario(STUDENT_HW)
    loss.float()
    x.student_feats = {k: v.half().requires_grad_() for k, v in x.student_feats.items()}
    x.teacher_feats = {k: v.half() for k, v in x.teacher_feats.items()}
    x.student_logits = x.student_logits.half()
    out = loss(x)
    assert out["loss"].dtype == out["reviewkd"].dtype == torch.float32 and torch.isfinite(out["loss"])
    out["loss"].backward()
    assert all(torch.isfinite(f.grad).all() for f in x.student_feats.values())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = loss(x)
    assert out["loss"].dtype == torch.float32 and torch.isfinite(out["loss"])


class Float32Outputs(TorchDispatchMode):
    """The ops that make a float32 tensor, while it is active."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            self.ops.append(func.__name__)
        return out


def test_under_autocast_the_chain_runs_in_the_reduced_dtype():
    """The ABF chain's maps (hundreds of channels at the stages' sizes) under autocast: no float32 copy
    of a student map before its convolution (autocast casts it back: two passes for the same values),
    and the nearest resizes in the maps' dtype, exact in any (autocast runs them in float32 on CUDA)."""
    loss, x = scenario(STUDENT_HW)
    loss.float()
    levels = [f.to(torch.bfloat16) for f in as_levels(x.student_feats)]
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad(), Float32Outputs() as seen:
        outputs = review(loss.abfs, levels, [t.shape[-2:] for t in as_levels(x.teacher_feats)])
    assert all(o.dtype == torch.bfloat16 for o in outputs)
    assert [op for op in seen.ops if op not in ("t.default", "view.default")] == [], seen.ops
    if torch.cuda.is_available():
        with torch.autocast("cuda", dtype=torch.float16):
            small = torch.randn(2, 3, 4, 4, device="cuda", dtype=torch.float16)
            assert nearest(small, (8, 8)).dtype == torch.float16
            assert torch.equal(nearest(small, (8, 8)), F.interpolate(small.float(), size=(8, 8)).half())


# warmup 1 is mdistiller's ImageNet value: the epoch counts from 1, so no ramp at all
RAMPS = [(0.0, 0.0, 1.0), (3.0, 0.0, 1 / 3), (3.0, 0.99, 1 / 3), (3.0, 1.0, 2 / 3), (3.0, 2.5, 1.0), (1.0, 0.0, 1.0)]


@pytest.mark.parametrize("warmup, progress, factor", RAMPS)
def test_warmup_ramps_the_distillation_term_per_epoch(warmup, progress, factor):
    loss, x = scenario(STUDENT_HW, warmup=warmup, ce_weight=0.0)
    x.progress = progress
    out = loss(x)
    assert out["loss"].item() == pytest.approx(factor * WEIGHT * out["reviewkd"].item(), rel=RTOL)
