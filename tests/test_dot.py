"""DOT (Zhao et al. ICCV 2023): kd's two-momentum step held equal to the official optimizer's numbers,
through the step policy (loss scale, non-finite skip, clip), and through the engine as a user runs it
(kd and dkd, resume, two processes)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import kd_main, last_checkpoint, one_error_line, run_kd, tiny_config, train_args

from kd.errors import KDError
from kd.precision import AutocastPrecision, Precision
from kd.run.dot import DistillationOrientedSGD
from kd.run.step import apply_gradients

LR, MOMENTUM, DELTA, WD, STEPS = 0.2, 0.9, 0.09, 1e-4, 3

#: /work-side golden script: megvii-research/mdistiller mdistiller/engine/dot.py@a08d46f (its
#: DistillationOrientedTrainer, called as its DOT trainer calls it: kd-loss backward, step_kd,
#: task-loss backward, step) on the float64 toy below, after three steps; momentum 0.9, delta 0.09,
#: lr 0.2, weight decay 1e-4 on every parameter. Per parameter (flattened): the parameter, the
#: label momentum and the distillation momentum (None where that part never reaches it).
GOLDEN = {
    "w1": {
        "param": [
            0.42294349885957894,
            0.506141190992812,
            0.3547634353113596,
            0.02461124012139241,
            -0.2960620451076659,
            -0.4741984190872419,
            -0.41752239791161927,
            -0.1560071184894565,
            0.18923517741510815,
            0.38381389851373354,
            0.4464725842776621,
            0.28301796267176693,
        ],
        "momentum_buffer": [
            0.006336718189689815,
            0.0008112931766977765,
            -0.004864894601601296,
            -0.007126516946797045,
            -0.010375505034511585,
            -0.012194946049918286,
            -0.02416111561473525,
            -0.02700216546352568,
            -0.02617315692267577,
            0.02394987086916173,
            0.00976338203489955,
            -0.00578539752908341,
        ],
        "distill_momentum_buffer": [
            -0.0038490929917999895,
            -0.0064181527226166435,
            -0.008118545591342652,
            -0.005036356355478369,
            -0.01631909829649511,
            -0.02539312683943212,
            -0.06084198906017578,
            -0.07374966087596328,
            -0.0766756620674883,
            0.05436076582548285,
            0.05879398006797702,
            0.05526970492329938,
        ],
    },
    "b1": {
        "param": [0.10136574011712801, 0.03324098712203602, -0.08763879449118067, -0.1293229909163715],
        "momentum_buffer": [0.015642764627943617, -0.007526199852259376, 0.09747508857394427, 0.007414619185886241],
        "distill_momentum_buffer": [
            -0.018431022996971847,
            0.03185882454885389,
            0.07784247852635481,
            0.06751796055312015,
        ],
    },
    "w2": {
        "param": [
            0.16202515865372596,
            -0.23684491312077058,
            -0.47595881595051903,
            -0.3895606846369044,
            -0.2975368312458696,
            0.07660941876670659,
            0.3838362910715762,
            0.44308380830225536,
            0.3409474559495008,
            0.06511466792055522,
            -0.25881810036984,
            -0.4952306880763723,
        ],
        "momentum_buffer": [
            -0.008770785695571777,
            -0.02522987343967563,
            -0.003725264730554137,
            -0.014147536253460546,
            0.007112125866787104,
            0.015969181611803836,
            0.007615946071259856,
            0.013527687560644722,
            0.0017093262062954327,
            0.009237232294082435,
            -0.003977233400488738,
            0.0005109108931683308,
        ],
        "distill_momentum_buffer": [
            -0.16698622020387283,
            -0.04728854780264157,
            0.0027951719630916272,
            -0.12735795304203804,
            0.0875258236859417,
            0.07754584712254424,
            0.038949948125202596,
            0.06929131667972066,
            0.07946039651793108,
            -0.030257299319902647,
            -0.04174512008829423,
            0.058066636362317334,
        ],
    },
    "b2": {
        "param": [0.03831183181749971, -0.20348720855879732, -0.08774695608203675],
        "momentum_buffer": [-0.07010230222143184, 0.03805936834834161, 0.03198055594561186],
        "distill_momentum_buffer": [-0.17482312828243762, 0.19186802099607825, -0.017044892713640666],
    },
    "task_bias": {
        "param": [-0.058299342755295296, -0.07824465921992313, -0.0027464293932051146],
        "momentum_buffer": [-0.07921260130545923, 0.04405222665913193, 0.03512262376245148],
        "distill_momentum_buffer": None,
    },
    "kd_scale": {
        "param": [1.270790845844742],
        "momentum_buffer": None,
        "distill_momentum_buffer": [0.058398459708532566],
    },
}


def toy():
    """The golden script's float64 toy, without random numbers: two linear layers; ``task_bias``
    reached by the label term only, ``kd_scale`` by the distillation term only."""

    def g(*shape, k):
        n = torch.Size(shape).numel()
        return torch.sin(torch.arange(n, dtype=torch.float64) * 0.7 + k).reshape(shape)

    params = {
        "w1": g(4, 3, k=1.0) * 0.5,
        "b1": g(4, k=2.0) * 0.1,
        "w2": g(3, 4, k=3.0) * 0.5,
        "b2": g(3, k=4.0) * 0.1,
        "task_bias": g(3, k=5.0) * 0.1,
        "kd_scale": torch.tensor([1.3], dtype=torch.float64),
    }
    return {k: p.requires_grad_(True) for k, p in params.items()}


def losses(params, step):
    """(label part, distillation part) of the toy's loss at ``step``: 0.5 CE and 0.5 KL at T 1."""
    x = torch.cos(torch.arange(18, dtype=torch.float64) * 0.37 + step).reshape(6, 3)
    y = torch.tensor([0, 1, 2, 1, 0, 2]).roll(step)
    t = torch.sin(torch.arange(18, dtype=torch.float64) * 0.53 + 2 * step).reshape(6, 3) * 2
    p = params
    z = F.relu(x @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"]
    task = 0.5 * F.cross_entropy(z + p["task_bias"], y)
    log_s = F.log_softmax(z * p["kd_scale"], dim=1)
    distill = 0.5 * F.kl_div(log_s, F.log_softmax(t, dim=1), reduction="batchmean", log_target=True)
    return task, distill


def optimizer(params):
    return DistillationOrientedSGD(list(params.values()), lr=LR, momentum=MOMENTUM, delta=DELTA, weight_decay=WD)


def assert_golden(params, opt):
    for name, p in params.items():
        state = opt.state[p]
        want = GOLDEN[name]
        torch.testing.assert_close(
            p.detach().reshape(-1), torch.tensor(want["param"], dtype=torch.float64), rtol=1e-9, atol=0
        )
        for key in ("momentum_buffer", "distill_momentum_buffer"):
            if want[key] is None:
                assert key not in state, (name, key)
            else:
                got = state[key].reshape(-1)
                torch.testing.assert_close(got, torch.tensor(want[key], dtype=torch.float64), rtol=1e-9, atol=0)


def test_the_optimizer_equals_the_official_step():
    """Given both gradients by hand (.grad and hold), three steps equal the official optimizer's:
    both momenta, weight decay in the label one, the one-part branches and their first step."""
    params = toy()
    opt = optimizer(params)
    for step in range(STEPS):
        task, distill = losses(params, step)
        apart = torch.autograd.grad(distill, list(params.values()), retain_graph=True, allow_unused=True)
        task.backward()
        opt.hold(list(params.values()), list(apart))
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert_golden(params, opt)


def policy_steps(precision, params, opt, make=losses, clip=None):
    """The toy's steps through kd's step policy; the skipped flags."""
    skipped = []
    for step in range(STEPS):
        task, distill = make(params, step)
        done = apply_gradients(precision, task, opt, params.values(), lambda: None, clip, apart=distill)
        skipped.append(bool(done))
    return skipped


def test_the_step_policy_equals_the_official_step():
    """kd's one step path with a distillation part apart (O0): the official numbers."""
    params = toy()
    opt = optimizer(params)
    assert policy_steps(Precision(torch.device("cpu")), params, opt) == [False] * STEPS
    assert_golden(params, opt)


def test_the_loss_scale_applies_to_both_gradients():
    """float16 loss scaling (a power of two: exact in float64): the same numbers as unscaled; the
    scale stays where nothing overflowed."""
    params = toy()
    opt = optimizer(params)
    precision = AutocastPrecision(torch.device("cpu"), torch.float16)
    assert precision.scaler is not None
    assert policy_steps(precision, params, opt) == [False] * STEPS
    assert_golden(params, opt)
    assert precision.scaler.get_scale() == 2.0**16


def test_a_nonfinite_distillation_gradient_skips_the_step_and_backs_the_scale_off():
    """inf in the distillation part alone: no parameter and no momentum moves, and the loss scale
    backs off as for any overflow; the next step trains."""
    params = toy()
    opt = optimizer(params)
    precision = AutocastPrecision(torch.device("cpu"), torch.float16)
    before = {k: p.detach().clone() for k, p in params.items()}

    def first_overflows(params, step):
        task, distill = losses(params, step)
        return task, distill * (float("inf") if step == 0 else 1.0)

    assert policy_steps(precision, params, opt, first_overflows) == [True, False, False]
    assert precision.scaler.get_scale() == 2.0**15
    params_once = toy()
    opt_once = optimizer(params_once)
    for step in (1, 2):  # the two steps that trained, alone
        task, distill = losses(params_once, step)
        apply_gradients(
            Precision(torch.device("cpu")), task, opt_once, params_once.values(), lambda: None, None, apart=distill
        )
    for k, p in params.items():
        assert not torch.equal(p, before[k]), k
        torch.testing.assert_close(p, params_once[k], rtol=1e-12, atol=0)


def test_clipping_bounds_the_norm_of_the_summed_gradient():
    """--grad-clip with DOT: both gradients scaled by one factor, the norm of their sum (the whole
    loss's gradient, which kd clips without DOT) at the clip."""

    def summed(pairs):
        return torch.cat([sum(t for t in pair if t is not None).reshape(-1) for pair in pairs])

    params = toy()
    opt = optimizer(params)
    task, distill = losses(params, 0)
    whole = torch.autograd.grad(task + distill, list(params.values()), retain_graph=True)
    full = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in whole])))
    clip = full / 4
    seen = []

    def hold(ps, gs):  # what the step gets: the norm of each parameter's two gradients summed
        seen.append(float(torch.linalg.vector_norm(summed((p.grad, g) for p, g in zip(ps, gs)))))

    opt.hold = hold
    apply_gradients(Precision(torch.device("cpu")), task, opt, params.values(), lambda: None, clip, apart=distill)
    assert abs(seen[0] - clip) < 1e-5 * clip  # clip_grad_norm_ divides by norm + 1e-6, (seen[0], clip, full)


