"""KD losses against naive transcriptions of the papers' equations, plus the protocol around them.

The references below are deliberately plain: numpy in float64, explicit loops over samples,
classes and positions, nothing imported from kd.
"""

from __future__ import annotations

import functools
import math
import re

import numpy as np
import pytest
import torch
from conftest import CUDA, ROOT, Float32Copies

from kd.errors import KDError
from kd.losses import LOSSES, DistillInputs, build_loss, split_layers

RTOL, ATOL = 1e-5, 1e-6


def close(value, expected, rtol=RTOL, atol=ATOL):
    value = value.item() if torch.is_tensor(value) else value
    return math.isclose(value, float(expected), rel_tol=rtol, abs_tol=atol)


# ---------------------------------------------------------------- naive references


def ref_softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def ref_kl(p, q):
    return sum(p[j] * math.log(p[j] / q[j]) for j in range(len(p)) if p[j] > 0)


def ref_ce(s, y):
    return float(np.mean([-math.log(ref_softmax(s[i])[y[i]]) for i in range(len(y))]))


def ref_dkd(s, t, y, tckd_weight, nckd_weight, T):
    """Zhao et al. Eq. (1)-(5): binary target / non-target KL and the KL among non-targets."""
    tckd = nckd = 0.0
    for i in range(len(y)):
        ps, pt = ref_softmax(s[i] / T), ref_softmax(t[i] / T)
        g = y[i]
        tckd += ref_kl([pt[g], 1 - pt[g]], [ps[g], 1 - ps[g]])
        others = [j for j in range(len(ps)) if j != g]
        qs = np.array([ps[j] for j in others]) / (1 - ps[g])
        qt = np.array([pt[j] for j in others]) / (1 - pt[g])
        nckd += ref_kl(qt, qs)
    n = len(y)
    return tckd_weight * T * T * tckd / n + nckd_weight * T * T * nckd / n


def ref_pearson(a, b):
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((a[k] - ma) * (b[k] - mb) for k in range(len(a)))
    va = sum((a[k] - ma) ** 2 for k in range(len(a)))
    vb = sum((b[k] - mb) ** 2 for k in range(len(b)))
    return cov / math.sqrt(va * vb)


def ref_dist(s, t, inter_weight, intra_weight, tau):
    """Huang et al. Eq. (6)-(9): 1 - Pearson over classes per sample, and over samples per class."""
    ps = np.stack([ref_softmax(r / tau) for r in s])
    pt = np.stack([ref_softmax(r / tau) for r in t])
    n, c = ps.shape
    inter = sum(1 - ref_pearson(ps[i], pt[i]) for i in range(n)) / n
    intra = sum(1 - ref_pearson(ps[:, j], pt[:, j]) for j in range(c)) / c
    return tau * tau * (inter_weight * inter + intra_weight * intra)


def ref_zscore(z, eps):
    mean = sum(z) / len(z)
    std = math.sqrt(sum((v - mean) ** 2 for v in z) / (len(z) - 1))  # unbiased, as the official code
    return np.array([(v - mean) / (std + eps) for v in z])


def ref_lskd(s, t, T, eps=1e-7):
    """Sun et al. Alg. 1: KL between softmax(Z(t)/T) and softmax(Z(s)/T), times T^2."""
    kl = [ref_kl(ref_softmax(ref_zscore(t[i], eps) / T), ref_softmax(ref_zscore(s[i], eps) / T)) for i in range(len(s))]
    return T * T * sum(kl) / len(s)


def ref_attention(f, p):
    """Q[n] = sum_c |f[n, c]|^p / C at each position (Zagoruyko & Komodakis Sec. 3)."""
    n, c, h, w = f.shape
    q = np.zeros((n, h, w))
    for i in range(n):
        for y in range(h):
            for x in range(w):
                q[i, y, x] = sum(abs(f[i, k, y, x]) ** p for k in range(c)) / c
    return q


def ref_block_mean(q, size):
    n, h, w = q.shape
    fh, fw = h // size[0], w // size[1]
    out = np.zeros((n,) + tuple(size))
    for i in range(n):
        for y in range(size[0]):
            for x in range(size[1]):
                out[i, y, x] = q[i, y * fh : (y + 1) * fh, x * fw : (x + 1) * fw].mean()
    return out


def ref_at_stage(fs, ft, p):
    qs, qt = ref_attention(fs, p), ref_attention(ft, p)
    size = (min(qs.shape[1], qt.shape[1]), min(qs.shape[2], qt.shape[2]))  # the larger map is pooled
    qs = qs if qs.shape[1:] == size else ref_block_mean(qs, size)
    qt = qt if qt.shape[1:] == size else ref_block_mean(qt, size)
    total, count = 0.0, 0
    for i in range(qs.shape[0]):
        a, b = qs[i].ravel(), qt[i].ravel()
        a, b = a / math.sqrt((a * a).sum()), b / math.sqrt((b * b).sum())
        total += sum((a[k] - b[k]) ** 2 for k in range(len(a)))
        count += len(a)
    return total / count


