"""NVIDIA apex.amp itself as kd's precision object (``--amp-impl apex``, or apex_ddp's preference).

apex is imported here only, and only when asked for; deleting this file leaves the rest of kd
working (``--amp-impl apex`` then says so). apex.amp was removed from NVIDIA apex in May 2025
(commit cb65b8e, "remove old features: amp, ddp, and rnn"); the last release tag that has it
is 25.05. The native opt levels in :mod:`kd.precision.native` mean the same O0-O3 without apex.

What kd asks of apex.amp, per level:

* ``amp.initialize(models, optimizer, opt_level=..., loss_scale="dynamic" at O1/O2)``, once,
  in ``convert()`` (after the optimizer is built, before the backend wraps the model). The
  models handed to apex are the student side without its KD loss module, which stays float32
  with its inputs cast up (as in the native levels), so the KD softmax never runs in float16.
* the teacher: it has its own precision (:mod:`kd.teacher.precision`) on torch.autocast; at O1 apex's
  globally patched torch functions are switched off around its forward (as
  ``amp.disable_casts()`` does, but back on even when the forward raises), so a teacher that
  kd runs in bfloat16 or float32 stays so.
* each step: ``amp.scale_loss(loss, optimizer)`` around backward and the gradient sync, clip
  on ``amp.master_params(optimizer)``, ``optimizer.step()``. At O1/O2 (dynamic scale) apex
  skips that step on overflow; at O0/O3 (a static scale of 1) apex checks nothing, so kd checks
  the gradients itself and skips as the native levels do;
* checkpoints: the float32 master weights at O2 (apex's own ``state_dict`` hook would give
  the float16 weights upcast), and ``amp.state_dict()`` (loss scale and its counter).

apex.amp does float16 only: ``--amp-impl apex --amp-dtype bfloat16`` is an error (use the
native levels for bfloat16); apex_ddp with ``--amp-impl auto`` and bfloat16 runs native
precision and says so in the log.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional

import torch
from torch import nn

from kd.precision.native import (
    AutocastPrecision,
    MasterStateMixin,
    Precision,
    keep_losses_float32,
    nonfinite_gradients,
    step_unless,
)

REMOVED = "apex.amp was removed from NVIDIA apex in May 2025; the last release tag with it is 25.05"


def _import_amp():
    """``apex.amp``, or the reason it cannot be imported."""
    try:
        import apex
    except ImportError:
        return None, (
            f"NVIDIA apex is not installed ({REMOVED}: install that tag, or use "
            f"--amp-impl native, the same opt levels on torch.amp)"
        )
    except Exception as exc:  # a broken build (compiled for another torch, say)
        return None, f"importing apex failed: {type(exc).__name__}: {str(exc)[:120]}; use --amp-impl native"
    try:
        from apex import amp
    except ImportError:
        version = getattr(apex, "__version__", "")
        return None, (
            f"the installed apex{' ' + version if version else ''} has no apex.amp ({REMOVED}); "
            f"install 25.05 or earlier, or use --amp-impl native"
        )
    except Exception as exc:
        return None, f"importing apex.amp failed: {type(exc).__name__}: {str(exc)[:120]}; use --amp-impl native"
    return amp, None


def unavailable(cfg, device: torch.device) -> Optional[str]:
    """Why apex.amp cannot run this config here, or None when it can."""
    amp, reason = _import_amp()
    if amp is None:
        return reason
    if device.type != "cuda":
        return "apex.amp needs CUDA; on the CPU use --amp-impl native"
    if cfg.amp_dtype == "bfloat16" and cfg.opt != "O0":
        return "apex.amp does float16 only; for bfloat16 use --amp-impl native"
    return None


@contextlib.contextmanager
def _casts_off(handle):
    """apex.amp's ``disable_casts()``, which turns its patched casts back on even when the block
    raises (apex's own leaves them off for the rest of the process then)."""
    was = handle._is_active
    handle._is_active = False
    try:
        yield
    finally:
        handle._is_active = was


class ApexAmpPrecision(MasterStateMixin, Precision):
    """apex.amp at ``cfg.opt``; float16 at O1-O3 (float32 at O0)."""

    impl = "apex"
    fused_optimizer_ok = False  # amp.initialize patches the optimizer's step
    one_per_process = True  # amp.initialize patches torch for the process: one student per run
    splits_gradients = False  # scale_loss unscales and checks one gradient per step (no DOT)

    def __init__(self, cfg, device: torch.device):
        amp, reason = _import_amp()
        if amp is None:  # unavailable() was asked first; this is for direct use
            from kd.errors import KDError

            raise KDError(f"--amp-impl apex: {reason}")
        super().__init__(device, torch.float32 if cfg.opt == "O0" else torch.float16)
        self.amp = amp
        self.opt = cfg.opt
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self._before: Optional[tuple] = None  # the dynamic scaler's state before this step's backward

    @property
    def master_weights(self) -> bool:
        return self.opt == "O2"

    def details(self) -> List[str]:
        return {
            "O0": ["float32"],
            "O1": ["float32 weights, patched torch functions in float16"],
            "O2": ["float16 weights, BatchNorm float32, float32 master weights"],
            "O3": ["float16 weights"],
        }[self.opt]

    def describe(self) -> str:
        scaling = "dynamic loss scaling" if self.opt in ("O1", "O2") else "no loss scaling"
        return f"precision {self.opt} (apex, {', '.join(self.details())}, {scaling})"

    def other_model_context(self):
        """At O1 (once amp.initialize has patched torch's functions), those patches off."""
        handle = getattr(self.amp._amp_state, "handle", None)
        if self.opt == "O1" and handle is not None:
            return _casts_off(handle)
        return super().other_model_context()

    def input_cast(self, images: torch.Tensor) -> torch.Tensor:
        return images.to(self.dtype) if self.opt in ("O2", "O3") else images

    def for_float32_copy(self) -> Precision:
        return AutocastPrecision(self.device, self.dtype) if self.opt in ("O2", "O3") else self

    def convert(self, model, optimizer):
        losses = keep_losses_float32(model)
        models = [m for m in model.children() if m not in losses] if losses else [model]
        kwargs = {"loss_scale": "dynamic"} if self.opt in ("O1", "O2") else {}
        _, optimizer = self.amp.initialize(models, optimizer, opt_level=self.opt, verbosity=0, **kwargs)
        self.optimizer = optimizer
        return model, optimizer

    @property
    def dynamic(self) -> bool:
        """O1/O2 scale the loss dynamically, and only then does apex check the gradients and skip."""
        return self.opt in ("O1", "O2")

    def backward(self, loss, sync):
        scaler = self._scaler()
        self._before = (scaler._loss_scale, scaler._unskipped) if scaler is not None else None
        with self.amp.scale_loss(loss, self.optimizer) as scaled:
            scaled.backward()
            sync()  # inside: apex unscales and (O1/O2) checks for overflow on leaving the block

    def unscale(self, optimizer, params, apart=None):
        assert apart is None, "apex.amp keeps no gradients apart (splits_gradients is False)"
        masters = list(self.amp.master_params(optimizer))
        if self.dynamic:  # apex checked on leaving scale_loss, and patched step() to skip once
            skipped = bool(getattr(optimizer._amp_stash, "already_patched", False))
            return masters, torch.tensor(float(skipped), device=self.device)
        # O0/O3: a static scale of 1, with which apex checks nothing and steps on anything (its
        # LossScaler skips only when dynamic): kd's own check, as the native levels do
        return masters, nonfinite_gradients(masters, self._found, self._one)

    def optimizer_step(self, optimizer, found):
        if self.dynamic:
            optimizer.step()  # apex's patched step skips where it found an overflow, and unpatches itself
        else:
            step_unless(optimizer, found)

    def update(self, found, keep_scale=None):
        scaler, before = self._scaler(), self._before
        if self.dynamic and scaler is not None and before is not None and keep_scale is not None:
            if bool(found) and bool(keep_scale):  # apex has synced already: host reads are free
                scaler._loss_scale, scaler._unskipped = before

    def finish(self, optimizer):
        optimizer.zero_grad()  # apex's O2 zero_grad takes no arguments

    def _scaler(self):
        scalers = getattr(self.amp._amp_state, "loss_scalers", None)
        return scalers[0] if scalers else None

    def loss_scale(self) -> torch.Tensor:
        scaler = self._scaler()
        return torch.tensor(float(scaler.loss_scale()) if scaler is not None else 1.0)

    def _named_masters(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        if not self.master_weights or self.optimizer is None:
            return {}
        # apex.amp.initialize adds _amp_lazy_init and _amp_stash to the optimizer (not in the Optimizer stubs)
        self.optimizer._amp_lazy_init()  # type: ignore[attr-defined]  # apex makes its masters lazily, at the first backward
        stash = self.optimizer._amp_stash  # type: ignore[attr-defined]
        master_of = {id(p): m for p, m in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params)}
        return {
            name: master_of[id(p)] for name, p in model.named_parameters(remove_duplicate=False) if id(p) in master_of
        }

    def state_dict(self) -> dict:
        return {"opt": self.opt, "impl": self.impl, "dtype": "float16", "amp": self.amp.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("amp"):
            self.amp.load_state_dict(state["amp"])
