"""kd.run.optim: fused SGD survives a first step skipped by the loss scaler."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kd.run.optim import zero_momentum_buffers


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _grads(model, seed, dtype=torch.float32):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    model(torch.randn(4, 6).to(dtype)).square().sum().backward()


def _step(opt, found_inf: bool):
    """One step as torch's GradScaler drives an optimizer with built-in amp support."""
    opt.grad_scale = None
    opt.found_inf = torch.tensor(float(found_inf))
    opt.step()


@pytest.mark.parametrize("nesterov", [False, True])
def test_skipped_first_step_leaves_fused_sgd_finite_and_equal_to_foreach(nesterov):
    fused_model, ref_model = _model(), _model()
    fused = torch.optim.SGD(fused_model.parameters(), lr=0.1, momentum=0.9, nesterov=nesterov, fused=True)
    zero_momentum_buffers(fused)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9, nesterov=nesterov, foreach=True)
    before = copy.deepcopy(fused_model.state_dict())

    _grads(fused_model, 1)
    _step(fused, found_inf=True)  # skipped: the scaler found inf gradients; foreach is simply not stepped
    assert all(torch.equal(v, before[k]) for k, v in fused_model.state_dict().items())
    assert all(torch.equal(fused.state[p]["momentum_buffer"], torch.zeros_like(p)) for p in fused_model.parameters())

    for seed in (2, 3, 4):
        _grads(fused_model, seed)
        _step(fused, found_inf=False)
        _grads(ref_model, seed)
        ref.step()
    for (k, a), b in zip(fused_model.state_dict().items(), ref_model.state_dict().values()):
        torch.testing.assert_close(a, b, msg=k)


def test_buffers_are_only_added_where_plain_momentum_applies():
    model = _model()
    no_momentum = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    zero_momentum_buffers(no_momentum)
    assert not no_momentum.state
    damped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5, fused=True)
    zero_momentum_buffers(damped)  # a zero buffer would change a damped first step: left to torch
    assert not damped.state


def test_buffers_take_the_dtype_of_parameters_cast_after_the_optimizer_is_built():
    """As at O3: the model is cast to the reduced dtype after the optimizer exists."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    zero_momentum_buffers(opt)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    _grads(model, 1, torch.bfloat16)
    _step(opt, found_inf=True)
    _step(opt, found_inf=False)
    assert all(opt.state[p]["momentum_buffer"].dtype == torch.bfloat16 for p in model.parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_loaded_state_is_kept():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    _grads(model, 1)
    opt.step()
    state = copy.deepcopy(opt.state_dict())
    resumed = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    zero_momentum_buffers(resumed)
    resumed.load_state_dict(state)
    _grads(model, 2)
    _step(resumed, found_inf=True)  # a skipped step keeps the loaded momentum
    for p, saved in zip(model.parameters(), state["state"].values()):
        assert torch.equal(resumed.state[p]["momentum_buffer"], saved["momentum_buffer"])


# ----------------------------------------------------------------------------- timm's optimizers and schedules
def _side(model_name: str):
    """A StudentSide of timm model ``model_name`` (random weights) with a loss of one trainable module."""
    import timm

    from kd.run.sides import StudentSide

    loss = nn.Module()
    loss.connector = nn.Linear(4, 4)
    return StudentSide(timm.create_model(model_name, num_classes=5), loss, [])


def _config(**options):
    from kd import config as kd_config

    return kd_config.resolve(options={"data": "synthetic", "student": "timm:test_vit", "no_teacher": True, **options})


def _grouping(optimizer) -> list:
    """Each group's parameters (by identity), weight decay and lr, in order."""
    return [([id(p) for p in g["params"]], g["weight_decay"], g["lr"]) for g in optimizer.param_groups]


@pytest.mark.parametrize("name, layer_decay", [("adamw", None), ("lamb", None), ("adamw", 0.65)])
def test_timm_optimizers_are_timms_own_on_the_student(name, layer_decay):
    """The student's groups (which parameters decay, each group's lr with layer decay) and the
    optimizer's class and defaults are those of timm's create_optimizer_v2 on the model; the loss's
    trainable modules come after, grouped as timm would group them."""
    from timm.optim import create_optimizer_v2

    from kd.run.optim import build_optimizer

    side = _side("test_vit")
    cfg = _config(optimizer=name, lr=5e-4, weight_decay=0.05, layer_decay=layer_decay)
    ours = build_optimizer(cfg, side, fused_ok=False)
    theirs = create_optimizer_v2(side.student, opt=name, lr=5e-4, weight_decay=0.05, layer_decay=layer_decay)
    assert type(ours) is type(theirs)
    student_groups = _grouping(ours)[: len(theirs.param_groups)]
    expected = [
        (ids, wd, 5e-4 * g.get("lr_scale", 1.0)) for (ids, wd, _), g in zip(_grouping(theirs), theirs.param_groups)
    ]
    assert student_groups == expected
    loss_ids = {id(p) for p in side.loss.parameters()}
    assert {i for ids, _, _ in _grouping(ours)[len(theirs.param_groups) :] for i in ids} == loss_ids
    assert {k: v for k, v in ours.defaults.items() if k != "foreach"} == {
        k: v for k, v in theirs.defaults.items() if k != "foreach"
    }
    # one step from equal weights and gradients: equal weights
    twin = copy.deepcopy(side)
    theirs = create_optimizer_v2(
        twin.student, opt=name, lr=5e-4, weight_decay=0.05, layer_decay=layer_decay, foreach=True
    )  # kd's foreach (a single-tensor loop rounds otherwise)
    for module in (side.student, twin.student):
        torch.manual_seed(0)
        module(torch.randn(2, 3, 32, 32)).sum().backward()
    if layer_decay is not None:  # timm's scheduler puts each group's scale on its lr; kd's groups carry it
        for g in theirs.param_groups:
            g["lr"] = 5e-4 * g["lr_scale"]
    ours.step()
    theirs.step()
    for a, b in zip(side.student.parameters(), twin.student.parameters()):
        assert torch.equal(a, b)