def ref_connector_train(x, weight, gamma, beta, eps):
    """1x1 convolution, then BatchNorm with batch statistics (training mode)."""
    n, c, h, w = x.shape
    o = weight.shape[0]
    y = np.zeros((n, o, h, w))
    for k in range(o):
        for j in range(c):
            y[:, k] += weight[k, j] * x[:, j]
    for k in range(o):
        mean = y[:, k].mean()
        var = ((y[:, k] - mean) ** 2).mean()
        y[:, k] = (y[:, k] - mean) / math.sqrt(var + eps) * gamma[k] + beta[k]
    return y


# ---------------------------------------------------------------- helpers


def logits(seed, n=4, c=7, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, generator=g) * scale


def labels(seed, n=4, c=7):
    return torch.randint(0, c, (n,), generator=torch.Generator().manual_seed(seed))


def np64(t):
    return t.detach().double().numpy()


def run(name, args, **inputs):
    return build_loss(name, inputs["student_logits"].shape[1], args)(DistillInputs(**inputs))


# ---------------------------------------------------------------- DKD


@pytest.mark.parametrize("T,tckd_weight,nckd_weight", [(1.0, 1.0, 0.5), (4.0, 1.0, 8.0), (2.0, 0.3, 2.0)])
def test_dkd_matches_paper(T, tckd_weight, nckd_weight):
    s, t, y = logits(0), logits(1), labels(2)
    out = run(
        "dkd",
        {"temperature": T, "tckd_weight": tckd_weight, "nckd_weight": nckd_weight},
        student_logits=s,
        teacher_logits=t,
        labels=y,
        progress=5.0,
    )
    expected_kd = ref_dkd(np64(s), np64(t), y.numpy(), tckd_weight, nckd_weight, T)
    assert close(out["kd"], expected_kd)
    assert close(out["ce"], ref_ce(np64(s), y.numpy()))
    assert close(out["loss"], ref_ce(np64(s), y.numpy()) + expected_kd)


def test_dkd_warmup_is_mdistillers_per_epoch_factor():
    """mdistiller's DKD: ``min(epoch / warmup, 1)`` with the epoch counted from 1, once per epoch:
    warmup 1 (its ImageNet setting) is no ramp at all, not a ramp over the first epoch."""
    s, t, y = logits(3), logits(4), labels(5)
    args = {"warmup": 4.0}
    full = run("dkd", args, student_logits=s, teacher_logits=t, labels=y, progress=10.0)
    for progress, ramp in [(0.0, 0.25), (0.9, 0.25), (1.0, 0.5), (2.5, 0.75), (3.0, 1.0), (4.0, 1.0)]:
        out = run("dkd", args, student_logits=s, teacher_logits=t, labels=y, progress=progress)
        assert close(out["loss"], full["ce"] + ramp * full["kd"])
    no_warmup = run("dkd", {"warmup": 0.0}, student_logits=s, teacher_logits=t, labels=y, progress=0.0)
    assert close(no_warmup["loss"], full["loss"])
    imagenet = run("dkd", {"warmup": 1.0}, student_logits=s, teacher_logits=t, labels=y, progress=0.0)
    assert close(imagenet["loss"], run("dkd", {"warmup": 1.0}, student_logits=s, teacher_logits=t, labels=y)["loss"])
    assert close(imagenet["loss"], imagenet["ce"] + imagenet["kd"])  # the first step already at full weight


def test_dkd_hand_values():
    # two classes: no non-target distribution to match, TCKD is the KL of (3/4, 1/4) || (1/2, 1/2)
    s = torch.tensor([[0.0, 0.0]])
    t = torch.tensor([[math.log(3.0), 0.0]])
    out = run("dkd", {"warmup": 0.0}, student_logits=s, teacher_logits=t, labels=torch.tensor([0]))
    assert close(out["tckd"], 0.75 * math.log(1.5) + 0.25 * math.log(0.5))
    assert close(out["nckd"], 0.0)
    same = run("dkd", {}, student_logits=logits(6), teacher_logits=logits(6), labels=labels(7), progress=1.0)
    assert close(same["kd"], 0.0)


def test_dkd_reformulates_classical_kd():
    # Zhao et al. Eq. (7), per sample: KD = TCKD + (1 - p_t[target]) * NCKD
    s, t, y, T = logits(8, n=1), logits(9, n=1), labels(10, n=1), 2.0
    dkd = run("dkd", {"temperature": T}, student_logits=s, teacher_logits=t, labels=y)
    kd = run("kd", {"temperature": T, "ce_weight": 0.0}, student_logits=s, teacher_logits=t, labels=y)
    p_target = ref_softmax(np64(t)[0] / T)[y.item()]
    assert close(kd["kd"], dkd["tckd"] + (1 - p_target) * dkd["nckd"])


def test_dkd_stays_finite_when_the_target_saturates():
    s = torch.tensor([[60.0, 0.0, 0.0]], requires_grad=True)
    out = run(
        "dkd",
        {"warmup": 0.0},
        student_logits=s,
        teacher_logits=torch.tensor([[5.0, 1.0, 0.0]]),
        labels=torch.tensor([0]),
    )
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and torch.isfinite(s.grad).all()


def test_dkd_refuses_soft_labels():
    with pytest.raises(KDError, match="class-index labels"):
        run("dkd", {}, student_logits=logits(0), teacher_logits=logits(1), labels=torch.full((4, 7), 1 / 7))


