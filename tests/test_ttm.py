"""TTM and WTTM held equal to the official code.

Golden values: zkxufo/TTM ``distiller_zoo/ttm.py`` (``TTM.forward``) and ``distiller_zoo/wttm.py``
(``WTTM.forward``) at commit fe457b33a71ba27536ec04fe3d32c5b04963522f. A script outside this
repository imported those files unmodified, called them in float64 on the CPU with the student's and
the teacher's logits of :func:`inputs` and printed with ``repr`` the loss and the gradient probes
(:func:`conftest.gradient_probes`) with respect to the student's logits.
"""

from __future__ import annotations

import pytest
import torch
from conftest import golden_logits, gradient_probes

from kd.losses import DistillInputs, build_loss
from kd.losses.base import kd_divergence

RTOL = 1e-9

# (method, batch, classes, gamma) -> (the official loss, its gradient probes)
OFFICIAL = {
    ("ttm", 4, 6, 0.1): (1.4697800324952741, [-0.35815273913707957, -0.049961918795796395, 0.08613739275572045]),
    ("wttm", 4, 6, 0.1): (6.1619815791296695, [-1.4291203898164326, -0.22272665230236927, 1.5163777361946964]),
    ("ttm", 5, 7, 0.5): (1.8591322082003974, [1.099894793481598, 0.043913634401359807, 0.0804789893587636]),
    ("wttm", 5, 7, 0.5): (3.3448140218748192, [1.9788935834096195, 0.07901061173397861, 0.26049588306502536]),
    ("ttm", 3, 5, 1.0): (1.1200572845902415, [-0.17973465946580358, -0.12573732885645494, 0.1018114266866306]),
    ("wttm", 3, 5, 1.0): (1.1200572845902415, [-0.17973465946580136, -0.12573732885645497, 0.1018114266866306]),
}


def inputs(batch, classes):
    student = golden_logits(batch, classes, 0.7, 0.1, 3.0).requires_grad_()
    return DistillInputs(student, torch.arange(batch) % classes, golden_logits(batch, classes, 0.9, 0.2, 4.0))


@pytest.mark.parametrize("case", list(OFFICIAL), ids=lambda c: f"{c[0]}-b{c[1]}-c{c[2]}-g{c[3]}")
def test_equal_to_the_official_code(case):
    method, batch, classes, gamma = case
    value, grad = OFFICIAL[case]
    x = inputs(batch, classes)
    # ce_weight 0 and kd_weight 1: the official module's value alone, in float64
    out = build_loss(method, classes, {"ce_weight": 0.0, "kd_weight": 1.0, "gamma": gamma})(x)
    assert out["loss"].dtype == torch.float64
    assert out["kd"].item() == pytest.approx(value, rel=RTOL)
    out["loss"].backward()
    assert gradient_probes(x.student_logits.grad) == pytest.approx(grad, rel=RTOL)


def test_gamma_1_is_kd_at_temperature_1():
    """At gamma 1 the teacher is left as it is and every sample's weight is 1: both are KD at T 1."""
    x = inputs(5, 7)
    kd = kd_divergence(x.student_logits, x.teacher_logits, 1.0).item()
    for method in ("ttm", "wttm"):
        out = build_loss(method, 7, {"ce_weight": 0.0, "kd_weight": 2.0, "gamma": 1.0})(x)
        assert out["kd"].item() == pytest.approx(kd, rel=1e-12)
        assert out["loss"].item() == pytest.approx(2 * kd, rel=1e-12)


def test_defaults_and_the_label_term():
    assert build_loss("ttm", 10, {}).hparams == {
        "ce_weight": 1.0,
        "label_smoothing": 0.0,
        "kd_weight": 45.0,
        "gamma": 0.1,
    }
    assert build_loss("wttm", 10, {}).hparams == {
        "ce_weight": 1.0,
        "label_smoothing": 0.0,
        "kd_weight": 4.0,
        "gamma": 0.2,
    }
    x = inputs(4, 6)
    out = build_loss("wttm", 6, {"gamma": 0.1})(x)
    assert (out["loss"] - out["ce"]).item() == pytest.approx(4.0 * OFFICIAL[("wttm", 4, 6, 0.1)][0], rel=1e-6)


def test_a_certain_teacher_in_float32_stays_finite():
    """Teacher probabilities that round to 0 (the official code raises them to gamma; kd stays in log space)."""
    teacher = torch.tensor([[1e4, 0.0, -1e4, 1.0], [-50.0, 3e4, 0.0, -3e4]])
    student = torch.tensor([[-1e4, 1e4, 0.0, 0.0], [0.0, 0.0, 1e4, -1e4]], requires_grad=True)
    for method in ("ttm", "wttm"):
        out = build_loss(method, 4, {})(DistillInputs(student, torch.tensor([0, 1]), teacher))
        assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in out.values())
        out["loss"].backward()
        assert student.grad is not None and torch.isfinite(student.grad).all()
