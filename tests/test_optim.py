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