# ---------------------------------------------------------------- Hinton KD


def ref_hinton_kd(s, t, T):
    return T * T * sum(ref_kl(ref_softmax(t[i] / T), ref_softmax(s[i] / T)) for i in range(len(s))) / len(s)


@pytest.mark.parametrize("T", [1.0, 4.0])
def test_kd_matches_paper(T):
    s, t, y = logits(50), logits(51), labels(52)
    expected_kd, expected_ce = ref_hinton_kd(np64(s), np64(t), T), ref_ce(np64(s), y.numpy())
    out = run("kd", {"temperature": T}, student_logits=s, teacher_logits=t, labels=y)
    assert close(out["kd"], expected_kd) and close(out["ce"], expected_ce)
    assert close(out["loss"], 0.5 * expected_ce + 0.5 * expected_kd)  # Hinton's split: label 0.5, KD 0.5
    out = run(
        "kd", {"temperature": T, "ce_weight": 0.1, "kd_weight": 2.0}, student_logits=s, teacher_logits=t, labels=y
    )
    assert close(out["loss"], 0.1 * expected_ce + 2.0 * expected_kd)


# ---------------------------------------------------------------- DIST


@pytest.mark.parametrize("inter_weight,intra_weight,T", [(1.0, 1.0, 1.0), (2.0, 0.5, 4.0)])
def test_dist_matches_paper(inter_weight, intra_weight, T):
    s, t, y = logits(11, n=5), logits(12, n=5), labels(13, n=5)
    out = run(
        "dist",
        {"inter_weight": inter_weight, "intra_weight": intra_weight, "temperature": T},
        student_logits=s,
        teacher_logits=t,
        labels=y,
    )
    expected = ref_dist(np64(s), np64(t), inter_weight, intra_weight, T)
    assert close(out["kd"], expected)
    assert close(out["loss"], ref_ce(np64(s), y.numpy()) + 2.0 * expected)  # kd_weight 2


def test_dist_hand_values():
    y = torch.tensor([0, 1])
    s = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # same ordering in every row and column: perfectly correlated, whatever the magnitudes
    same = run("dist", {}, student_logits=s, teacher_logits=torch.tensor([[2.0, 0.0], [0.0, 2.0]]), labels=y)
    assert close(same["inter"], 0.0, atol=1e-6) and close(same["intra"], 0.0, atol=1e-6)
    # reversed ordering everywhere: correlation -1 in both directions, 1 - (-1) = 2 each
    flipped = run("dist", {}, student_logits=s, teacher_logits=torch.tensor([[0.0, 2.0], [2.0, 0.0]]), labels=y)
    assert close(flipped["inter"], 2.0) and close(flipped["intra"], 2.0) and close(flipped["kd"], 4.0)


# ---------------------------------------------------------------- LSKD


@pytest.mark.parametrize("T", [1.0, 2.0, 3.0])
def test_lskd_matches_paper(T):
    s, t, y = logits(14), logits(15, scale=8.0), labels(16)
    out = run("lskd", {"temperature": T}, student_logits=s, teacher_logits=t, labels=y)
    assert close(out["kd"], ref_lskd(np64(s), np64(t), T))
    assert close(out["loss"], ref_ce(np64(s), y.numpy()) + 9.0 * ref_lskd(np64(s), np64(t), T))


def test_lskd_hand_values():
    t = logits(17)
    # z-scoring removes each vector's shift and scale: an affine copy of the teacher costs nothing
    affine = run("lskd", {}, student_logits=3.0 * t + 5.0, teacher_logits=t, labels=labels(18))
    assert close(affine["kd"], 0.0, atol=1e-6)
    # two classes z-score to (+-1/sqrt(2)); opposite orderings give T^2 * x * tanh(x / 2), x = 2 / (T sqrt(2))
    out = run(
        "lskd",
        {"temperature": 2.0},
        student_logits=torch.tensor([[1.0, 0.0]]),
        teacher_logits=torch.tensor([[0.0, 5.0]]),
        labels=torch.tensor([0]),
    )
    x = 1 / math.sqrt(2)
    assert close(out["kd"], 4.0 * x * math.tanh(x / 2))


# ---------------------------------------------------------------- AT


