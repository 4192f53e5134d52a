"""LumiNet held equal to the official code.

Golden values: ismail31416/LumiNet ``mdistiller/distillers/Luminet.py`` (``Luminet.forward_train``) at
commit 8cf749be3a4ec67c4673bfbc791715848e5bb720. A script outside this repository imported that file
(only its ``_base`` import replaced, the distiller built without its base class), gave it a student and a
teacher that return the fixed float64 logits of :func:`inputs`, ran ``forward_train`` at epoch 1 and
printed with ``repr`` its ``loss_kd``, ``loss_ce`` and the gradient probes of ``loss_kd`` with respect to
the student's logits (:func:`conftest.gradient_probes`).
"""

from __future__ import annotations

import pytest
import torch
from conftest import golden_logits, gradient_probes

from kd.losses import DistillInputs, build_loss

RTOL = 1e-9

# (batch, classes, official ALPHA, T, CE_WEIGHT) -> the official loss_kd, loss_ce, gradient probes of loss_kd
OFFICIAL = {
    (6, 5, 2.0, 0.7, 1.0): (
        4.1604717735679495,
        4.768956344223478,
        [0.4327122979282563, -0.05121805356870836, 0.29450549287691397],
    ),
    (4, 7, 1.5, 2.0, 0.5): (
        0.22174984711309936,
        1.5220912213365552,
        [-0.16052787599953788, 0.004650460660577759, 0.0008607993448121424],
    ),
    # one sample: every standardised logit is 0, both distributions uniform, the loss 0
    (1, 4, 2.0, 0.7, 1.0): (0.0, 3.4188102312087887, [0.0, 0.0, 0.0]),
}


def inputs(batch, classes, progress=0.0):
    student = golden_logits(batch, classes, 0.7, 0.1, 3.0).requires_grad_()
    teacher = golden_logits(batch, classes, 0.9, 0.2, 4.0)
    return DistillInputs(student, torch.arange(batch) * 2 % classes, teacher, progress=progress)


@pytest.mark.parametrize("case", list(OFFICIAL), ids=lambda c: f"b{c[0]}-c{c[1]}-a{c[2]}-T{c[3]}")
def test_equal_to_the_official_code(case):
    batch, classes, alpha, temperature, ce_weight = case
    kd_value, ce_value, grad = OFFICIAL[case]
    x = inputs(batch, classes)
    args = {"ce_weight": ce_weight, "kd_weight": alpha**2, "temperature": temperature}
    out = build_loss("luminet", classes, args)(x)
    assert (out["loss"] - ce_weight * out["ce"]).item() == pytest.approx(kd_value, rel=RTOL, abs=1e-15)
    assert (alpha**2 * out["kd"]).item() == pytest.approx(kd_value, rel=RTOL, abs=1e-15)
    assert (ce_weight * out["ce"]).item() == pytest.approx(ce_value, rel=1e-6)  # kd's label term is float32
    (alpha**2 * out["kd"]).backward()
    assert gradient_probes(x.student_logits.grad) == pytest.approx(grad, rel=RTOL, abs=1e-15)


def test_defaults_are_the_official_imagenet_setting():
    loss = build_loss("luminet", 1000, {})
    assert loss.hparams == {
        "ce_weight": 1.0, "label_smoothing": 0.0, "kd_weight": 4.0, "temperature": 0.7, "eps": 1e-5, "warmup": 1.0
    }  # fmt: skip


def test_the_warm_up_is_mdistillers():
    """warmup 5: a fifth of the term in the first epoch, two fifths in the second, all from the fifth."""
    kd = OFFICIAL[(6, 5, 2.0, 0.7, 1.0)][0]
    loss = build_loss("luminet", 5, {"ce_weight": 0.0, "warmup": 5.0})
    for progress, share in ((0.0, 0.2), (1.5, 0.4), (4.0, 1.0), (9.0, 1.0)):
        assert loss(inputs(6, 5, progress))["loss"].item() == pytest.approx(share * kd, rel=1e-12)


def test_the_statistics_are_those_of_the_batch_the_loss_sees():
    """Each class is standardised over the batch of the call: a process's share of a global batch, as each
    official DataParallel replica sees its share. A half batch differs from its rows in the whole one."""
    loss = build_loss("luminet", 5, {"ce_weight": 0.0})
    x = inputs(6, 5)
    whole = loss(x)["kd"].item()
    halves = [loss(DistillInputs(x.student_logits[i : i + 3], x.labels[i : i + 3], x.teacher_logits[i : i + 3]))
              for i in (0, 3)]  # fmt: skip
    assert whole != pytest.approx(sum(h["kd"].item() for h in halves) / 2, rel=1e-3)
    shifted = DistillInputs(x.student_logits + 7.0, x.labels, x.teacher_logits * 3.0 - 1.0)
    assert loss(shifted)["kd"].item() == pytest.approx(whole, rel=1e-6)  # per-class shift and scale drop out