def test_timm_cosine_steps_as_timms_scheduler_per_update():
    """--lr-schedule timm-cosine gives, at every update, the lr of timm's CosineLRScheduler as
    create_scheduler_v2(step_on_epochs=False) makes it: warm-up from --warmup-lr, cosine to --min-lr."""
    from timm.scheduler import create_scheduler_v2

    from kd.run.optim import build_scheduler

    epochs, per_epoch = 5, 7
    cfg = _config(lr=0.5, epochs=epochs, lr_schedule="timm-cosine", warmup_epochs=1, warmup_lr=1e-4, min_lr=1e-3)
    param = nn.Parameter(torch.zeros(1))
    ours = build_scheduler(cfg, torch.optim.SGD([param], lr=0.5), per_epoch)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    theirs, _ = create_scheduler_v2(
        opt, sched="cosine", num_epochs=epochs, warmup_epochs=1, warmup_lr=1e-4, min_lr=1e-3,
        step_on_epochs=False, updates_per_epoch=per_epoch,
    )  # fmt: skip
    for update in range(epochs * per_epoch + 3):
        theirs.step_update(update)
        assert ours.get_last_lr()[0] == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15), update
        ours.optimizer.step()
        ours.step()


def test_cosine_ends_at_min_lr_and_is_unchanged_without_it():
    from kd.run.optim import lr_factor

    plain = _config(lr=0.1, epochs=10, lr_schedule="cosine")
    floored = _config(lr=0.1, epochs=10, lr_schedule="cosine", min_lr=0.01)
    for epoch in (0.0, 2.5, 7.0, 9.99):
        expected = 0.5 * (1.0 + __import__("math").cos(__import__("math").pi * epoch / 10))
        assert lr_factor(plain, epoch) == expected  # bit for bit: the CNN table's runs do not move
    assert lr_factor(floored, 10.0) == pytest.approx(0.1)
    assert lr_factor(floored, 0.0) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "options, words",
    [
        ({"optimizer": "adamww"}, ["adamww", "adamw"]),
        ({"warmup_lr": 1e-6}, ["--warmup-lr", "timm-cosine"]),
        ({"min_lr": 1e-5}, ["--min-lr", "step"]),
        ({"optimizer": "adamw", "dot": True}, ["--dot", "adamw"]),
        ({"opt_eps": 1e-8}, ["--opt-eps", "SGD"]),
        ({"layer_decay": 0.7, "student": "squeezenet1_1", "optimizer": "adamw"}, ["--layer-decay", "squeezenet1_1"]),
    ],
    ids=["unknown optimizer", "warmup-lr", "min-lr", "dot", "eps", "layer decay"],
)
def test_optimizer_options_that_cannot_apply_are_one_line(options, words, tmp_path):
    from conftest import kd_main

    args = [
        a
        for k, v in options.items()
        for a in ([f"--{k.replace('_', '-')}"] if v is True else [f"--{k.replace('_', '-')}", v])
    ]
    if "student" not in options:
        args += ["--student", "timm:test_vit"]
    tiny = ["--image-size", "32", "-b", "2", "--epochs", "1", "--limit-train-batches", "1", "--limit-val-batches", "1"]
    r = kd_main(
        "train", "--data", "synthetic", "--no-teacher", "--device", "cpu", *tiny, "--out", tmp_path / "r", *args
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert all(w in r.stderr for w in words), r.stderr
    assert not (tmp_path / "r").exists()


def test_a_run_with_timms_lamb_and_schedule_resumes_bit_for_bit(tmp_path, image_folder):
    """kd train --optimizer lamb --lr-schedule timm-cosine as a user types it: resumed from a
    checkpoint of its fourth step (mid-epoch), it ends bit for bit where it ended (LAMB's state, the schedule)."""
    from conftest import resumes_bit_for_bit

    args = ["--data", image_folder, "--student", "timm:test_resnet", "--no-teacher", "--image-size", "32", "-b", "8"]
    args += ["--device", "cpu", "--workers", "0", "--optimizer", "lamb", "--lr", "0.01", "--weight-decay", "0.02"]
    args += ["--lr-schedule", "timm-cosine", "--warmup-epochs", "1", "--warmup-lr", "1e-4", "--min-lr", "1e-4"]
    args += ["--epochs", "2", "--save-every-steps", "2", "--keep-last", "9"]
    resumes_bit_for_bit(tmp_path, args, 4)
