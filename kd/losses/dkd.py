"""Zhao et al. 2022, "Decoupled Knowledge Distillation" (CVPR), https://arxiv.org/abs/2203.08679."""

from __future__ import annotations

from typing import Any

from kd.losses.base import DistillInputs, DistillLoss
from kd.losses.logits import dkd_parts, standardise_switch, standardised, warmup_ramp


class DecoupledKD(DistillLoss):
    """DKD: ``ce_weight * CE + min(epoch / warmup, 1) * (tckd_weight * TCKD + nckd_weight * NCKD)``.

    Defaults are the official ImageNet setting (mdistiller ``configs/imagenet/r34_r18/dkd.yaml``:
    CE_WEIGHT 1, BETA 0.5, T 1, WARMUP 1; ALPHA 1 from its defaults); the paper's and
    mdistiller's ``alpha`` / ``beta`` are ``tckd_weight`` / ``nckd_weight`` here. The warm-up is
    mdistiller's (``distillers/DKD.py``): a factor stepped once per epoch, ``epoch`` counted from
    1, so ``warmup`` 1 (ImageNet's) means no ramp at all and ``warmup`` 20 (CIFAR's) gives 1/20 in
    the first epoch; 0 disables it. ``standardise`` 1 z-scores both logit vectors first, as the
    logit-standardisation authors' DKD (sunshangquan/logit-standardization-KD
    ``mdistiller/distillers/DKD.py``); their ``--logit-stand --base-temp 2 --kd-weight 9`` also
    multiplies ALPHA and BETA by 9 and sets T 2: ``tckd_weight`` 9, ``nckd_weight`` 4.5,
    ``temperature`` 2 here on the ImageNet setting.
    """

    defaults = {
        "ce_weight": 1.0,
        "tckd_weight": 1.0,
        "nckd_weight": 0.5,
        "temperature": 1.0,
        "warmup": 1.0,
        "standardise": 0,
    }
    renamed = {"alpha": "tckd_weight", "beta": "nckd_weight"}

    def __init__(self, num_classes: int, **hparams: Any):
        super().__init__(num_classes, **hparams)
        self.standardise = standardise_switch(self.name, self.hparams["standardise"])

    def distill(self, x: DistillInputs):
        h = self.hparams
        assert x.teacher_logits is not None  # a method that needs_teacher always gets its logits
        student, teacher = standardised(x.student_logits, x.teacher_logits, self.standardise)
        tckd, nckd = dkd_parts(student, teacher, x.labels, h["temperature"])
        kd = h["tckd_weight"] * tckd + h["nckd_weight"] * nckd
        return warmup_ramp(x.progress, h["warmup"]) * kd, {"kd": kd, "tckd": tckd, "nckd": nckd}