@pytest.mark.parametrize(
    "options, says",
    [
        (dict(no_teacher=True), "no distillation part"),
        (dict(kd_loss="ce"), "no distillation part"),
        (dict(nesterov=True), "no --nesterov"),
        (dict(momentum=0.0), "--momentum above 0"),
        (dict(dot_delta=0.2, momentum=0.9), "momentum + delta below 1"),
        (dict(fused_optimizer=True), "fused_optimizer"),
        (dict(amp_impl="apex"), "--amp-impl native"),
    ],
)
def test_dot_is_refused_where_it_cannot_apply(tmp_path, options, says):
    with pytest.raises(KDError, match=says.replace("+", r"\+")):
        tiny_config("synthetic", tmp_path, dot=True, **options)


def test_a_method_with_parameters_of_its_own_is_refused(tmp_path):
    r = kd_main(*train_args("synthetic", tmp_path / "run", "--dot", kd_loss="ctkd"))
    assert "trains parameters of its own" in one_error_line(r)


#: the teacher and student of the in-process runs: timm's test_resnet (BatchNorm, 0.4 M parameters),
#: where DOT's state and its resume do not depend on the model's size (resnet18's two momenta made
#: each checkpoint 135 MB to write and hash)
SMALL_PAIR = dict(teacher="timm:test_resnet", student="timm:test_resnet")


