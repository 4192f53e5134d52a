"""apex's DistributedDataParallel(delay_allreduce=True): real apex where importable and right for
the run, else the same algorithm natively.

The algorithm: parameters and buffers are broadcast from rank 0 once, at wrap time; after the
whole backward pass, the gradients of every parameter that requires grad are averaged in flat
buckets of about 25 MB, one all_reduce per bucket. A missing gradient counts as zero, so a
parameter that a process did not use can neither hang the run nor need
``find_unused_parameters``; a parameter that no process used keeps no gradient, as on one device.

Real apex.parallel (25.04) is wrong for some runs; ``convert_model`` decides, before the optimizer
and precision are built, and ``describe()`` says what it chose and why:

* bfloat16 weights (O2/O3 with ``--amp-dtype bfloat16``): apex all-reduces half, float and double
  gradients only (``split_half_float_double``), so the native averager runs;
* parameters that may get no gradient (``--find-unused-parameters``, or found as torch_ddp finds
  them, or trainable parameters in the loss): apex buckets only the gradients present, which can
  differ between processes (a hang, or averages of the wrong tensors), so the native averager runs;
* channels_last: with its ``amp_C`` extension built, apex copies the averaged gradients back
  through raw memory (``multi_tensor_scale``), which permutes those of channels_last convolution
  weights; under real apex the student's parameters stay contiguous (activations may stay
  channels_last);
* ``--sync-bn``: apex's conversion makes new Parameters, so it runs in ``convert_model``, before
  the optimizer holds them.

NVIDIA removed ``apex.parallel`` in May 2025 (the last tag with it is 25.05); apex is never a
dependency of kd and is imported only here. ``apex.parallel`` runs on CUDA only, so on the CPU
the native implementation is used.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from backends import dist as kd_dist
from backends.process_group import ProcessGroupBackend
from kd.utils.placement import Placement


def apex_parallel():
    """``(apex.parallel module, None)`` when importable with its DistributedDataParallel, else ``(None, why)``."""
    try:
        import apex.parallel as parallel  # noqa: WPS433 - optional, imported only here
    except Exception as exc:  # ImportError, or an apex built against another torch
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, f"apex.parallel is not importable: {detail}"
    if not hasattr(parallel, "DistributedDataParallel"):
        return None, "the installed apex has no apex.parallel.DistributedDataParallel (removed after 25.05)"
    return parallel, None


class GradientAverager:
    """The native algorithm: flat buckets preallocated once, filled, all-reduced and copied back."""

    def __init__(self, params: List[torch.nn.Parameter], world_size: int, cap_bytes: int = kd_dist.BUCKET_BYTES):
        self.params = params
        self.world_size = world_size
        self.buckets = kd_dist.buckets(params, cap_bytes)
        self.flats = [
            torch.empty(sum(params[i].numel() for i in b), dtype=params[b[0]].dtype, device=params[b[0]].device)
            for b in self.buckets
        ]
        device = params[0].device if params else torch.device("cpu")
        self.present = torch.empty(len(params), dtype=torch.float32, device=device)

    @torch.no_grad()
    def __call__(self) -> None:
        if not self.params:
            return
        self.present.copy_(torch.tensor([p.grad is not None for p in self.params], dtype=torch.float32))
        dist.all_reduce(self.present)
        for bucket, flat in zip(self.buckets, self.flats):
            offset = 0
            for i in bucket:
                p = self.params[i]
                n = p.numel()
                if p.grad is None:
                    flat[offset : offset + n].zero_()
                else:
                    flat[offset : offset + n].copy_(p.grad.reshape(-1))
                offset += n
            dist.all_reduce(flat)
            flat.div_(self.world_size)
            offset = 0
            for i in bucket:
                p = self.params[i]
                n = p.numel()
                averaged = flat[offset : offset + n].view_as(p)
                if p.grad is not None:
                    p.grad.copy_(averaged)
                elif self.present[i] > 0:  # used elsewhere, not here: this process's share was zero
                    p.grad = averaged.clone()
                offset += n


class ApexDDP(ProcessGroupBackend):
    description = (
        "apex DistributedDataParallel(delay_allreduce=True): real apex.parallel where importable "
        "and right for the run, else the same algorithm natively"
    )
    prefers_apex_amp = True

    @classmethod
    def implementation(cls, device_type: str = "cuda") -> str:
        """``'apex'``, or ``'native: why'``, for a run on ``device_type``."""
        parallel, why = apex_parallel()
        if parallel is None:
            return f"native: {why}"
        if device_type != "cuda":
            return "native: apex.parallel runs on CUDA only"
        return "apex"

    def __init__(self, cfg, placement: Optional[Placement] = None):
        super().__init__(cfg, placement)
        self.impl = "native"
        self.layout_note = ""
        self.averager: Optional[GradientAverager] = None

    def setup(self) -> None:
        super().setup()
        self.impl = self.implementation(self.device.type)

    def describe(self, details: str = "") -> str:
        impl = (
            "real apex.parallel.DistributedDataParallel(delay_allreduce=True)"
            if self.impl == "apex"
            else f"kd's native delayed all-reduce ({self.impl[len('native: ') :]})"
        )
        return super().describe(
            f"{impl}{self.layout_note}{', sync_bn' if self.cfg.sync_bn else ''}{', ' if details else ''}{details}"
        )

    def native_reason(self, model: nn.Module) -> Optional[str]:
        """Why real apex.parallel would average ``model``'s gradients wrongly, or None where it would not:
        bfloat16 weights (those the opt level will cast to, or already there), or parameters that may
        get no gradient."""
        from kd.precision import amp_dtype

        cast = self.cfg.opt in ("O2", "O3") and amp_dtype(self.cfg, self.device) == torch.bfloat16
        if cast or any(p.dtype == torch.bfloat16 for p in model.parameters() if p.requires_grad):
            return "bfloat16 weights, whose gradients apex.parallel never all-reduces (half, float and double only)"
        unused, how = (
            (self.find_unused, self.find_unused_how) if self.find_unused is not None else self.detect_unused(model)
        )
        if unused:
            return (
                f"find_unused_parameters ({how}); apex.parallel buckets only the gradients present, "
                f"which may differ between processes"
            )
        return None

    def convert_model(self, model: nn.Module) -> nn.Module:
        """Real apex or native (see the module docstring); then, under real apex, contiguous parameters
        and apex's SyncBatchNorm, else torch's."""
        why = self.native_reason(model) if self.impl == "apex" else None
        if why:
            self.impl = f"native: {why}"
        if self.impl != "apex":
            return super().convert_model(model)
        if any(not p.is_contiguous() for p in model.parameters()):
            model = model.to(memory_format=torch.contiguous_format)
            self.layout_note = (
                ", parameters contiguous (apex copies averaged gradients back through raw memory, "
                "which permutes channels_last ones; activations stay channels_last)"
            )
        if self.cfg.sync_bn:
            model = apex_parallel()[0].convert_syncbn_model(model)
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.impl == "apex":
            return apex_parallel()[0].DistributedDataParallel(model, delay_allreduce=True)
        kd_dist.broadcast_state(model)
        self.averager = GradientAverager([p for p in model.parameters() if p.requires_grad], self.world_size)
        return model

    def sync_gradients(self, model: nn.Module) -> None:
        if self.averager is not None:  # real apex all-reduces in its own end-of-backward callback
            self.averager()
