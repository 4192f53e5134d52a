"""Terms on logits that several KD methods share: float32 or wider, logit standardisation (kd, dkd,
lskd, ctkd), DKD's two parts (dkd, ctdkd), mdistiller's warm-up (dkd, luminet). Pure functions on
tensors, below :mod:`kd.losses.base`."""

from __future__ import annotations

import math
from typing import Any, Tuple, Union

import torch
import torch.nn.functional as F

from kd.errors import KDError

#: added to the standard deviation in logit standardisation (the official value of Sun et al.)
STANDARDISE_EPS = 1e-7

# Subtracted from the target-class logit so that it drops out of the non-target softmax
# (the value of the official DKD implementation).
NON_TARGET_MASK = 1000.0


def float32_or_wider(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or as it is in float64 (the golden-value tests compute in float64)."""
    return x if x.dtype == torch.float64 else x.float()


def standardise(logits: torch.Tensor, eps: float = STANDARDISE_EPS) -> torch.Tensor:
    """Z-score of each row over the classes (Sun et al. 2024, "Logit Standardization in Knowledge
    Distillation", CVPR): (z - mean) / (std + eps), unbiased std, in float32 (float64 stays)."""
    z = float32_or_wider(logits)
    return (z - z.mean(dim=1, keepdim=True)) / (z.std(dim=1, keepdim=True) + eps)


def warmup_ramp(progress: float, warmup: float) -> float:
    """mdistiller's warm-up factor min(epoch / warmup, 1) at ``progress`` (epochs), the epoch counted from
    1 as its trainer passes it and fixed within an epoch; ``warmup`` 0: no warm-up (1)."""
    epoch = math.floor(progress) + 1
    return min(epoch / warmup, 1.0) if warmup > 0 else 1.0


def standardise_switch(method: str, value: Any) -> bool:
    """The ``standardise`` hyper-parameter of ``method`` as a bool; KDError unless it is 0 or 1."""
    if value not in (0, 1):
        raise KDError(f"KD loss {method!r}: standardise must be 0 or 1, got {value!r}")
    return bool(value)


def standardised(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, on: bool
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both sides' logits z-scored (:func:`standardise`) where ``on``, else as they are."""
    if not on:
        return student_logits, teacher_logits
    return standardise(student_logits), standardise(teacher_logits.detach())


def without_target(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(N, C - 1): each row of (N, C) ``x`` without its ``labels`` column, the rest in class order.
    Gathered at indices computed on the device: a boolean mask's selection would wait for the host
    to learn its size (a sync every step, and a break in torch.compile's graph)."""
    rest = torch.arange(x.shape[1] - 1, device=x.device).expand(x.shape[0], -1)
    return x.gather(1, rest + (rest >= labels.reshape(-1, 1)).long())


def binary_log_probs(log_p: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
    """(N, 2) log-probabilities of (the target class, all the others) from (N, C) ``log_p``.

    Through logsumexp: log(1 - p) would lose every digit once the target probability rounds to 1.
    """
    target = log_p.masked_fill(~gt, float("-inf")).logsumexp(1)
    others = log_p.masked_fill(gt, float("-inf")).logsumexp(1)
    return torch.stack([target, others], dim=1)


def dkd_rows(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: Union[float, torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(TCKD, NCKD) of each row, (N,) each, T^2-scaled, in float32 (float64 stays): :func:`dkd_parts`
    before the batch mean."""
    t = temperature
    s = float32_or_wider(student_logits) / t
    z = float32_or_wider(teacher_logits.detach()) / t
    if labels.dim() != 1:
        raise KDError("DKD (dkd, ctdkd) needs class-index labels; soft labels (mixup, cutmix) have no target class")
    gt = torch.zeros_like(s, dtype=torch.bool).scatter_(1, labels.reshape(-1, 1), True)

    log_bin_s = binary_log_probs(F.log_softmax(s, dim=1), gt)
    log_bin_t = binary_log_probs(F.log_softmax(z, dim=1), gt)
    tckd = F.kl_div(log_bin_s, log_bin_t, reduction="none", log_target=True).sum(1) * (t * t)

    offset = NON_TARGET_MASK * gt.to(s.dtype)
    log_q_s = F.log_softmax(s - offset, dim=1)
    log_q_t = F.log_softmax(z - offset, dim=1)
    nckd = F.kl_div(log_q_s, log_q_t, reduction="none", log_target=True).sum(1) * (t * t)
    return tckd, nckd


def dkd_parts(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: Union[float, torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(TCKD, NCKD), each T^2-scaled and averaged over the batch, in float32 (float64 stays).

    TCKD is the KL divergence between the binary (target, all non-targets) distributions
    of teacher and student; NCKD the KL divergence between their distributions over the
    non-target classes only. The teacher's side is in log space too: its non-target distribution
    is exactly 0 at the target class, and the gradient of a learned (tensor) ``temperature``
    through ``p * log p`` there is 0 here, where the official code's is NaN on current torch (0 * log 0).
    """
    tckd, nckd = dkd_rows(student_logits, teacher_logits, labels, temperature)
    return tckd.mean(), nckd.mean()
