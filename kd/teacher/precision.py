"""The frozen teacher's precision: chosen apart from the student's opt level, and checked before training.

The teacher only runs forward passes, so its precision need not follow ``--opt``. A teacher
runs either in float32, or with its convolution and linear weights stored in a reduced dtype
(float16 or bfloat16) under ``torch.autocast`` of that dtype: the values autocast would cast
the weights to in every forward, stored once, which is also the dtype kd.teacher.fuse's fused
convolutions run in. Norm layers keep float32 parameters, as autocast runs them.

A trained teacher can overflow float16 (largest value 65504) although it is fine in float32
or bfloat16: large BatchNorm scales, a sharp classifier. Its logits are then inf or NaN, every
KD loss built on them is NaN, and a float16 run skips every step. So before the first step
:func:`choose` runs the teacher on a few validation batches (the *probe*) in the precision it
would use, and compares it with float32:

* ``--teacher-precision auto`` (the default) starts from the run's dtype (float32 at O0, else
  ``--amp-dtype``, float16 under apex.amp) and falls back, float16 -> bfloat16 (where the device has it) -> float32,
  while the probe gives non-finite logits or a top-1 more than :data:`MAX_TOP1_DROP` points
  below float32's; the log and ``config.yaml`` say which precision runs and why;
* an explicit ``float16``, ``bfloat16`` or ``float32`` runs as given, or stops with one line
  naming the teacher and what to do;
* a teacher whose logits are not finite even in float32 stops the run: its weights are broken.
* where float32 is the only choice on the CPU (O0, or ``float32`` given) there is nothing to
  choose: the log says so, and a teacher with non-finite weights, or non-finite logits on the
  probe batches (finite weights can overflow), stops the run (on a GPU the probe runs as
  elsewhere: it also checks that the fused teacher runs there).

Every process of a run takes part in the probe (the counts are summed), so all choose alike.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, List, Optional, Tuple

import torch
from torch import nn

from kd.errors import KDError
from kd.precision import DTYPES as REDUCED
from kd.precision import dtype_name
from kd.teacher.fuse import fuse_teacher

DTYPES = {**REDUCED, "float32": torch.float32}
PROBE_BATCHES = 2  # validation batches per process
MAX_TOP1_DROP = 2.0  # points of top-1 (at least two probe images) below float32 that count as broken


@torch.no_grad()
def store_weights(teacher: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The frozen teacher's convolution and linear weights stored in ``dtype``, in place.

    autocast would cast them to exactly these values in every forward; storing them once removes
    those casts and their memory traffic from each step. Norm layers keep float32 parameters.
    """
    for module in teacher.modules():
        if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
            for param in module.parameters(recurse=False):
                param.data = param.data.to(dtype)
    return teacher


class TeacherPrecision:
    """How the frozen teacher runs: ``convert`` its weights once, then each forward inside
    ``autocast()`` on ``input_cast(images)``.

    ``outer`` is a context the student's precision needs around any other model's forward
    (apex.amp O1 turns its patched casts off there, so the teacher runs on torch.autocast alone).
    """

    def __init__(
        self, device: torch.device, dtype: torch.dtype, outer: Callable[[], ContextManager] = contextlib.nullcontext
    ):
        self.device = device
        self.dtype = dtype
        self.outer = outer

    @property
    def reduced(self) -> bool:
        return self.dtype != torch.float32

    def convert(self, teacher: nn.Module) -> nn.Module:
        """``teacher`` with its convolution and linear weights stored in this dtype (in place); as it is in float32."""
        return store_weights(teacher, self.dtype) if self.reduced else teacher

    @contextlib.contextmanager
    def autocast(self):
        with self.outer():
            if self.reduced:
                with torch.autocast(self.device.type, dtype=self.dtype):
                    yield
            else:
                yield

    def input_cast(self, images: torch.Tensor) -> torch.Tensor:
        return images if self.reduced else images.float()

    def describe(self) -> str:
        return dtype_name(self.dtype)


@dataclass
class Probe:
    """What the teacher gave on the probe images in one precision."""

    dtype: torch.dtype
    top1: float
    nonfinite: int
    count: int

    def summary(self) -> str:
        if self.nonfinite:
            return f"non-finite logits on {self.nonfinite} of {self.count} probe images"
        return f"top-1 {self.top1:.2f} on {self.count} probe images"


def fallbacks(start: torch.dtype, device: torch.device) -> List[torch.dtype]:
    """``start`` and the precisions tried after it, in order."""
    order = [start]
    if start == torch.float16 and bf16_supported(device):
        order.append(torch.bfloat16)
    if start != torch.float32:
        order.append(torch.float32)
    return order


