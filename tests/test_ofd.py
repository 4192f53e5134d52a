"""OFD (kd.losses.ofd) held equal to the official code, plus its margins, partial L2 and refusals."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CUDA, Float32Copies

from kd.errors import KDError
from kd.losses import DistillInputs, build_loss
from kd.losses.ofd import partial_l2, relu_margins, stage_distance

# Golden values from the official code, clovaai/overhaul-distillation@76344a84a7ce23c894f41a2e05b866c9b73fd85a,
# ImageNet/distiller.py (unmodified: Distiller, get_margin_from_BN, distillation_loss) with the
# ImageNet step's `loss_distill.sum() / batch_size / 10000` (ImageNet/train_with_distillation.py):
# a script outside this repository built its Distiller on two stand-in networks returning the fixed
# features below and the teacher BatchNorms below, loaded the fixed connector parameters, ran it in
# float64 with the connectors in train mode, and printed these numbers with repr.
BATCH = 3
STUDENT_CHANNELS = (4, 6, 3)
TEACHER_CHANNELS = (5, 3, 7)
SIZES = ((4, 4), (3, 3), (2, 2))

MARGINS = [
    [-0.7635716199874878, -1.5714762210845947, -2.168236494064331, -2.4727959632873535, -2.4529807567596436],
    [-2.4156992435455322, -2.4926300048828125, -2.252250909805298],
    [
        -1.9182188510894775,
        -1.2788337469100952,
        -0.5868293642997742,
        -0.09866855293512344,
        -0.21858081221580505,
        -1.2857518196105957,
        -2.1789023876190186,
    ],
]
STAGE_SUMS = [805.4143281236254, 352.1949799819818, 298.2646675787089]
LOSS_DISTILL = 675.7157396006062  # sum over stages of STAGE_SUMS[i] / 2 ** (2 - i)
TOTAL = 0.022523857986686872  # LOSS_DISTILL / BATCH / 10000
# per stage: |out|.sum(), (out * fill(out.shape, 70 + i, 1)).sum(), (out ** 2).sum() of the connector outputs
CONNECTOR_SUMS = [
    (181.78047909862136, 7.173749415815255, 173.6211184219506),
    (68.78891354456107, 4.562985458183479, 80.46519940032228),
    (93.10892785962677, -4.287882758247733, 127.6503684812281),
]
# gradient g of TOTAL w.r.t. the conv weight of connectors 0 and 2:
# g.sum(), |g|.sum(), (g * fill(g.shape, 80 + i, 1)).sum()
CONV_GRAD_SUMS = [
    (0.014098807135808966, 0.016206794530565418, -0.00015663457496759188),
    (-0.0003523887280365767, 0.017442220288221445, -9.262829554929715e-05),
]
STUDENT_GRAD_ABS_SUM = 0.032632742678695835  # |d TOTAL / d student feature of stage 1|.sum()

RTOL = 1e-9


def fill(shape, seed, scale):
    """A deterministic tensor: sin(0.37 k + seed) * scale over the flat index k, float64."""
    return torch.sin(torch.arange(math.prod(shape), dtype=torch.float64) * 0.37 + seed).reshape(shape) * scale


def close(value, expected, rtol=RTOL):
    value = value.item() if torch.is_tensor(value) else value
    return math.isclose(value, expected, rel_tol=rtol, abs_tol=0.0)


def names(i):
    return f"s{i}", f"t{i}"


def teacher_norm(i):
    c = TEACHER_CHANNELS[i]
    return fill((c,), 50 + i, 1.0).float(), fill((c,), 60 + i, 2.5).float()


def golden_setup():
    """kd's ofd with the golden scenario's connectors and margins, in float64, and its inputs."""
    loss = build_loss("ofd", 2, {})
    student = {names(i)[0]: fill((BATCH, STUDENT_CHANNELS[i], *SIZES[i]), 1 + i, 1.5) for i in range(3)}
    teacher = {names(i)[1]: fill((BATCH, TEACHER_CHANNELS[i], *SIZES[i]), 10 + i, 2.5) for i in range(3)}
    loss.setup_features({k: v.shape for k, v in student.items()}, {k: v.shape for k, v in teacher.items()})
    loss.setup_teacher({names(i)[1]: teacher_norm(i) for i in range(3)})
    loss.double().train()
    with torch.no_grad():
        for i, connector in enumerate(loss.connectors):
            s, t = STUDENT_CHANNELS[i], TEACHER_CHANNELS[i]
            connector.conv.weight.copy_(fill((t, s, 1, 1), 20 + i, 0.5))
            connector.bn.weight.copy_(1 + fill((t,), 30 + i, 0.3))
            connector.bn.bias.copy_(fill((t,), 40 + i, 0.2))
    for feat in student.values():
        feat.requires_grad_()
    x = DistillInputs(torch.zeros(BATCH, 2, dtype=torch.float64), torch.zeros(BATCH, dtype=torch.long))
    x.student_feats, x.teacher_feats = student, teacher
    return loss, x


def test_margins_equal_the_official_ones():
    loss, _ = golden_setup()
    expected = [v for stage in MARGINS for v in stage]
    assert loss.margins is not None and len(loss.margins) == len(expected)
    assert all(close(m, e) for m, e in zip(loss.margins.tolist(), expected))
    # the float32 rounding of the official FloatTensor
    assert relu_margins(*teacher_norm(0)).dtype == torch.float32
    assert relu_margins(*teacher_norm(0)).tolist() == MARGINS[0]


def test_loss_connectors_and_gradients_equal_the_official_imagenet_code():
    loss, x = golden_setup()
    part, terms = loss.distill(x)
    assert part.dtype == torch.float64
    assert close(part, TOTAL)
    assert close(terms["ofd"], LOSS_DISTILL / BATCH)
    margins = loss.margins.split(TEACHER_CHANNELS)
    for i, connector in enumerate(loss.connectors):
        s, t = names(i)
        out = connector(x.student_feats[s]).detach()
        sums = (out.abs().sum(), (out * fill(out.shape, 70 + i, 1.0)).sum(), out.pow(2).sum())
        assert all(close(v, e) for v, e in zip(sums, CONNECTOR_SUMS[i])), i
        assert close(partial_l2(out, x.teacher_feats[t], margins[i]), STAGE_SUMS[i]), i
    part.backward()
    for i, expected in zip((0, 2), CONV_GRAD_SUMS):
        g = loss.connectors[i].conv.weight.grad
        sums = (g.sum(), g.abs().sum(), (g * fill(g.shape, 80 + i, 1.0)).sum())
        assert all(close(v, e) for v, e in zip(sums, expected)), i
    assert close(x.student_feats["s1"].grad.abs().sum(), STUDENT_GRAD_ABS_SUM)
    assert all(f.grad is None for f in x.teacher_feats.values())


def test_default_weight_is_the_official_imagenet_division():
    loss, x = golden_setup()
    out = loss(x)
    assert loss.hparams["ofd_weight"] == 1e-4 and loss.hparams["ce_weight"] == 1.0
    assert close(out["loss"] - out["ce"], TOTAL, rtol=1e-12)


def test_tiny_negative_probability_gives_minus_three_std():
    # P(x < 0) for N(bias, weight^2): cdf(-4) = 3e-5, cdf(-3.5) = 2e-4, both at most 0.001
    weight, bias = torch.tensor([0.5, -0.5, 2.0]), torch.tensor([2.0, 2.0, 7.0])
    assert relu_margins(weight, bias).tolist() == (-3 * weight.abs()).tolist()
    # just above 0.001 (cdf(-3) = 0.00135): the expectation E[x | x < 0] = bias - std * pdf(z) / cdf(z)
    z = -3.0
    cdf = 0.5 * math.erfc(-z / math.sqrt(2))
    expected = 3.0 - math.exp(-z * z / 2) / math.sqrt(2 * math.pi) / cdf
    assert math.isclose(relu_margins(torch.tensor([1.0]), torch.tensor([3.0])).item(), expected, rel_tol=1e-7)
    # a centred BatchNorm: E[x | x < 0] = -std * sqrt(2 / pi)
    centred = relu_margins(torch.tensor([2.0]), torch.tensor([0.0])).item()
    assert math.isclose(centred, -2 * math.sqrt(2 / math.pi), rel_tol=1e-7)


def test_zero_batchnorm_weight_gives_the_limit():
    margins = relu_margins(torch.zeros(3), torch.tensor([-0.5, 0.0, 0.5]))
    assert margins.tolist() == [-0.5, 0.0, 0.0]


def test_partial_l2_skips_only_a_student_below_a_non_positive_target():
    margin = torch.tensor([-1.0])
    # (teacher, student, counted square): t' = max(t, -1); skipped where s <= t' <= 0
    cases = [
        (2.0, 2.0, 0.0),  # equal
        (2.0, 1.0, 1.0),  # a positive target: below it counts
        (-0.5, -0.7, 0.0),  # below a negative target: skipped
        (-0.5, -0.3, 0.04),  # above it: counts
        (-3.0, -2.0, 0.0),  # below the margin: skipped
        (-3.0, -3.0, 0.0),  # equal to the teacher below the margin: skipped
        (-3.0, 0.5, 2.25),  # above the margin: counts against the margin, not the teacher
        (0.0, -1.0, 0.0),  # below a zero target: skipped
        (0.0, 0.5, 0.25),
    ]
    for t, s, expected in cases:
        value = partial_l2(torch.tensor([[[[s]]]]), torch.tensor([[[[t]]]]), margin)
        assert math.isclose(value.item(), expected, rel_tol=1e-6, abs_tol=1e-12), (t, s)
    teacher = fill((2, 1, 3, 3), 5, 3.0)
    assert partial_l2(teacher, teacher, margin).item() == 0.0
    assert partial_l2(teacher + 0.1, teacher, margin).item() > 0.0


def test_refuses_non_4d_maps_and_unequal_layer_counts():
    loss = build_loss("ofd", 10, {})
    with pytest.raises(KDError, match="feature maps"):
        loss.setup_features({"blocks.3": torch.Size((2, 197, 192))}, {"blocks.3": torch.Size((2, 197, 384))})
    with pytest.raises(KDError, match="same non-zero number"):
        loss.setup_features({"a": torch.Size((2, 3, 4, 4))}, {})


def small(dtype=torch.float32):
    loss = build_loss("ofd", 4, {})
    loss.setup_features({"a": torch.Size((2, 3, 4, 4))}, {"b": torch.Size((2, 5, 2, 2))})
    loss.setup_teacher({"b": (torch.linspace(-1, 1, 5), torch.linspace(-2, 3, 5))})
    g = torch.Generator().manual_seed(0)
    x = DistillInputs(
        torch.randn(2, 4, generator=g).to(dtype),
        torch.tensor([1, 3]),
        torch.randn(2, 4, generator=g),
        {"a": torch.randn(2, 3, 4, 4, generator=g).to(dtype)},
        {"b": torch.randn(2, 5, 2, 2, generator=g).to(dtype)},
    )
    return loss, x


def test_teacher_norms_are_checked_and_required():
    loss, x = small()
    with pytest.raises(KDError, match="teacher's BatchNorm of the layers b"):
        loss.setup_teacher({"a": (torch.ones(5), torch.zeros(5))})
    with pytest.raises(KDError, match="7,"):
        loss.setup_teacher({"b": (torch.ones(7), torch.zeros(7))})
    loss.margins = None
    with pytest.raises(KDError, match="needs the teacher's BatchNorm"):
        loss(x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_features_give_a_finite_float32_loss(dtype):
    loss, x = small(dtype)
    out = loss(x)
    assert out["loss"].dtype == torch.float32 and out["ofd"].dtype == torch.float32
    assert torch.isfinite(out["loss"]) and out["ofd"] > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = loss(x)
    assert out["ofd"].dtype == torch.float32 and torch.isfinite(out["loss"])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_reduced_dtype_stage_backward_makes_no_float32_copy(dtype, layout, device):
    """A float16/bfloat16 stage of one size, in either memory layout (--channels-last): the loss is the
    float32 expression's (within float32 rounding), the student's gradient its bits in the map's layout,
    and the backward makes no float32 tensor of the map's size (on the GPU too: ``pytest -m gpu``)."""
    g = torch.Generator().manual_seed(40)
    student = (2 * torch.randn(3, 5, 4, 6, generator=g)).to(device, dtype).to(memory_format=layout)
    student.requires_grad_()
    teacher = (2 * torch.randn(3, 5, 4, 6, generator=g)).to(device, dtype).to(memory_format=layout)
    margin = -torch.rand(5, generator=g).to(device) - 0.1
    got = 0.37 * stage_distance(student, teacher, margin)
    with Float32Copies(student.numel()) as seen:
        got.backward()
    assert seen.ops == []
    ref = student.detach().clone().requires_grad_()
    want = 0.37 * partial_l2(ref.float(), teacher.float(), margin)
    want.backward()
    assert got.dtype == torch.float32 and close(got.item(), want.item(), rtol=1e-6)
    assert torch.equal(student.grad, ref.grad) and student.grad.is_contiguous(memory_format=layout)


