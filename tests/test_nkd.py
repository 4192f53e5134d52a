"""NKD held equal to the official code, and to a case worked by hand.

Golden values: yzd-v/cls_KD ``mmcls/models/dis_losses/nkd.py`` (``NKDLoss.forward``) at commit
1e5d48f36957ee460d39d7ebc592c6cc7f8f3d66 (branch 1.0). A script outside this repository imported
that file (only the mmcls registry import and decorator removed), ran it in float64 on the CPU
with the deterministic logits and labels below and printed the loss and the gradient with
respect to the student's logits with ``repr``; for the mixed targets, the same script gave it mmcls's mixed scores (its
``gt_label.score``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kd.errors import KDError
from kd.losses import DistillInputs, build_loss
from kd.losses.nkd import nkd_parts

RTOL = 1e-9
BATCH, CLASSES = 3, 6
LABELS = torch.tensor([0, 3, 5])

# (temp, gamma) -> the official loss and d loss / d student logits
OFFICIAL = {
    (1.0, 1.5): {  # the official ImageNet ResNet setting
        "loss": 3.2059409359388056,
        "grad": [
            [
                -0.17321754598008676,
                -0.14890356449972258,
                0.11000087259623575,
                0.12213865213279262,
                0.06502991310158912,
                0.024951672649191913,
            ],
            [
                0.29505528951794574,
                0.09448380924300165,
                0.028185015637857372,
                -0.01885342808312069,
                -0.07068367780623798,
                -0.32818700850944615,
            ],
            [
                -0.000981461560495204,
                -0.013740474821488725,
                -0.04430193264595724,
                -0.04594989873651269,
                0.1362640985452523,
                -0.03129033078079843,
            ],
        ],
    },
    (4.0, 1.0): {
        "loss": 26.179944747696524,
        "grad": [
            [
                -0.17321754598008676,
                -0.09832752688917293,
                0.026724514824754332,
                0.08376089773933863,
                0.08935712408615752,
                0.07170253621900922,
            ],
            [
                0.18648123618265308,
                0.11013708823838386,
                0.04346209683886143,
                -0.01885342808312069,
                -0.1045994849155327,
                -0.21662750826124483,
            ],
            [
                0.0019358743329330778,
                -0.022914771486129228,
                -0.03242488373815352,
                -0.0023907779425670203,
                0.08708488961471529,
                -0.03129033078079843,
            ],
        ],
    },
}


def fill(shape, seed, scale=1.0):
    """A deterministic tensor: sin(0.37 k + seed) * scale over the flat index k, float64."""
    return torch.sin(torch.arange(math.prod(shape), dtype=torch.float64) * 0.37 + seed).reshape(shape) * scale


def golden_inputs() -> DistillInputs:
    student = fill((BATCH, CLASSES), 1, 3.0).requires_grad_()
    return DistillInputs(student, LABELS, fill((BATCH, CLASSES), 2, 4.0))


def test_defaults_are_the_official_imagenet_setting():
    loss = build_loss("nkd", 1000, {})
    assert loss.hparams == {"ce_weight": 1.0, "label_smoothing": 0.0, "non_target_weight": 1.5, "temperature": 1.0}


@pytest.mark.parametrize("temp, gamma", sorted(OFFICIAL))
def test_equal_to_the_official_code(temp, gamma):
    golden = OFFICIAL[(temp, gamma)]
    x = golden_inputs()
    # ce_weight 0: the distillation part alone, in float64 (kd's label term is float32)
    out = build_loss("nkd", CLASSES, {"ce_weight": 0.0, "temperature": temp, "non_target_weight": gamma})(x)
    assert out["loss"].dtype == torch.float64
    assert out["loss"].item() == pytest.approx(golden["loss"], rel=RTOL)
    assert out["kd"].item() == pytest.approx(golden["loss"], rel=RTOL)
    assert (out["target"] + gamma * out["non_target"]).item() == pytest.approx(golden["loss"], rel=RTOL)
    out["loss"].backward()
    assert x.student_logits.grad is not None
    expected = torch.tensor(golden["grad"], dtype=torch.float64)
    torch.testing.assert_close(x.student_logits.grad, expected, rtol=RTOL, atol=1e-15)


def test_the_label_term_is_added_with_its_weight():
    x = golden_inputs()
    out = build_loss("nkd", CLASSES, {"ce_weight": 0.5})(x)
    ce = F.cross_entropy(x.student_logits.detach().float(), LABELS).item()
    assert out["ce"].item() == pytest.approx(ce, rel=1e-6)
    assert (out["loss"] - 0.5 * out["ce"]).item() == pytest.approx(OFFICIAL[(1.0, 1.5)]["loss"], rel=RTOL)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_a_case_worked_by_hand(temperature):
    # one sample, target 0; the student uniform over 3 classes, the teacher at probabilities 2:1:3
    student = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    teacher = torch.log(torch.tensor([[2.0, 1.0, 3.0]], dtype=torch.float64))
    loss = build_loss("nkd", 3, {"ce_weight": 0.0, "temperature": temperature})
    out = loss(DistillInputs(student, torch.tensor([0]), teacher))
    # target: -(1/3) log(1/3); non-target: the student uniform over two classes, whatever the
    # teacher's renormalised non-targets are, so -1.5 T^2 log(1/2)
    assert out["target"].item() == pytest.approx(math.log(3) / 3, rel=1e-12)
    assert out["non_target"].item() == pytest.approx(temperature**2 * math.log(2), rel=1e-12)
    assert out["loss"].item() == pytest.approx(math.log(3) / 3 + 1.5 * temperature**2 * math.log(2), rel=1e-12)
    out["loss"].backward()
    if temperature == 1.0:
        # target: -p_t[y] (onehot - p_s); non-target: gamma (q_s - q_t) with q_t = (1/4, 3/4)
        expected = [-2 / 9, 1 / 9 + 1.5 * (0.5 - 0.25), 1 / 9 + 1.5 * (0.5 - 0.75)]
        torch.testing.assert_close(student.grad, torch.tensor([expected], dtype=torch.float64), rtol=1e-12, atol=0)


def test_saturated_logits_stay_finite():
    # a teacher certain of the target (its non-target probabilities round to 0), a student
    # certain of a wrong class (its target probability rounds to 0)
    teacher = torch.tensor([[1e4, 0.0, -1e4, 1.0], [-50.0, 3e4, 0.0, -3e4]])
    student = torch.tensor([[-1e4, 1e4, 0.0, 0.0], [0.0, 0.0, 1e4, -1e4]], requires_grad=True)
    out = build_loss("nkd", 4, {})(DistillInputs(student, torch.tensor([0, 1]), teacher))
    assert all(torch.isfinite(v) for v in out.values())
    out["loss"].backward()
    assert student.grad is not None and torch.isfinite(student.grad).all()


# Mixed targets, as mmcls's batch augments hand them to the official NKDLoss: lam * one-hot(a) + (1 - lam)
# * one-hot(b) for (a, b, lam) below; the official code takes each row's argmax (classes 0, 5, 5), so its
# target class differs from LABELS in the second row. Golden values from the same script, float64.
MIXED = [(0, 3, 0.7), (3, 5, 0.4), (5, 1, 0.55)]
OFFICIAL_MIXED = {
    (1.0, 1.0): {  # the official DeiT setting (deit-s3_distill_deit-t_img.py)
        "loss": 2.824299866811928,
        "grad": [
            [
                -0.17321754598008676,
                -0.08105938020389877,
                0.09186381663415501,
                0.09406216989209892,
                0.04943538108288098,
                0.018915558574850663,
            ],
            [
                0.28955501742439127,
                0.0864099248197224,
                0.015703212817961464,
                -0.03250001861304844,
                -0.1479839924032372,
                -0.21118414404578945,
            ],
            [
                -0.0005343558707552185,
                -0.008873106210213096,
                -0.02870714614779706,
                -0.028147422906707416,
                0.09755236191627122,
                -0.03129033078079843,
            ],
        ],
    },
    (1.0, 1.5): {
        "loss": 3.6885907103812254,
        "grad": [
            [
                -0.17321754598008676,
                -0.14890356449972258,
                0.11000087259623575,
                0.12213865213279262,
                0.06502991310158912,
                0.024951672649191913,
            ],
            [
                0.3694428129314999,
                0.10725927130993487,
                0.014370522696217754,
                -0.05382510957933692,
                -0.22606335331252606,
                -0.21118414404578945,
            ],
            [
                -0.000981461560495204,
                -0.013740474821488725,
                -0.04430193264595724,
                -0.04594989873651269,
                0.1362640985452523,
                -0.03129033078079843,
            ],
        ],
    },
}


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("temp, gamma", sorted(OFFICIAL_MIXED))
def test_mixed_targets_take_their_larger_part_as_the_official_code_does(temp, gamma, smoothing):
    golden = OFFICIAL_MIXED[(temp, gamma)]
    mixed = torch.zeros(BATCH, CLASSES, dtype=torch.float64)
    for row, (a, b, lam) in enumerate(MIXED):
        mixed[row, a] += lam
        mixed[row, b] += 1 - lam
    mixed = mixed * (1 - smoothing) + smoothing / CLASSES  # timm's mixer smooths them; the official code does not
    x = golden_inputs()
    x.labels = mixed
    out = build_loss("nkd", CLASSES, {"ce_weight": 0.0, "temperature": temp, "non_target_weight": gamma})(x)
    assert out["loss"].item() == pytest.approx(golden["loss"], rel=RTOL)
    out["loss"].backward()
    expected = torch.tensor(golden["grad"], dtype=torch.float64)
    torch.testing.assert_close(x.student_logits.grad, expected, rtol=RTOL, atol=1e-15)


def test_a_mixed_target_of_two_equal_parts_takes_the_lower_class_as_torch_max_does():
    tie = torch.zeros(BATCH, CLASSES, dtype=torch.float64)
    tie[torch.arange(BATCH), torch.tensor([4, 2, 5])] = 0.5
    tie[torch.arange(BATCH), torch.tensor([1, 3, 0])] = 0.5  # cutmix's half box, or lam = 0.5
    assert torch.equal(torch.max(tie, dim=1)[1], torch.tensor([1, 2, 0]))  # the official code's choice
    loss = build_loss("nkd", CLASSES, {"ce_weight": 0.0})
    x = golden_inputs()
    x.labels = tie
    assert torch.equal(
        loss(x)["loss"], loss(DistillInputs(x.student_logits, torch.tensor([1, 2, 0]), x.teacher_logits))["loss"]
    )


def test_the_parts_alone_refuse_soft_labels():
    with pytest.raises(KDError, match="class-index labels"):
        nkd_parts(fill((BATCH, CLASSES), 1), fill((BATCH, CLASSES), 2), F.one_hot(LABELS, CLASSES).double(), 1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_give_a_finite_float32_loss(dtype):
    student = fill((BATCH, CLASSES), 1, 3.0).to(dtype).requires_grad_()
    teacher = fill((BATCH, CLASSES), 2, 4.0).to(dtype)
    out = build_loss("nkd", CLASSES, {})(DistillInputs(student, LABELS, teacher))
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in out.values())
    out["loss"].backward()
    assert student.grad is not None and student.grad.dtype == dtype and torch.isfinite(student.grad).all()
    # the same value as float32 logits of the rounded inputs
    exact = build_loss("nkd", CLASSES, {})(DistillInputs(student.detach().float(), LABELS, teacher.float()))
    assert out["loss"].item() == pytest.approx(exact["loss"].item(), rel=1e-6)
