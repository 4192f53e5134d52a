"""CTKD (kd.losses.ctkd) and logit standardisation (``standardise`` of kd, dkd, ctkd) held equal to
the official code, plus the curriculum, the reversal layer and the finite gradient where the official
DKD's is NaN."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kd.errors import KDError
from kd.losses import DistillInputs, build_loss
from kd.losses.ctkd import reversal_scale, reverse_gradient
from kd.losses.logits import dkd_parts

# Golden values from the official CTKD code, zhengli97/CTKD@7d5252241259ae70d38a832371fed9697d15fc14:
# models/temp_global.py (Global_T and its gradient reversal), distiller_zoo/KD.py (DistillKL, its
# `temp.cuda()` removed), distiller_zoo/DKD.py (DKDloss), train_student.py's CosineDecay, and the
# temperature line of helper/loops.py (`t_start + t_end * torch.sigmoid(temp)`, 1 and 20). A script
# outside this repository set global_T to THETA, ran them in float64 on the inputs below (DKDloss
# with alpha 1, beta 2; lambda = CosineDecay(0, -1, 5).get_value(epoch)) and printed these with repr.
# Gradient sums: |g|.sum(), (g * fill(g.shape, 9)).sum(), (g * g).sum().
BATCH, CLASSES = 3, 6
LABELS = [0, 3, 5]
THETA = 0.4
TEMPERATURE = 12.97375320224904
LAMBDA_BY_EPOCH = [  # epochs 1..6
    -0.09549150281252627,
    -0.3454915028125263,
    -0.6545084971874737,
    -0.9045084971874737,
    -1.0,
    -1.0,
]
EPOCHS = (1, 3)
KD_LOSS = 1.1648574244747456
KD_THETA_GRAD = {1: 0.0008427054221468865, 3: 0.005775988890906246}  # autograd, through the reversal
KD_STUDENT_GRAD = (1.275381560222331, -0.6597271911535244, 0.13226392039781226)
DKD_LOSS = 2.329267258983015
DKD_STUDENT_GRAD = (2.5936560380181826, -1.3201943499501025, 0.577005206849914)
# The official DKD's global_T gradient is NaN on current torch (0 * log 0, see
# test_ctdkd_temperature_gradient_is_finite_where_the_official_one_is_nan). These are lambda times
# the derivative of its forward with respect to global_T, by a sixth-order central difference
# (h = 5e-3); on the KD case the same difference is within 3e-10 of autograd.
DKD_THETA_GRAD = {1: 0.0020890699672718458, 3: 0.014318698570311124}

# Golden values from the official logit-standardisation code,
# sunshangquan/logit-standardization-KD@f6e5aa5172bad618e801163c3385322eea673754:
# mdistiller/distillers/KD.py kd_loss and DKD.py dkd_loss (unmodified, logit_stand True) with
# tools/train.py's `--logit-stand --base-temp 2 --kd-weight 9` (KD: weight 9, T 2; DKD: ALPHA 1 * 9,
# BETA 0.5 * 9, T 2), and CTKD/distiller_zoo/KD.py DistillKL_logit_stand (`temp.cuda()` removed) at
# the learned temperature above; the same script conventions.
LS_KD_LOSS = 5.229592660277829  # 9 * kd_loss
LS_KD_STUDENT_GRAD = (4.152057965437386, -1.4947915889702617, 1.8850749267219427)
LS_DKD_LOSS = 3.2810291751293876
LS_DKD_STUDENT_GRAD = (3.1354933914143457, -1.161903832644731, 1.1295737360756664)
LS_TCKD, LS_NCKD = 0.06717975362323104, 0.5947580872267352
LS_CTKD_LOSS = 0.5263245976324901
LS_CTKD_THETA_GRAD = {1: 0.00047181980084989086, 3: 0.003233901024720772}
LS_CTKD_STUDENT_GRAD = (0.4383792114447128, -0.15158011623045503, 0.017909021349569156)

RTOL = 1e-9


def fill(shape, seed, scale=1.0):
    """A deterministic tensor: sin(0.37 k + seed) * scale over the flat index k, float64."""
    return torch.sin(torch.arange(math.prod(shape), dtype=torch.float64) * 0.37 + seed).reshape(shape) * scale


def close(value, expected, rtol=RTOL):
    value = value.item() if torch.is_tensor(value) else value
    return math.isclose(value, expected, rel_tol=rtol, abs_tol=0.0)


def grad_sums(g):
    return g.abs().sum(), (g * fill(g.shape, 9)).sum(), (g * g).sum()


def golden_run(name, args, epoch=1, theta=THETA):
    """kd's ``name`` in float64 on the golden inputs at ``epoch`` (1-based): (loss, part, terms, student)."""
    loss = build_loss(name, CLASSES, args).double()
    if hasattr(loss, "theta"):
        with torch.no_grad():
            loss.theta.fill_(theta)
    student = fill((BATCH, CLASSES), 1, 3.0).requires_grad_()
    x = DistillInputs(student, torch.tensor(LABELS), fill((BATCH, CLASSES), 2, 4.0), progress=epoch - 1 + 0.5)
    part, terms = loss.distill(x)
    part.backward()
    return loss, part, terms, student


