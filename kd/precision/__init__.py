"""Opt levels as apex users know them, on native torch.amp (or on real apex.amp, see below).

One precision object per student owns the mechanics of reduced precision: the autocast context,
casting of the model and inputs, master weights, the loss scaler, and the pieces of an update
(scaled backward, unscale with a non-finite flag, optimizer step, scale update, zero). The
engine's step (:func:`kd.run.step.apply_gradients`) calls those pieces in order, clips, and
decides whether a step is skipped; nothing outside this package touches a scaler. The frozen
teacher's autocast is its own precision's (:mod:`kd.teacher.precision`).

| level | student | loss scaling (float16) |
|---|---|---|
| O0 | float32 everywhere | none |
| O1 | float32 weights; ops in reduced precision where torch.autocast deems them safe | dynamic |
| O2 | weights in reduced precision except BatchNorm (float32); float32 master weights in the optimizer | dynamic |
| O3 | everything in reduced precision, no master weights: a speed ceiling, not a recipe | none |

The frozen teacher has a precision of its own (:mod:`kd.teacher.precision`, ``--teacher-precision``): by
default the run's dtype (float32 at O0), its conv/linear weights stored in that dtype under
autocast at every level, with a fallback checked on validation batches before training.

The reduced dtype is ``--amp-dtype`` (float16 on CUDA as in apex, bfloat16 on the CPU).
bfloat16 has float32's exponent range, so it never needs loss scaling; float16 at O1/O2 gets a
dynamic scaler with apex's and GradScaler's schedule: start at 2**16, halve on a step with
inf/NaN gradients (the step is skipped and counted), double after 2000 finite steps.

Numerics that hold at every level:

* Teacher logits enter the KD loss in float32 (:class:`kd.teacher.frozen.TeacherSide` casts them,
  and the KD module computes its softmaxes in float32). The dark knowledge lives in the small
  probabilities the teacher gives the wrong classes. A log-softmax in float16 at a low
  temperature loses them: ``logits / T`` is rounded again to ~3 significant digits (bfloat16:
  ~2), so nearby non-top classes merge, and ``exp`` of log-probabilities below about -17
  underflows (float16's smallest value is 6e-8), so those classes drop out of
  ``KL(p_t || p_s)`` and of its gradient ``p_s - p_t``. The cast up is exact; the softmax,
  which needs the range and precision, runs in float32.
* At O2/O3 the KD loss module (and the connectors of feature methods) stays float32: a
  forward pre-hook casts its inputs (student logits, tapped features) to float32, like apex's
  cast of model outputs to float32. Under O1 it runs inside the student's autocast.
* Checkpoints always hold float32 tensors: the master weights at O2, upcast weights at O3.
  So a run trained at any level resumes at any other, and ``kd eval`` reads it at O0.

``make_precision`` picks the object, in one place for every run. ``--amp-impl apex`` (or a backend's
``prefers_apex_amp`` with ``--amp-impl auto``) uses NVIDIA apex.amp itself, from :mod:`kd.precision.apex`;
``describe()`` always says which implementation runs and why, never falling back silently.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from kd.errors import KDError
from kd.precision.native import (
    DTYPES,
    NATIVE,
    AutocastPrecision,
    CastPrecision,
    MasterStateMixin,
    MasterWeightPrecision,
    Precision,
    amp_dtype,
    cast_module,
    dtype_name,
    float32_state,
    keep_losses_float32,
    make_scaler,
    nonfinite_gradients,
    step_unless,
    to_float32,
)

__all__ = [
    "DTYPES",
    "NATIVE",
    "AutocastPrecision",
    "CastPrecision",
    "MasterStateMixin",
    "MasterWeightPrecision",
    "Precision",
    "amp_dtype",
    "cast_module",
    "dtype_name",
    "float32_state",
    "keep_losses_float32",
    "make_precision",
    "make_scaler",
    "nonfinite_gradients",
    "step_unless",
    "to_float32",
]


def make_precision(cfg, device: torch.device, prefer_apex: bool = False) -> Precision:
    """The precision object for ``cfg.opt``: native torch.amp, or real apex.amp where asked.

    ``--amp-impl apex`` uses apex.amp or fails with a KDError saying why it cannot.
    ``prefer_apex`` is a backend's wish (apex_ddp): with ``--amp-impl auto`` it uses apex.amp
    where it can run and otherwise native, with the reason in ``describe()``.
    """
    impl = cfg.amp_impl
    note = None
    if impl == "apex" or (impl == "auto" and prefer_apex and cfg.opt != "O0"):
        apex_amp: Optional[ModuleType]
        try:
            from kd.precision import apex as apex_amp
        except ImportError as exc:  # the optional module deleted: the rest keeps working
            if getattr(exc, "name", "") != "kd.precision.apex":
                raise
            apex_amp = None
        reason = apex_amp.unavailable(cfg, device) if apex_amp else "kd's kd/precision/apex.py is not installed"
        if reason is None and apex_amp is not None:  # no reason only where the module imported
            return apex_amp.ApexAmpPrecision(cfg, device)
        if impl == "apex":
            raise KDError(f"--amp-impl apex: {reason}")
        note = f"not apex.amp: {reason.split(';')[0].split(' (')[0]}"
    if cfg.opt == "O0":
        return Precision(device, note=note)
    return NATIVE[cfg.opt](device, amp_dtype(cfg, device), note=note)