@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), float("inf")])
def test_a_non_finite_student_map_gives_a_non_finite_loss(bad):
    """A float16 map that overflowed, even where the partial L2 leaves a position out (s <= t' <= 0): the
    loss is not finite, as the official code's ``mse * mask`` makes it (0 * inf), so kd skips the step."""
    student = torch.full((2, 3, 2, 2), -1.0, dtype=torch.float16)
    teacher = torch.full((2, 3, 2, 2), -0.5, dtype=torch.float16)  # t' <= 0 and s <= t': left out
    student[0, 0, 0, 0] = bad
    assert not torch.isfinite(stage_distance(student.requires_grad_(), teacher, -torch.ones(3)))


def test_unequal_sizes_pool_the_larger_map_after_the_connector():
    loss, x = small()
    connector = loss.connectors[0]
    expected = partial_l2(
        torch.nn.functional.avg_pool2d(connector(x.student_feats["a"]), 2), x.teacher_feats["b"], loss.margins
    )
    assert close(loss(x)["ofd"], expected.item() / 2, rtol=1e-6)


def test_declarations_buffers_and_initialisation():
    cls = type(build_loss("ofd", 10, {}))
    assert cls.card.uses_features and cls.card.tap_point == "pre_relu"
    stages = ["layer1", "layer2", "layer3", "layer4"]
    assert cls.default_layers(stages, stages) == stages
    loss = build_loss("ofd", 10, {})
    loss.setup_features({"a": torch.Size((2, 64, 2, 2))}, {"b": torch.Size((2, 512, 2, 2))})
    loss.setup_teacher({"b": (torch.ones(512), torch.zeros(512))})
    connector = loss.connectors[0]
    assert connector.conv.bias is None and abs(connector.conv.weight.std().item() / math.sqrt(2 / 512) - 1) < 0.05
    assert connector.bn.weight.eq(1).all() and connector.bn.bias.eq(0).all()
    assert "margins" not in loss.state_dict() and "connectors.0.conv.weight" in loss.state_dict()
    assert loss.margins.dtype == torch.float32 and loss.double().margins.dtype == torch.float64