def bf16_supported(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.is_bf16_supported()


def choose(
    teacher: nn.Module,
    run: Callable[[nn.Module, TeacherPrecision], Dict[str, float]],
    setting: str,
    start: torch.dtype,
    device: torch.device,
    name: str,
    outer: Callable[[], ContextManager] = contextlib.nullcontext,
    seconds: Optional[Dict[str, float]] = None,
) -> Tuple[TeacherPrecision, nn.Module, str]:
    """The teacher's precision, its model converted to it, and a log line saying what was chosen and why.

    ``teacher`` is the float32 model (left as it is); ``run(model, precision)`` evaluates it on
    the probe batches of every process and returns summed ``top1``, ``nonfinite`` and ``count``.
    ``setting`` is ``--teacher-precision``; ``start`` the dtype it would follow the run with.
    ``seconds`` (if given) receives each probe's wall time by precision, in the order they ran.
    """
    seconds = {} if seconds is None else seconds
    explicit = setting != "auto"
    if explicit:
        start = DTYPES[setting]
        if start == torch.bfloat16 and not bf16_supported(device):
            raise KDError("--teacher-precision bfloat16: this GPU has no bfloat16; use float16 or float32")
    candidates = fallbacks(start, device) if not explicit else [start]
    probes: Dict[torch.dtype, Probe] = {}

    def probe_in(dtype: torch.dtype, model: nn.Module, autotune: bool = True) -> Probe:
        if dtype not in probes:
            began = time.perf_counter()
            with contextlib.nullcontext() if autotune else no_cudnn_autotune():
                probes[dtype] = _probe(model, TeacherPrecision(device, dtype, outer), run)
            seconds[dtype_name(dtype)] = time.perf_counter() - began  # run's counts reach the host: synced
        return probes[dtype]

    # nothing to choose: the weights checked, then the logits of the probe batches, which finite
    # weights can overflow (a GPU's probe also tests that the fused teacher runs there)
    if candidates == [torch.float32] and device.type == "cpu":
        broken = nonfinite_weights(teacher)
        if broken:
            raise KDError(
                f"teacher {name} has non-finite weights ({', '.join(broken[:3])}): its weights are broken; "
                f"check --teacher-weights"
            )
        probe = probe_in(torch.float32, teacher)
        if probe.nonfinite:
            raise KDError(
                f"teacher {name} gives non-finite logits in float32 ({probe.summary()}): "
                f"its weights are broken; check --teacher-weights"
            )
        how = "as given" if explicit else "auto: the only precision at O0 on the CPU"
        precision = TeacherPrecision(device, torch.float32, outer)
        line = f"teacher {name}: runs in {precision.describe()} ({how}; nothing to choose: {probe.summary()})"
        return precision, teacher, line
    tried: List[str] = []
    for dtype in candidates:
        precision = TeacherPrecision(device, dtype, outer)
        model = precision.convert(copy.deepcopy(teacher)) if precision.reduced else teacher
        probe = probe_in(dtype, model)
        # float32 as the reference only: cuDNN's heuristics, not timed trials of shapes no step will run
        problem = _problem(probe, lambda: probe_in(torch.float32, teacher, autotune=False))
        if problem is None:
            why = f"; {'; '.join(tried)}" if tried else ""
            how = "as given" if explicit else "auto"
            return precision, model, f"teacher {name}: runs in {precision.describe()} ({how}: {probe.summary()}{why})"
        if dtype == torch.float32:
            raise KDError(
                f"teacher {name} gives non-finite logits even in float32 ({probe.summary()}): "
                f"its weights are broken; check --teacher-weights"
            )
        if explicit:
            raise KDError(
                f"teacher {name} cannot run in {dtype_name(dtype)}: {problem}; use --teacher-precision "
                f"{'bfloat16 or float32' if dtype == torch.float16 else 'float32'}, or auto to let kd choose"
            )
        tried.append(f"{dtype_name(dtype)} was refused: {problem}")
        del model
    raise AssertionError("float32 ends the fallbacks")  # pragma: no cover


def nonfinite_weights(model: nn.Module) -> List[str]:
    """The names of ``model``'s floating parameters and buffers that hold inf or NaN."""
    return [k for k, v in model.state_dict().items() if v.is_floating_point() and not torch.isfinite(v).all()]


@contextlib.contextmanager
def no_cudnn_autotune():
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = saved


def _probe(model: nn.Module, precision: TeacherPrecision, run) -> Probe:
    result = run(model, precision)
    return Probe(precision.dtype, result["top1"], int(result["nonfinite"]), int(result["count"]))


def _problem(probe: Probe, float32: Callable[[], Probe]) -> Optional[str]:
    """Why ``probe`` disqualifies its precision, or None; ``float32()`` is asked only when needed."""
    if probe.nonfinite:
        return probe.summary()
    if probe.dtype == torch.float32:
        return None
    reference = float32()
    if reference.nonfinite:
        return None  # float32 is no better; the float32 step says so
    allowed = max(MAX_TOP1_DROP, 200.0 / max(probe.count, 1))  # two images on a small probe
    if probe.top1 < reference.top1 - allowed:
        return f"top-1 {probe.top1:.2f} against {reference.top1:.2f} in float32 on {probe.count} probe images"
    return None


def fuse_and_choose(
    teacher: nn.Module,
    layers: List[str],
    fuse: bool,
    memory_format: torch.memory_format,
    choose: Callable[[nn.Module], nn.Module],
    log: Callable[[str], None],
) -> nn.Module:
    """The frozen teacher, fused for inference (:mod:`kd.teacher.fuse`) where ``fuse``, then passed to
    ``choose`` (which picks its precision on a few validation batches). Where the device refuses
    the fused model there (a cuDNN without runtime fusion, say), the plain teacher is used and
    ``log`` says why. The fused teacher returns the tapped ``layers`` with its logits."""
    if fuse:
        start = time.perf_counter()
        fused, note = fuse_teacher(copy.deepcopy(teacher), taps=layers)
        note += f" ({time.perf_counter() - start:.1f} s)"
        try:
            chosen = choose(fused.to(memory_format=memory_format))
        except RuntimeError as exc:
            log(
                f"teacher: not fused, the fused model failed on {next(teacher.parameters()).device} "
                f"({str(exc).splitlines()[0][:160]})"
            )
        else:
            log(f"teacher: {note}")
            return chosen
    return choose(teacher)