# ---------------------------------------------------------------- CTKD against the official code


@pytest.mark.parametrize("epoch", EPOCHS)
def test_ctkd_equals_the_official_kd(epoch):
    loss, part, terms, student = golden_run("ctkd", {}, epoch)
    assert part.dtype == torch.float64 and part.dim() == 0
    assert close(part, KD_LOSS) and close(terms["kd"], KD_LOSS)
    assert close(terms["temperature"], TEMPERATURE)
    assert close(terms["lambda"], LAMBDA_BY_EPOCH[epoch - 1], rtol=1e-7)  # logged in float32
    assert close(loss.theta.grad, KD_THETA_GRAD[epoch])
    assert all(close(v, e) for v, e in zip(grad_sums(student.grad), KD_STUDENT_GRAD))


@pytest.mark.parametrize("epoch", EPOCHS)
def test_ctdkd_equals_the_official_dkd(epoch):
    loss, part, terms, student = golden_run("ctdkd", {"nckd_weight": 2.0}, epoch)
    assert close(part, DKD_LOSS)
    assert close(terms["tckd"] + 2.0 * terms["nckd"], DKD_LOSS)
    assert close(terms["temperature"], TEMPERATURE)
    assert all(close(v, e) for v, e in zip(grad_sums(student.grad), DKD_STUDENT_GRAD))
    assert close(loss.theta.grad, DKD_THETA_GRAD[epoch])


