"""What this CPU runs fast: reduced precision without the instructions for it is far slower than float32."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Set

import torch

# instruction-set flags (Linux /proc/cpuinfo names) that give the dtype native matrix kernels
FAST_FLAGS = {
    torch.bfloat16: {"avx512_bf16", "amx_bf16", "bf16"},  # x86 AVX-512-BF16 or AMX; Arm BF16
    torch.float16: {"avx512_fp16", "amx_fp16", "fphp"},  # x86 AVX512-FP16 or AMX-FP16; Arm FP16 arithmetic
}
X86_NAMES = {torch.bfloat16: "AVX-512-BF16 or AMX", torch.float16: "AVX512-FP16 or AMX-FP16"}
ARM_NAMES = {torch.bfloat16: "BF16", torch.float16: "FP16"}
AVX512_CORE = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}  # what oneDNN emulates bfloat16 with


def cpu_flags() -> Set[str]:
    """This CPU's feature flags from /proc/cpuinfo (x86 ``flags``, Arm ``Features``); empty where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.lower().split())
    return set()


def slow_precision_warning(
    opt: str, dtype: torch.dtype, device: torch.device, flags: Optional[Set[str]] = None
) -> Optional[str]:
    """One log line when ``opt`` computes in ``dtype`` on a CPU without native kernels for it, else None.

    Without them the dtype is emulated. Measured (resnet10t training step, batch 32 at 32 px, 2
    threads, oneDNN limited with ONEDNN_MAX_CPU_ISA): bfloat16 against float32 took 2458 against
    126 ms on AVX2 (19.5x), 84 against 50 ms on AVX-512 without BF16 (1.7x); issue 17's AVX2
    machine trained at 8 against 284 images/s. Where the flags cannot be read, nothing is guessed.
    """
    if torch.device(device).type != "cpu" or dtype not in FAST_FLAGS:
        return None
    flags = cpu_flags() if flags is None else flags
    if not flags or flags & FAST_FLAGS[dtype]:
        return None
    name = str(dtype).replace("torch.", "")
    if "avx2" in flags or "sse2" in flags:  # x86
        if dtype == torch.bfloat16 and AVX512_CORE <= flags:
            what, cost = f"AVX-512 but no {X86_NAMES[dtype]}", "about 1.7x slower than float32"
        elif dtype == torch.bfloat16:
            what, cost = "neither AVX-512 nor AMX", "about 20-35x slower than float32"
        else:
            what, cost = f"no {X86_NAMES[dtype]}", "likely much slower than float32"
    else:
        what, cost = f"no {ARM_NAMES[dtype]} instructions", "likely much slower than float32"
    return (
        f"warning: --opt {opt} computes in {name}; this CPU has {what}, so {name} is emulated, {cost}: "
        f"use --opt O0 on this CPU"
    )
