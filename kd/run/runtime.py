"""The run's facts that depend on the machine, resolved once per process.

Options whose default is "auto" (``None`` in the config) get their value here, from the
config and the device the backend chose, and nowhere else: the engine, the teacher, the
bench and ``kd eval`` read the resolved :class:`Runtime`. (The DataLoader's worker count is
resolved by :func:`kd.data.loader.default_workers`, the one owner of the loader's settings, and
the reduced dtype of ``--opt`` by :func:`kd.precision.amp_dtype`, the precision's own.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: torch.compile's modes that capture CUDA graphs
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    #: images and models in channels_last memory format (``--channels-last``; auto: on CUDA)
    channels_last: bool
    #: the frozen teacher fused for inference (``--set fuse_teacher``; auto: on CUDA)
    fuse_teacher: bool
    #: torch.compile the student and the teacher (``--compile``; auto, as recipes have it: on CUDA,
    #: where it pays; on the CPU it compiles for about a minute for little gain)
    compile: bool = False
    #: torch.compile captures CUDA graphs (compile_mode reduce-overhead or max-autotune): each step
    #: starts a new graph generation, and the teacher's outputs cannot be shared between students
    cuda_graphs: bool = False

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format


def resolve(cfg, device: torch.device) -> Runtime:
    """The :class:`Runtime` of ``cfg`` on ``device``."""
    cuda = device.type == "cuda"
    compile = cfg.compile if cfg.compile is not None else cuda
    return Runtime(
        device=device,
        channels_last=cfg.channels_last if cfg.channels_last is not None else cuda,
        fuse_teacher=cfg.fuse_teacher if cfg.fuse_teacher is not None else cuda,
        compile=compile,
        cuda_graphs=compile and cfg.compile_mode in CUDA_GRAPH_MODES,
    )