def feats(seed, shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("p", [2.0, 1.0])
def test_at_matches_paper(p):
    s1, t1 = feats(20, (2, 3, 4, 4)), feats(21, (2, 5, 4, 4))
    s2, t2 = feats(22, (2, 4, 2, 3)), feats(23, (2, 6, 2, 3))
    loss = build_loss("at", 7, {"p": p})
    loss.setup_features({"a": s1.shape, "b": s2.shape}, {"a": t1.shape, "b": t2.shape})
    out = loss(
        DistillInputs(
            logits(24, n=2),
            labels(25, n=2),
            logits(26, n=2),
            student_feats={"a": s1, "b": s2},
            teacher_feats={"a": t1, "b": t2},
        )
    )
    expected = ref_at_stage(np64(s1), np64(t1), p) + ref_at_stage(np64(s2), np64(t2), p)
    assert close(out["at"], expected)
    assert close(out["loss"], out["ce"] + 1000.0 * expected, rtol=1e-5)


def test_at_pools_the_larger_map():
    s, t = feats(27, (2, 3, 8, 8)), feats(28, (2, 4, 4, 4))
    out = run(
        "at",
        {},
        student_logits=logits(29, n=2),
        labels=labels(30, n=2),
        teacher_logits=logits(31, n=2),
        student_feats={"x": s},
        teacher_feats={"x": t},
    )
    assert close(out["at"], ref_at_stage(np64(s), np64(t), 2.0))
    swapped = run(
        "at",
        {},
        student_logits=logits(29, n=2),
        labels=labels(30, n=2),
        teacher_logits=logits(31, n=2),
        student_feats={"x": t},
        teacher_feats={"x": s},
    )
    assert close(swapped["at"], ref_at_stage(np64(t), np64(s), 2.0))


def test_at_hand_values():
    base = dict(student_logits=torch.zeros(1, 2), labels=torch.tensor([0]), teacher_logits=torch.zeros(1, 2))
    f = feats(32, (1, 3, 4, 4))
    # attention is normalised: a scaled copy of the teacher's features matches it exactly
    assert close(run("at", {}, **base, student_feats={"x": 2 * f}, teacher_feats={"x": f})["at"], 0.0)
    # one channel, two positions: maps (1, 0) vs (0, 1) differ by (1, -1), mean square 1
    out = run(
        "at",
        {},
        **base,
        student_feats={"x": torch.tensor([[[[1.0, 0.0]]]])},
        teacher_feats={"x": torch.tensor([[[[0.0, 3.0]]]])},
    )
    assert close(out["at"], 1.0) and close(out["loss"], math.log(2) + 1000.0)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_at_maps_of_a_reduced_dtype_make_no_float32_copy(dtype, layout, device):
    """The attention of a float16/bfloat16 map, in either memory layout: no float32 tensor of the map's
    size is made, forward or backward; the values are the float32 expression's (within float32
    rounding) and its gradient bit for bit, in the map's layout (on the GPU too: ``pytest -m gpu``)."""
    from kd.losses.at import attention_map

    feat = (3 * feats(33, (4, 5, 6, 7))).to(device, dtype).to(memory_format=layout).requires_grad_()  # 2 / 5
    grad = feats(34, (4, 6, 7)).to(device)
    with Float32Copies(feat.numel()) as seen:
        got = attention_map(feat, 2.0)
        got.backward(grad)
    assert seen.ops == []
    ref_feat = feat.detach().clone().requires_grad_()
    want = ref_feat.float().abs().pow(2.0).mean(dim=1)
    want.backward(grad)
    assert torch.allclose(got, want, rtol=1e-6, atol=0) and got.dtype == torch.float32
    assert torch.equal(feat.grad, ref_feat.grad) and feat.grad.is_contiguous(memory_format=layout)


# ---------------------------------------------------------------- FitNet


def fitnet_with(student_shape, teacher_shape, seed=40):
    loss = build_loss("fitnet", 7, {})
    loss.setup_features({"h": torch.Size(student_shape)}, {"h": torch.Size(teacher_shape)})
    g = torch.Generator().manual_seed(seed)
    conn = loss.connectors[0]
    with torch.no_grad():
        conn.bn.weight.copy_(torch.rand(conn.bn.weight.shape, generator=g) + 0.5)
        conn.bn.bias.copy_(torch.randn(conn.bn.bias.shape, generator=g))
    return loss


@pytest.mark.parametrize(
    "student_shape,teacher_shape",
    [((3, 4, 4, 4), (3, 6, 4, 4)), ((3, 4, 4, 4), (3, 6, 2, 2)), ((3, 4, 2, 2), (3, 6, 4, 4))],
)
def test_fitnet_matches_paper(student_shape, teacher_shape):
    loss = fitnet_with(student_shape, teacher_shape)
    fs, ft = feats(41, student_shape), feats(42, teacher_shape)
    s, y = logits(43, n=3), labels(44, n=3)
    out = loss(DistillInputs(s, y, logits(45, n=3), student_feats={"h": fs}, teacher_feats={"h": ft}))
    conn = loss.connectors[0]
    hint = ref_connector_train(
        np64(fs), np64(conn.conv.weight)[:, :, 0, 0], np64(conn.bn.weight), np64(conn.bn.bias), conn.bn.eps
    )
    target = np64(ft)
    if hint.shape[2] > target.shape[2]:
        hint = np.stack([ref_block_mean(hint[:, k], target.shape[2:]) for k in range(hint.shape[1])], axis=1)
    elif hint.shape[2] < target.shape[2]:
        target = np.stack([ref_block_mean(target[:, k], hint.shape[2:]) for k in range(target.shape[1])], axis=1)
    expected = ((hint - target) ** 2).mean()
    assert close(out["hint"], expected)
    assert close(out["loss"], ref_ce(np64(s), y.numpy()) + 100.0 * expected)
    assert "kd" not in out


def test_fitnet_hand_values_and_kd_term():
    loss = build_loss("fitnet", 2, {"kd_weight": 0.5, "temperature": 1.0})
    loss.setup_features({"h": torch.Size((1, 1, 1, 1))}, {"h": torch.Size((1, 1, 1, 1))})
    loss.eval()  # BatchNorm with its initial running statistics: y = x / sqrt(1 + eps)
    with torch.no_grad():
        loss.connectors[0].conv.weight.fill_(2.0)
    s = torch.tensor([[0.0, 0.0]])
    t = torch.tensor([[math.log(3.0), 0.0]])
    out = loss(
        DistillInputs(
            s,
            torch.tensor([0]),
            t,
            student_feats={"h": torch.ones(1, 1, 1, 1)},
            teacher_feats={"h": torch.zeros(1, 1, 1, 1)},
        )
    )
    assert close(out["hint"], 4.0 / (1 + 1e-5))
    kl = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert close(out["kd"], kl)
    assert close(out["loss"], math.log(2) + 100.0 * 4.0 / (1 + 1e-5) + 0.5 * kl)


# ---------------------------------------------------------------- every registered method

FEATS_SAME = {"student": {"layer3": (4, 8, 4, 4)}, "teacher": {"layer3": (4, 16, 4, 4)}}
FEATS_PAIRS = {
    "student": {"features.3": (4, 6, 8, 8), "features.6": (4, 10, 4, 4)},
    "teacher": {"layer1": (4, 12, 4, 4), "layer2": (4, 14, 2, 2)},
}

# stage maps then the pooled feature (N, C), as the engine hands them to methods with uses_pooled
FEATS_REVIEW = {
    "student": {
        "features.3": (4, 6, 8, 8),
        "features.6": (4, 10, 4, 4),
        "features.13": (4, 12, 2, 2),
        "features.17": (4, 14, 1, 1),
        "classifier<1": (4, 14),
    },
    "teacher": {
        "layer1": (4, 8, 8, 8),
        "layer2": (4, 12, 4, 4),
        "layer3": (4, 16, 2, 2),
        "layer4": (4, 20, 1, 1),
        "fc<1": (4, 20),
    },
}

# hyper-parameters to try beside the defaults, and the features a feature method is given (its card says
# what else it reads); every registered method runs the tests below, with or without an entry here
SETTINGS = {
    "kd": {"args": {"ce_weight": 0.3, "kd_weight": 0.7, "temperature": 2.0}},
    "dkd": {"args": {"tckd_weight": 2.0, "nckd_weight": 4.0, "temperature": 4.0, "warmup": 5.0, "ce_weight": 0.5}},
    "dist": {"args": {"inter_weight": 2.0, "intra_weight": 2.0, "temperature": 4.0, "kd_weight": 1.0}},
    "lskd": {"args": {"temperature": 3.0, "kd_weight": 9.0}},
    "nkd": {"args": {"non_target_weight": 1.0, "temperature": 4.0}},
    "ctkd": {"args": {"kd_weight": 2.0, "standardise": 1, "reversal_epochs": 10.0}},
    "ctdkd": {"args": {"nckd_weight": 2.0, "min_temperature": 2.0, "max_temperature": 8.0}},
    "fitnet": {"features": FEATS_SAME, "args": {"kd_weight": 1.0}},
    "at": {"features": FEATS_PAIRS, "args": {"p": 4.0, "at_weight": 500.0}},
    "ofd": {"features": FEATS_PAIRS, "args": {"ofd_weight": 1e-3}},
    "reviewkd": {"features": FEATS_REVIEW, "args": {"reviewkd_weight": 8.0, "mid_channels": 8, "warmup": 4.0}},
    **{
        name: {
            "features": {"student": {"global_pool<1": (4, 6, 7, 7)}, "teacher": {"avgpool<1": (4, 8, 7, 7)}},
            "args": args,
        }
        for name, args in (
            ("sdkd", {"temperature": 2.0, "scales": [1, 2]}),
            ("sddkd", {"nckd_weight": 2.0, "grid": 0}),
            ("sdnkd", {"non_target_weight": 1.5, "drop_target": 1}),
        )
    },
    "mlkd": {"args": {"temperature": 2.0, "kd_weight": 1.0, "standardise": 1}},
    "crld": {"args": {"within_weight": 1.0, "cross_weight": 1.0, "temperature": 2.0, "weak_threshold": 0.1}},
    "luminet": {"args": {"kd_weight": 2.0, "temperature": 2.0, "warmup": 5.0}},
    "ttm": {"args": {"gamma": 0.5, "kd_weight": 3.0}},
    "wttm": {"args": {"gamma": 0.5, "kd_weight": 3.0}},
    "deit": {"args": {"hard": 0, "temperature": 3.0, "kd_weight": 0.3}},
    "crd": {
        "features": {"student": {"fc<1": (4, 8)}, "teacher": {"fc<1": (4, 12)}},
        "args": {"feat_dim": 16, "negatives": 30, "temperature": 0.1, "momentum": 0.9, "crd_weight": 1.0},
    },
}


def test_the_settings_name_registered_methods_and_give_each_feature_method_its_features():
    assert not set(SETTINGS) - set(LOSSES.names())
    featureless = [n for n in LOSSES.names() if LOSSES.card(n).uses_features and "features" not in SETTINGS.get(n, {})]
    assert not featureless, f"feature methods without the features of their test in SETTINGS: {featureless}"


def test_readme_method_table_lists_every_hyper_parameter():
    from kd.losses import LOSSES

    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        m = re.match(r"\| `(\w+)` \| [^|]+ \| ([^|]+) \|$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    for name in LOSSES.names():
        assert name in rows, f"README's method table has no row for {name}"
        for key, default in LOSSES.get(name).defaults.items():
            if isinstance(default, (str, list)):  # a choice (reviewkd's taps) or a list (sdd's scales)
                assert f" {key} {default}" in rows[name], f"README: {name} does not list {key} {default}"
                continue
            m = re.search(rf"\b{key} ([0-9.e+-]+)", rows[name])
            assert m, f"README: {name} does not list {key} ({rows[name]})"
            assert float(m.group(1)) == pytest.approx(float(default)), (name, key)


def prepared(name, args, dtype=torch.float32, num_classes=10, batch=4):
    """The loss built and set up as the engine would, and random inputs (all requiring grad)."""
    setting = SETTINGS.get(name, {})
    loss = build_loss(name, num_classes, args)
    g = torch.Generator().manual_seed(0)
    student = torch.randn(batch, num_classes, generator=g).to(dtype).requires_grad_()
    teacher = torch.randn(batch, num_classes, generator=g).requires_grad_() if loss.card.needs_teacher else None
    spec = setting.get("features", {"student": {}, "teacher": {}})
    s_feats = {k: torch.randn(*v, generator=g).to(dtype).requires_grad_() for k, v in spec["student"].items()}
    t_feats = {k: torch.randn(*v, generator=g).to(dtype).requires_grad_() for k, v in spec["teacher"].items()}
    if loss.card.uses_features:
        loss.setup_features(
            {k: torch.Size(v) for k, v in spec["student"].items()},
            {k: torch.Size(v) for k, v in spec["teacher"].items()},
        )
    if loss.card.reads_teacher_norms:
        loss.setup_teacher(
            {k: (torch.linspace(0.5, 1.5, v[1]), torch.linspace(-1.0, 1.0, v[1])) for k, v in spec["teacher"].items()}
        )
    head = None
    if loss.card.uses_classifier:  # the student's linear classifier, and a copy of the teacher's
        (s_map,), (t_map,) = spec["student"].values(), spec["teacher"].values()
        loss.setup_classifiers(
            "fc", torch.randn(num_classes, t_map[1], generator=g), torch.randn(num_classes, generator=g)
        )
        head = torch.nn.Linear(s_map[1], num_classes)
    labels_ = torch.randint(0, num_classes, (batch,), generator=g)
    indices = None
    if loss.card.uses_samples:  # a training set of 5 samples per class, the batch its first samples
        loss.setup_samples(torch.arange(5 * num_classes) % num_classes, 0, lambda t: t)
        indices = torch.arange(batch)
    second = {}
    if loss.card.views == 2:  # the student's and the teacher's logits on the second view
        second = dict(
            second_student_logits=torch.randn(batch, num_classes, generator=g).to(dtype).requires_grad_(),
            second_teacher_logits=torch.randn(batch, num_classes, generator=g).requires_grad_(),
        )
    x = DistillInputs(student, labels_, teacher, s_feats, t_feats, progress=2.0, indices=indices, **second)
    x.student_classifier = head
    if loss.card.reads_distill_head:  # a distilled DeiT's second head
        x.distill_logits = torch.randn(batch, num_classes, generator=g).to(dtype).requires_grad_()
    return loss, x


@pytest.mark.parametrize("name", LOSSES.names())
@pytest.mark.parametrize("use_args", [False, True])
def test_registered_loss_runs_and_backprops(name, use_args):
    loss, x = prepared(name, SETTINGS.get(name, {}).get("args", {}) if use_args else {})
    out = loss(x)
    assert {"loss", "ce"} <= set(out) and out["loss"].dtype == torch.float32
    assert all(torch.isfinite(v) for v in out.values())
    out["loss"].backward()
    assert x.student_logits.grad is not None and x.student_logits.grad.abs().sum() > 0


@pytest.mark.parametrize("name", [n for n in LOSSES.names() if LOSSES.card(n).needs_teacher])
def test_distillation_gradient_reaches_the_student_side_only(name):
    loss, x = prepared(
        name, {**SETTINGS.get(name, {}).get("args", {}), "ce_weight": 0.0}
    )  # the distillation part alone
    loss(x)["loss"].backward()
    assert x.teacher_logits.grad is None
    assert all(t.grad is None for t in x.teacher_feats.values())
    student_side = list(x.student_feats.values()) if loss.card.uses_features else [x.student_logits]
    if loss.card.reads_distill_head:
        student_side = [x.distill_logits]
    assert all(f.grad is not None and f.grad.abs().sum() > 0 for f in student_side)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in loss.parameters())


@pytest.mark.parametrize("name", LOSSES.names())
def test_registered_loss_under_autocast(name):
    loss, x = prepared(name, {}, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = loss(x)
    assert out["loss"].dtype == torch.float32 and torch.isfinite(out["loss"])
    out["loss"].backward()


@pytest.mark.parametrize("name", LOSSES.names())
def test_unknown_hyper_parameter_is_a_user_error(name):
    with pytest.raises(KDError, match="no hyper-parameter"):
        build_loss(name, 10, {"not_a_knob": 1})


@pytest.mark.parametrize("name", ["fitnet", "at"])
def test_feature_methods_refuse_token_features(name):
    loss = build_loss(name, 10, {})
    with pytest.raises(KDError, match="feature maps"):
        loss.setup_features({"blocks.3": torch.Size((2, 197, 192))}, {"blocks.3": torch.Size((2, 197, 384))})
    with pytest.raises(KDError, match="same non-zero number"):
        loss.setup_features({"a": torch.Size((2, 3, 4, 4))}, {})


# ---------------------------------------------------------------- the label term and the names of the knobs


def ref_ce_smoothed(s, y, eps):
    """Szegedy et al. 2016: the target is (1 - eps) one-hot + eps / C uniform."""
    total = 0.0
    for i in range(len(y)):
        log_p = np.log(ref_softmax(s[i]))
        total += -(1 - eps) * log_p[y[i]] - eps * log_p.mean()
    return total / len(y)


def test_every_method_has_the_label_term_knobs():
    for name in LOSSES.names():
        assert {"ce_weight", "label_smoothing"} <= set(LOSSES.get(name).defaults), name
        assert list(LOSSES.get(name).defaults)[:2] == ["ce_weight", "label_smoothing"], name


@pytest.mark.parametrize("name", LOSSES.names())
def test_label_smoothing_applies_to_every_method(name):
    plain_loss, x = prepared(name, {})
    smooth_loss, _ = prepared(name, {"label_smoothing": 0.1})
    smooth_loss.load_state_dict(plain_loss.state_dict())  # the same connectors
    plain, smooth = plain_loss(x), smooth_loss(x)
    views = [x.student_logits] + ([x.second_student_logits] if plain_loss.card.views == 2 else [])  # MLKD's: both
    expected = sum(ref_ce_smoothed(np64(v), x.labels.numpy(), 0.1) for v in views)
    assert close(smooth["ce"], expected)
    assert close(plain["ce"], sum(ref_ce(np64(v), x.labels.numpy()) for v in views))
    weight = LOSSES.get(name).defaults["ce_weight"]
    assert close(smooth["loss"] - plain["loss"], weight * (expected - plain["ce"].item()), atol=1e-5)
    assert set(smooth) == set(plain)  # the same logged entries


@pytest.mark.parametrize("name", ["ce", "kd", "lskd", "dist"])
def test_soft_labels_reach_the_label_term(name):
    """Probabilities as targets (mixup, cutmix) work wherever the method does not need a target class."""
    s, t = logits(60), logits(61)
    soft = torch.softmax(logits(62), dim=1)
    out = run(name, {"label_smoothing": 0.2}, student_logits=s, teacher_logits=t, labels=soft)
    target = 0.8 * np64(soft) + 0.2 / s.shape[1]
    expected = float(np.mean([-(target[i] * np.log(ref_softmax(np64(s)[i]))).sum() for i in range(len(s))]))
    assert close(out["ce"], expected)


# (method, old name, value) -> the current hyper-parameters it stands for
DEPRECATED = [
    ("kd", "alpha", 0.3, {"ce_weight": 0.3, "kd_weight": 0.7}),
    ("dkd", "alpha", 2.0, {"tckd_weight": 2.0}),
    ("dkd", "beta", 8.0, {"nckd_weight": 8.0}),
    ("dist", "beta", 2.0, {"inter_weight": 2.0}),
    ("dist", "gamma", 0.5, {"intra_weight": 0.5}),
    ("dist", "tau", 4.0, {"temperature": 4.0}),
    ("at", "beta", 500.0, {"at_weight": 500.0}),
    ("deit", "alpha", 0.3, {"ce_weight": 0.7, "kd_weight": 0.3}),
    ("deit", "tau", 3.0, {"temperature": 3.0}),
]


@pytest.mark.parametrize("name,old,value,new", DEPRECATED)
def test_old_names_are_accepted_with_one_deprecation_line(name, old, value, new, caplog):
    loss, x = prepared(name, new)
    with caplog.at_level("WARNING"):
        old_loss, _ = prepared(name, {old: value})
    old_loss.load_state_dict(loss.state_dict())
    expected, got = loss(x), old_loss(x)
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    lines = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(lines) == 1, lines
    assert old in lines[0] and all(k in lines[0] for k in new), lines[0]


@pytest.mark.parametrize("name,old,value,new", DEPRECATED)
def test_old_and_new_name_together_is_a_user_error(name, old, value, new):
    clash = next(iter(new))
    with pytest.raises(KDError, match=f"{old}.*{clash}.*not both"):
        build_loss(name, 10, {old: value, clash: value})


def test_renamed_tables_point_at_current_names():
    for name in LOSSES.names():
        cls = LOSSES.get(name)
        assert set(cls.renamed.values()) <= set(cls.defaults), name
        assert not set(cls.renamed) & set(cls.defaults), name


def test_kd_alpha_outside_0_1_is_refused():
    with pytest.raises(KDError, match="alpha must be between 0 and 1"):
        build_loss("kd", 10, {"alpha": 1.5})


# ---------------------------------------------------------------- default layers and layer specs


@functools.cache
def module_names(source, name):
    if source == "tv":
        from torchvision.models import get_model

        model = get_model(name, weights=None)
    else:
        import timm

        model = timm.create_model(name, pretrained=False)
    return tuple(n for n, _ in model.named_modules())


RESNET = ["layer1", "layer2", "layer3", "layer4"]


@pytest.mark.parametrize(
    "student,teacher",
    [
        (("tv", "resnet18"), ("tv", "resnet34")),
        (("tv", "resnet18"), ("tv", "resnet50")),
        (("timm", "resnet18"), ("tv", "resnet50")),
        (("timm", "resnet50"), ("timm", "resnet18")),
    ],
)
def test_default_layers_resnets(student, teacher):
    s, t = module_names(*student), module_names(*teacher)
    assert LOSSES.get("at").default_layers(list(s), list(t)) == RESNET
    assert LOSSES.get("fitnet").default_layers(list(s), list(t)) == ["layer3"]


@pytest.mark.parametrize(
    "student,stages",
    [
        (("tv", "mobilenet_v2"), ["features.3", "features.6", "features.13", "features.17"]),
        (("tv", "mobilenet_v3_large"), ["features.3", "features.6", "features.12", "features.16"]),
        (("timm", "mobilenetv1_100"), ["blocks.1", "blocks.2", "blocks.3", "blocks.4"]),
        (("timm", "mobilenetv2_100"), ["blocks.1", "blocks.2", "blocks.4", "blocks.6"]),
    ],
)
def test_default_layers_mobilenets_pair_with_resnet_teacher(student, stages):
    s, t = list(module_names(*student)), list(module_names("tv", "resnet50"))
    assert LOSSES.get("at").default_layers(s, t) == [f"{a}:{b}" for a, b in zip(stages, RESNET)]
    assert LOSSES.get("fitnet").default_layers(s, t) == [f"{stages[2]}:layer3"]
    assert LOSSES.get("at").default_layers(s, s) == stages


@pytest.mark.parametrize(
    "name", ["resnet50", "mobilenetv1_100", "mobilenetv2_100", "mobilenetv3_large_100", "efficientnet_b0"]
)
def test_default_layers_agree_with_timm_feature_info(name):
    import timm

    model = timm.create_model(name, pretrained=False)
    strides = {f["reduction"]: f["module"] for f in model.feature_info}
    names = [n for n, _ in model.named_modules()]
    assert LOSSES.get("at").default_layers(names, names) == [strides[r] for r in (4, 8, 16, 32)]


@pytest.mark.parametrize("name", ["at", "fitnet"])
def test_default_layers_unknown_architecture_asks_for_feature_layers(name):
    vit = list(module_names("timm", "vit_tiny_patch16_224"))
    with pytest.raises(KDError, match="--feature-layers"):
        LOSSES.get(name).default_layers(vit, list(module_names("tv", "resnet18")))
    with pytest.raises(KDError, match="teacher"):
        LOSSES.get(name).default_layers(list(module_names("tv", "resnet18")), ["", "0", "1"])


def test_logit_methods_need_no_layers():
    for name in ["kd", "ce", "dkd", "dist", "lskd"]:
        assert not LOSSES.card(name).uses_features and LOSSES.get(name).default_layers(["layer1"], ["layer1"]) == []


def test_split_layers():
    assert split_layers(["layer2", "features.13:layer3"]) == (["layer2", "features.13"], ["layer2", "layer3"])
    for bad in (["layer3:"], [":layer3"], ["a:b:c"]):
        with pytest.raises(KDError, match=f"bad feature layer {bad[0]!r}: use NAME or STUDENT_NAME:TEACHER_NAME"):
            split_layers(bad)
    with pytest.raises(KDError, match="feature layers name a teacher module twice: layer3, features.13:layer3"):
        split_layers(["layer3", "features.13:layer3"])


def test_feature_methods_on_real_models_through_hooks():
    """What the engine does: default layers, hooks on each side, a dry run for the shapes."""
    from torchvision.models import get_model

    student, teacher = (
        get_model("mobilenet_v3_small", weights=None, num_classes=10),
        get_model("resnet18", weights=None, num_classes=10),
    )
    images, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    for name in ["at", "fitnet"]:
        loss = build_loss(name, 10, {})
        specs = loss.default_layers([n for n, _ in student.named_modules()], [n for n, _ in teacher.named_modules()])
        s_names, t_names = split_layers(specs)
        s_feats, t_feats = {}, {}
        for model, names, store in ((student, s_names, s_feats), (teacher, t_names, t_feats)):
            modules = dict(model.named_modules())
            for n in names:
                modules[n].register_forward_hook(lambda m, i, o, n=n, store=store: store.__setitem__(n, o))
        with torch.no_grad():
            t_logits = teacher(images)
        s_logits = student(images)
        loss.setup_features({n: s_feats[n].shape for n in s_names}, {n: t_feats[n].shape for n in t_names})
        out = loss(
            DistillInputs(s_logits, y, t_logits, {n: s_feats[n] for n in s_names}, {n: t_feats[n] for n in t_names})
        )
        out["loss"].backward()
        assert torch.isfinite(out["loss"])
        first_tap = dict(student.named_modules())[s_names[0]]
        assert all(p.grad is not None for p in first_tap.parameters())
