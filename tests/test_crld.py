"""CRLD held equal to the official code.

Golden values: ``mdistiller/distillers/CRLD.py`` (``CRLD.forward_train``) of the official arcanienz/CRLD,
which was not available to read, as its copy scx-822/CRLD-main holds it at commit
c9d665706f7d8b3598ab8033f0d467ed006037f5 (the same file carries the official README). A script outside
this repository ran that function's text (only its ``_base`` import replaced) with a student and a
teacher that return the fixed float64 logits of :func:`inputs` for each view, summed its losses as the
official trainer does and printed with ``repr`` each loss, the total and the gradient probes with respect
to the student's logits of each view (:func:`conftest.gradient_probes`). The copy in haiduo/DeepKD
(commit afb5964e0639c6d1abef2384acd9dea04f3f27dc) gives the same ``loss_kd_wv + loss_kd_cv`` outside its
DeepKD trainers (checked on the first case).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import golden_logits, gradient_probes, kd_main, train_args

from kd.losses import DistillInputs, build_loss

RTOL = 1e-9

# (batch, classes, TEMPERATURE, CE_WEIGHT, WV_WEIGHT, CV_WEIGHT, TAU_W, TAU_S) -> the official values
OFFICIAL = {
    (6, 5, 1.0, 2.0, 2.0, 0.5, 0.9, 0.2): {  # the ImageNet setting: one confident weak-view sample
        "parts": {"loss_ce": 14.39409641750785, "loss_kd_wv": 0.5438528446257785, "loss_kd_cv": 1.9826927394439153},
        "total": 16.920642001577544,
        "grad_weak": [1.2061721872249032, -0.03677220150590321, 1.1516038656358571],
        "grad_strong": [-3.45227640782334, -0.17817672167596732, 0.9240081828926096],
    },
    (5, 7, 4.0, 1.0, 2.0, 0.5, 0.52, 0.5): {
        "parts": {"loss_ce": 6.426736243353217, "loss_kd_wv": 5.394351885746163, "loss_kd_cv": 3.815671192649636},
        "total": 15.636759321749015,
        "grad_weak": [1.6900000078619835, 0.28376669701288537, 0.8525667138668793],
        "grad_strong": [3.00534192932108, 0.018726840328437244, 0.7546917732121637],
    },
    (4, 6, 2.0, 1.0, 1.5, 1.0, 0.5183, 0.3884): {
        "parts": {"loss_ce": 7.84137028553304, "loss_kd_wv": 5.544207563629962, "loss_kd_cv": 8.081607050350646},
        "total": 21.467184899513647,
        "grad_weak": [1.4976311248218095, -0.17222931128856667, 1.46005294763665],
        "grad_strong": [1.1319487518908269, -0.16771283392843656, 1.6674439400375278],
    },
}


def inputs(batch, classes):
    """Student weak, student strong, teacher weak, teacher strong logits and labels (float64)."""
    sw = golden_logits(batch, classes, 0.7, 0.1, 3.0).requires_grad_()
    ss = golden_logits(batch, classes, 1.3, 0.4, 2.5).requires_grad_()
    tw = golden_logits(batch, classes, 0.9, 0.2, 6.0)
    ts = golden_logits(batch, classes, 1.1, 0.5, 3.5)
    return sw, ss, tw, ts, torch.arange(batch) * 2 % classes


@pytest.mark.parametrize("case", list(OFFICIAL), ids=lambda c: f"b{c[0]}-c{c[1]}-T{c[2]}")
def test_equal_to_the_official_code(case):
    batch, classes, temperature, ce_weight, within, cross, weak_threshold, strong_threshold = case
    golden = OFFICIAL[case]
    sw, ss, tw, ts, labels = inputs(batch, classes)
    args = dict(ce_weight=ce_weight, within_weight=within, cross_weight=cross, temperature=temperature,
                weak_threshold=weak_threshold, strong_threshold=strong_threshold)  # fmt: skip
    out = build_loss("crld", classes, args)(
        DistillInputs(sw, labels, tw, second_student_logits=ss, second_teacher_logits=ts)
    )
    parts = golden["parts"]
    assert (ce_weight * out["ce"]).item() == pytest.approx(parts["loss_ce"], rel=RTOL)
    assert out["wv"].item() == pytest.approx(parts["loss_kd_wv"], rel=RTOL)
    assert out["cv"].item() == pytest.approx(parts["loss_kd_cv"], rel=RTOL)
    assert out["loss"].item() == pytest.approx(golden["total"], rel=RTOL)
    out["loss"].backward()
    assert gradient_probes(sw.grad) == pytest.approx(golden["grad_weak"], rel=RTOL)
    assert gradient_probes(ss.grad) == pytest.approx(golden["grad_strong"], rel=RTOL)


def test_defaults_are_the_official_imagenet_setting():
    loss = build_loss("crld", 1000, {})
    assert loss.card.views == 2
    assert loss.hparams == {
        "ce_weight": 2.0, "label_smoothing": 0.0, "within_weight": 2.0, "cross_weight": 0.5, "temperature": 1.0,
        "weak_threshold": 0.9, "strong_threshold": 0.2,
    }  # fmt: skip


def test_no_confident_teacher_leaves_the_label_term_alone():
    """Thresholds above every teacher confidence: both terms 0 and no gradient from them."""
    sw, ss, tw, ts, labels = inputs(5, 7)
    loss = build_loss("crld", 7, {"ce_weight": 0.0, "weak_threshold": 1.01, "strong_threshold": 1.01})
    out = loss(DistillInputs(sw, labels, tw, second_student_logits=ss, second_teacher_logits=ts))
    assert out["wv"].item() == 0.0 and out["cv"].item() == 0.0
    out["loss"].backward()
    assert not sw.grad.any() and not ss.grad.any()


def test_the_new_logit_methods_train_beside_each_other(image_folder, tmp_path):
    """wttm (ttm's code with the weight), luminet and crld as three students of one run on the CPU (crld's
    loaders make the strong view, the teacher forwards it once for all): each trains and logs its terms."""
    options = dict(student="timm:test_resnet", kd_loss="wttm,luminet,crld", limit_train_batches=1)
    r = kd_main(*train_args(image_folder, tmp_path / "run", **options))
    assert r.returncode == 0, r.stderr
    for method, terms in (("wttm", ["kd"]), ("luminet", ["kd"]), ("crld", ["wv", "cv"])):
        last = json.loads((tmp_path / "run" / method / "metrics.jsonl").read_text().splitlines()[-1])
        assert all(math.isfinite(last[f"train_{term}"]) for term in ["ce", *terms]), (method, last)
