"""DOT, the Distillation-Oriented Trainer (Zhao et al., ICCV 2023, https://arxiv.org/abs/2307.08436):
SGD that keeps the gradient of the label part of the loss and that of its distillation part apart,
each with a momentum of its own (``momentum - delta`` and ``momentum + delta``).

Held equal to the official step (megvii-research/mdistiller ``mdistiller/engine/dot.py``) in
``tests/test_dot.py``. The step policy (:func:`kd.run.step.apply_gradients`) gets the distillation
gradients from the precision apart from ``.grad``, averages them across processes here, and hands
them to :meth:`DistillationOrientedSGD.hold` before the optimizer's step.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from kd.errors import KDError


class DistillationOrientedSGD(torch.optim.Optimizer):
    """SGD with two momentum buffers per parameter: ``momentum_buffer`` for the gradient in
    ``.grad`` (the label part's), ``distill_momentum_buffer`` for the distillation gradient handed
    in by :meth:`hold`; both in the optimizer's state, so a checkpoint keeps them.

    Per parameter, with ``m_task = momentum - delta``, ``m_distill = momentum + delta`` and the
    group's ``weight_decay`` ``wd``, as the official step does it:

    * reached by both parts: ``b_task = m_task * b_task + (g_task + wd * p)`` and
      ``b_distill = m_distill * b_distill + g_distill``; weight decay enters the label momentum only;
    * reached by one part only: that part's buffer at ``(m_task + m_distill) / 2`` (``momentum``),
      weight decay in it;
    * a buffer's first value is its gradient as it is (with the decay in the label buffer; the
      official leaves the decay out of a first distillation-only buffer, and so does this one);
    * ``p -= lr * b_task``, then ``p -= lr * b_distill``.

    No dampening and no Nesterov (the official has neither). Each param group keeps its own
    ``weight_decay`` (the official takes one group).
    """

    def __init__(self, params, lr: float, momentum: float, delta: float, weight_decay: float = 0.0):
        if not 0.0 <= delta <= momentum:
            raise ValueError(f"delta must be in [0, momentum], got {delta}")
        super().__init__(params, dict(lr=lr, momentum=momentum, delta=delta, weight_decay=weight_decay))
        self._distill: Dict[int, torch.Tensor] = {}

    def hold(self, params: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]]) -> None:
        """The distillation gradients of ``params`` (the optimizer's own tensors; None where the
        distillation part does not reach one) for the next :meth:`step`."""
        self._distill = {id(p): g for p, g in zip(params, grads) if g is not None}

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._distill = {}

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        assert closure is None, "DistillationOrientedSGD takes no closure"
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            m_task = group["momentum"] - group["delta"]
            m_distill = group["momentum"] + group["delta"]
            m_one = (m_distill + m_task) / 2.0  # the official's momentum where one part alone reaches a parameter
            for p in group["params"]:
                task, distill = p.grad, self._distill.get(id(p))
                state = self.state[p]
                if task is not None:
                    d_p = task.add(p, alpha=wd) if wd else task
                    _momentum(state, "momentum_buffer", d_p, m_task if distill is not None else m_one)
                    p.add_(state["momentum_buffer"], alpha=-lr)
                if distill is not None:
                    if task is None and wd and "distill_momentum_buffer" in state:
                        distill = distill.add(p, alpha=wd)
                    _momentum(state, "distill_momentum_buffer", distill, m_distill if task is not None else m_one)
                    p.add_(state["distill_momentum_buffer"], alpha=-lr)
        self._distill = {}
        return None


def _momentum(state: dict, key: str, grad: torch.Tensor, momentum: float) -> None:
    """``state[key] = momentum * state[key] + grad``; ``grad`` itself (a copy) where there is none yet."""
    buf = state.get(key)
    if buf is None:
        state[key] = torch.clone(grad).detach()
    else:
        buf.mul_(momentum).add_(grad)


def average(grads: List[Optional[torch.Tensor]], world_size: int, all_reduce_sum) -> None:
    """``grads`` (in place) averaged over the ``world_size`` processes through the backend's
    ``all_reduce_sum``, one flat tensor per dtype; a missing gradient counts as zero there (as
    DistributedDataParallel counts it), so every process steps the same parameters."""
    if world_size == 1:
        return
    if any(g is None for g in grads):
        raise KDError("--dot over several processes needs every trainable parameter reached by the distillation part")
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for g in grads:
        assert g is not None
        by_dtype.setdefault(g.dtype, []).append(g)
    for tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in tensors]).div_(world_size)  # divided first, as DDP does
        flat = all_reduce_sum(flat)
        torch._foreach_copy_(tensors, [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors)])


def clip_total(params: List[torch.Tensor], apart: List[Optional[torch.Tensor]], max_norm: float) -> None:
    """Both gradients of each of ``params`` (``.grad`` and its gradient kept ``apart``) scaled by one
    factor, so that the norm of their sum, the whole loss's gradient that kd clips without DOT, is
    at most ``max_norm`` (``clip_grad_norm_``'s factor, ``max_norm / (norm + 1e-6)`` at most 1)."""
    totals, both = [], []
    for p, g in zip(params, apart):
        parts = [t for t in (p.grad, g) if t is not None]
        if parts:
            totals.append(parts[0] if len(parts) == 1 else parts[0] + parts[1])
            both += parts
    if not totals:
        return
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(totals)).float())
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(both, factor.to(both[0].device))


def check_applies(loss: nn.Module, splits_gradients: bool, method: str) -> None:
    """KDError where DOT cannot train this student: a precision that gives one gradient per step
    (apex.amp), or a method with trainable parameters of its own (connectors, a learned
    temperature), which DOT's two student momenta do not cover."""
    if not splits_gradients:
        raise KDError(
            "--dot keeps the distillation gradient apart from the label gradient; apex.amp unscales and "
            "checks one gradient per step inside its scale_loss: use --amp-impl native"
        )
    own = [name for name, p in loss.named_parameters() if p.requires_grad]
    if own:
        raise KDError(
            f"--dot steps the student's parameters with two momenta; --kd-loss {method} trains parameters of its "
            f"own ({', '.join(own[:3])}{', ..' if len(own) > 3 else ''}): use DOT with a logit method (kd, dkd, ..)"
        )