def records(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", ["kd", "dkd"])
def test_dot_trains_and_resumes_exactly(image_folder, tmp_path, method):
    """--dot with a logit method: it trains (both momenta in the checkpoint), and a run stopped after
    an epoch and resumed ends bit-equal to the uninterrupted one."""
    options = dict(kd_loss=method, lr_schedule="constant", dot=True, **SMALL_PAIR)
    r = kd_main(*train_args(image_folder, tmp_path / "full", epochs=2, **options))
    assert r.returncode == 0, r.stderr
    r = kd_main(*train_args(image_folder, tmp_path / "part", epochs=1, **options))
    assert r.returncode == 0, r.stderr
    r = kd_main("train", "--out", tmp_path / "part", "--resume", "--epochs", 2)
    assert r.returncode == 0, r.stderr
    a, b = last_checkpoint(tmp_path / "full"), last_checkpoint(tmp_path / "part")
    assert a["global_step"] == b["global_step"] == 6
    for key, value in a["student"].items():
        assert torch.equal(value, b["student"][key]), key
    state = a["optimizer"]["state"]
    assert state and all({"momentum_buffer", "distill_momentum_buffer"} <= set(s) for s in state.values())
    for i, s in state.items():
        for key, value in s.items():
            assert torch.equal(value, b["optimizer"]["state"][i][key]), (i, key)
    assert all(r["train_skipped_steps"] == 0 for r in records(tmp_path / "part"))
    assert records(tmp_path / "full")[-1]["train_loss"] > 0


def test_dot_at_o2_keeps_float32_momenta_of_the_masters(image_folder, tmp_path):
    """O2 (bfloat16 weights, float32 masters): the distillation gradients go to the masters' dtype,
    both momenta are float32 beside them, and the run trains without a skipped step; --dot-delta
    reaches the optimizer."""
    options = dict(opt="O2", amp_dtype="bfloat16", dot=True, dot_delta=0.09, **SMALL_PAIR)
    r = kd_main(*train_args(image_folder, tmp_path / "run", **options))
    assert r.returncode == 0, r.stderr
    optimizer = last_checkpoint(tmp_path / "run")["optimizer"]
    assert {(g["momentum"], g["delta"]) for g in optimizer["param_groups"]} == {(0.9, 0.09)}
    state = optimizer["state"]
    assert state and all(v.dtype == torch.float32 for s in state.values() for v in s.values())
    assert all({"momentum_buffer", "distill_momentum_buffer"} <= set(s) for s in state.values())
    assert records(tmp_path / "run")[-1]["train_skipped_steps"] == 0


#: the runs of the two-process test: timm's test ViT (LayerNorms, no batch statistics; every one of
#: its tensors moves past the tolerance in these three steps) as teacher and student, kd with DOT,
#: one epoch
TWO_PROCESS_RUN = dict(teacher="timm:test_vit", student="timm:test_vit", kd_loss="kd", lr_schedule="constant")
TWO_PROCESS_RUN.update(workers=0, dot=True)


@pytest.fixture(scope="module")
def one_process(image_folder, tmp_path_factory):
    """The one-process run both backends are held equal to, in this process: the processes under
    test are the two of each backend's run."""
    out = tmp_path_factory.mktemp("dot") / "one"
    r = kd_main(*train_args(image_folder, out, **TWO_PROCESS_RUN))
    assert r.returncode == 0, r.stderr
    return last_checkpoint(out)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch_ddp", "apex_ddp"])
def test_two_processes_equal_one_process_of_the_same_global_batch(image_folder, tmp_path, one_process, backend):
    """Two processes over gloo: the distillation gradients, taken off DDP's reducer (torch_ddp) or
    kd's averager (apex_ddp, native on the CPU), are averaged by kd, the label gradients by the
    backend; a student without batch statistics (a ViT's LayerNorms) trains the same in two
    processes as in one."""
    r = run_kd(*train_args(image_folder, tmp_path / "two", "--backend", backend, "--nproc", 2, **TWO_PROCESS_RUN))
    assert r.returncode == 0, r.stderr
    one, two = one_process, last_checkpoint(tmp_path / "two")
    assert one["global_step"] == two["global_step"] == 3
    for key, value in one["student"].items():
        torch.testing.assert_close(two["student"][key], value, rtol=1e-4, atol=1e-5, msg=key)
    for i, s in one["optimizer"]["state"].items():
        for key, value in s.items():
            torch.testing.assert_close(two["optimizer"]["state"][i][key], value, rtol=1e-4, atol=1e-5, msg=key)