def official_nckd(student, teacher, labels, temperature):
    """The official DKD's non-target term as it is written (softmax target, not log space)."""
    gt = torch.zeros_like(student).scatter_(1, labels[:, None], 1).bool()
    log_s = F.log_softmax(student / temperature - 1000.0 * gt, dim=1)
    target = F.softmax(teacher / temperature - 1000.0 * gt, dim=1)
    return F.kl_div(log_s, target, reduction="sum") * temperature**2 / student.shape[0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ctdkd_temperature_gradient_is_finite_where_the_official_one_is_nan(dtype):
    """The teacher's non-target distribution is exactly 0 at the target class; the official KL's
    gradient with respect to that target is log 0 there, times the softmax's 0: NaN for the
    temperature. kd's teacher side is in log space and gets a finite gradient (here it differs)."""
    student, teacher = fill((BATCH, CLASSES), 1, 3.0).to(dtype), fill((BATCH, CLASSES), 2, 4.0).to(dtype)
    labels = torch.tensor(LABELS)
    official_t = torch.tensor(12.0, dtype=dtype, requires_grad=True)
    official_nckd(student, teacher, labels, official_t).backward()
    assert torch.isnan(official_t.grad)
    t = torch.tensor(12.0, dtype=dtype, requires_grad=True)
    tckd, nckd = dkd_parts(student, teacher, labels, t)
    nckd.backward()
    assert torch.isfinite(t.grad) and t.grad != 0
    with torch.no_grad():  # the same value as the official forward
        official = official_nckd(student, teacher, labels, t).item()
    assert close(nckd, official, rtol=1e-12 if dtype == torch.float64 else 1e-5)


def test_ctdkd_is_finite_on_imagenet_sized_float32_logits():
    g = torch.Generator().manual_seed(0)
    student = (torch.randn(8, 1000, generator=g) * 5).requires_grad_()
    teacher = torch.randn(8, 1000, generator=g) * 8
    labels = torch.randint(0, 1000, (8,), generator=g)
    loss = build_loss("ctdkd", 1000, {})
    out = loss(DistillInputs(student, labels, teacher, progress=7.0))
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and torch.isfinite(loss.theta.grad) and loss.theta.grad != 0
    assert torch.isfinite(student.grad).all()


# ---------------------------------------------------------------- the curriculum and the reversal


def test_lambda_is_the_official_cosine_by_epoch():
    assert all(close(reversal_scale(e, 5, 1.0), v, rtol=1e-15) for e, v in zip(range(1, 7), LAMBDA_BY_EPOCH))
    assert reversal_scale(0, 5, 1.0) == 0.0 and reversal_scale(50, 5, 1.0) == -1.0
    assert reversal_scale(1, 0, 0.5) == -0.5  # no ramp
    assert close(reversal_scale(5, 10, 2.0), -1.0, rtol=1e-15)  # halfway down a cosine from 0 to -2
    loss = build_loss("ctkd", 4, {})
    # fixed within an epoch, the epoch counted from 1 as the official trainer passes it
    for progress, epoch in [(0.0, 1), (0.99, 1), (1.0, 2), (3.5, 4), (40.0, 41)]:
        expected = LAMBDA_BY_EPOCH[min(epoch, 6) - 1]
        assert close(loss.temperature(progress)[1]["lambda"], expected, rtol=1e-7), progress


def test_reverse_gradient_is_identity_forward_and_scaled_backward():
    x = torch.tensor([0.3, -1.7], dtype=torch.float64, requires_grad=True)
    y = reverse_gradient(x, -0.25)
    assert torch.equal(y.detach(), x.detach())
    (y * torch.tensor([2.0, 3.0], dtype=torch.float64)).sum().backward()
    assert x.grad.tolist() == [-0.5, -0.75]


def test_temperature_range_initial_value_and_parameter():
    loss = build_loss("ctkd", 4, {})
    assert [n for n, _ in loss.named_parameters()] == ["theta"] and loss.theta.tolist() == [1.0]
    assert math.isclose(loss.temperature(0.0)[0].item(), 1 + 20 / (1 + math.exp(-1)), rel_tol=1e-6)
    narrow = build_loss("ctkd", 4, {"min_temperature": 2.0, "max_temperature": 4.0})
    for value in (-50.0, 0.0, 50.0):
        with torch.no_grad():
            narrow.theta.fill_(value)
        assert 2.0 <= narrow.temperature(0.0)[0].item() <= 4.0
    assert "theta" in loss.state_dict()


@pytest.mark.parametrize("name", ["ctkd", "ctdkd"])
def test_a_step_on_the_temperature_raises_the_distillation_loss(name):
    """The adversary: descending the reversed gradient moves T where the KD part grows."""
    loss = build_loss(name, CLASSES, {})
    g = torch.Generator().manual_seed(3)
    student, teacher = torch.randn(4, CLASSES, generator=g), torch.randn(4, CLASSES, generator=g) * 3
    x = DistillInputs(student, torch.tensor([0, 1, 2, 3]), teacher, progress=6.0)
    before, _ = loss.distill(x)
    before.backward()
    with torch.no_grad():
        loss.theta -= 0.5 * loss.theta.grad
    after, _ = loss.distill(x)
    assert after.item() > before.item()


# ---------------------------------------------------------------- logit standardisation


def test_kd_standardised_equals_the_official_logit_standardisation_kd():
    _, part, _, student = golden_run("kd", {"kd_weight": 9.0, "temperature": 2.0, "standardise": 1})
    assert close(part, LS_KD_LOSS)
    assert all(close(v, e) for v, e in zip(grad_sums(student.grad), LS_KD_STUDENT_GRAD))


def test_dkd_standardised_equals_the_official_logit_standardisation_dkd():
    args = {"tckd_weight": 9.0, "nckd_weight": 4.5, "temperature": 2.0, "standardise": 1}
    _, part, terms, student = golden_run("dkd", args)
    assert close(part, LS_DKD_LOSS)
    assert close(terms["tckd"], LS_TCKD) and close(terms["nckd"], LS_NCKD)
    assert all(close(v, e) for v, e in zip(grad_sums(student.grad), LS_DKD_STUDENT_GRAD))


@pytest.mark.parametrize("epoch", EPOCHS)
def test_ctkd_standardised_equals_the_official_logit_standardisation_ctkd(epoch):
    loss, part, terms, student = golden_run("ctkd", {"standardise": 1}, epoch)
    assert close(part, LS_CTKD_LOSS) and close(terms["temperature"], TEMPERATURE)
    assert close(loss.theta.grad, LS_CTKD_THETA_GRAD[epoch])
    assert all(close(v, e) for v, e in zip(grad_sums(student.grad), LS_CTKD_STUDENT_GRAD))


def test_ctdkd_standardised_is_ctdkd_on_z_scored_logits():
    _, part, _, _ = golden_run("ctdkd", {"standardise": 1})
    s, t = fill((BATCH, CLASSES), 1, 3.0), fill((BATCH, CLASSES), 2, 4.0)

    def z(v):
        return (v - v.mean(1, keepdim=True)) / (v.std(1, keepdim=True) + 1e-7)

    loss = build_loss("ctdkd", CLASSES, {}).double()
    with torch.no_grad():
        loss.theta.fill_(THETA)
    plain, _ = loss.distill(DistillInputs(z(s), torch.tensor(LABELS), z(t)))
    assert close(part, plain.item(), rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lskd_is_kd_standardised_at_the_same_weights(dtype):
    g = torch.Generator().manual_seed(5)
    x = DistillInputs(
        (torch.randn(6, 10, generator=g) * 4).to(dtype),
        torch.randint(0, 10, (6,), generator=g),
        (torch.randn(6, 10, generator=g) * 9).to(dtype),
    )
    lskd = build_loss("lskd", 10, {})(x)
    kd = build_loss("kd", 10, {"ce_weight": 1.0, "kd_weight": 9.0, "temperature": 2.0, "standardise": 1})(x)
    assert set(lskd) == set(kd) and all(torch.equal(lskd[k], kd[k]) for k in kd)


@pytest.mark.parametrize("name", ["kd", "dkd", "ctkd", "ctdkd"])
def test_standardise_is_off_by_default_and_only_0_or_1(name):
    assert build_loss(name, 10, {}).hparams["standardise"] == 0
    build_loss(name, 10, {"standardise": True})
    with pytest.raises(KDError, match="standardise must be 0 or 1"):
        build_loss(name, 10, {"standardise": 2})


def test_a_ctkd_run_logs_its_temperature_and_keeps_it(tmp_path):
    """The learned temperature, per logged step in TensorBoard (read back with its reader), in
    metrics.jsonl, and in the checkpoint with the student."""
    import json

    from conftest import kd_main, make_image_folder, train_args
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = make_image_folder(tmp_path / "data", classes=3, train_per_class=4, val_per_class=1)
    out = tmp_path / "run"
    r = kd_main(*train_args(data, out, "--log-every", 1, kd_loss="ctkd", epochs=2))
    assert r.returncode == 0, r.stderr
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    temperatures = [e.value for e in events.Scalars("train/temperature")]
    lambdas = [e.value for e in events.Scalars("train/lambda")]
    assert len(temperatures) == 2 and all(
        1 < t < 21 for t in temperatures
    )  # two epochs of one step (12 images, batch 8)
    assert lambdas[0] < 0 and lambdas[-1] < lambdas[0]  # the reversal grows over the epochs
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "train_temperature" in records[0]
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert state["loss"]["theta"].shape == (1,) and float(state["loss"]["theta"]) != 1.0  # trained from 1
