"""torch.nn.parallel.DistributedDataParallel: one process per GPU (nccl), or per CPU process or
processes sharing GPUs (gloo)."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from backends.process_group import ProcessGroupBackend
from kd.errors import KDError

UNUSED_HINT = (
    "some parameters of the student (or of the loss's connectors) got no gradient in this step; "
    "DistributedDataParallel needs --find-unused-parameters for such models "
    "(or use --backend apex_ddp --find-unused-parameters: "
    "kd's native averager counts a missing gradient as zero)"
)


class _DDP(DistributedDataParallel):
    """DDP whose complaint about unreduced gradients says what to do, in kd's words."""

    def forward(self, *args, **kwargs):
        try:
            return super().forward(*args, **kwargs)
        except RuntimeError as exc:
            text = str(exc)
            if "Expected to have finished reduction" in text or "find_unused_parameters" in text:
                raise KDError(UNUSED_HINT) from None
            raise


class TorchDDP(ProcessGroupBackend):
    description = "torch DistributedDataParallel, one process per GPU (nccl) or per CPU process (gloo)"

    def describe(self, details: str = "") -> str:
        flags = [f"find_unused_parameters={self.find_unused} ({self.find_unused_how})"]
        if self.cfg.static_graph:
            flags.append("static_graph")
        if self.cfg.sync_bn:
            flags.append("sync_bn")
        if details:
            flags.append(details)
        return super().describe(", ".join(flags))

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.find_unused is None:
            self.find_unused, self.find_unused_how = self.detect_unused(model)
        ids = [self.device.index] if self.device.type == "cuda" else None
        return _DDP(
            model,
            device_ids=ids,
            output_device=ids[0] if ids else None,
            find_unused_parameters=self.find_unused,
            static_graph=self.cfg.static_graph,
            gradient_as_bucket_view=True,
        )

    def sync_gradients(self, model: nn.Module) -> None:
        # With find_unused_parameters off, DDP would only complain at the next forward, after a step
        # whose gradients were not all averaged; checking here stops before that step.
        if self.find_unused or self.cfg.static_graph:
            return
        if any(p.grad is None for p in model.parameters() if p.requires_grad):
            raise KDError(UNUSED_HINT)
