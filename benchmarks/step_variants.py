"""The KD step's parts and alternatives, outside kd's engine, in one process on one GPU.

    python benchmarks/step_variants.py

resnet101 teacher (random init, BatchNorm statistics estimated on random input) and resnet18
student, batch 256, 224 px, channels_last, synthetic input; CUDA-event ms per call over 20
calls after 5 warm-up calls. Rows: the teacher's forward as kd's O1 stores it (conv weights in
the autocast dtype) against kd.fuse's fused teacher, in bfloat16 and float16, and its CUDA
graph; the student's training step (bf16 autocast, fused SGD, Hinton KD loss) eager and
compiled; the two in sequence; the teacher of the next batch on a side stream beside the
student's step; and inductor's own BatchNorm folding (``freezing``) of the compiled teacher.
Prints a markdown table; the fused teacher's logits are compared with float32 first.
"""
from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.profile_step import timed as profile_timed  # noqa: E402
from kd.fuse import fuse_teacher  # noqa: E402

DEV, BATCH, CL, BF16, ITERS = torch.device("cuda"), 256, torch.channels_last, torch.bfloat16, 20


def timed(fn, warmup: int = 5) -> float:
    return profile_timed(fn, ITERS, warmup)


def calibrated_teacher(x: torch.Tensor) -> nn.Module:
    torch.manual_seed(0)
    t = torchvision.models.resnet101().to(DEV, memory_format=CL)
    for m in t.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None
    with torch.no_grad():
        for _ in range(3):
            t(torch.randn_like(x))
    return t.eval().requires_grad_(False)


def conv_weights_to(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """As kd's O1 stores the frozen teacher."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            for p in m.parameters(recurse=False):
                p.data = p.data.to(dtype)
    return model


def forward(model, x, dtype=BF16):
    def run():
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
            return model(x)
    return run


def main() -> None:
    torch.backends.cudnn.benchmark = True
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}\n")
    x = torch.randn(BATCH, 3, 224, 224, device=DEV).contiguous(memory_format=CL)
    x_next = torch.randn_like(x)
    y = torch.randint(0, 1000, (BATCH,), device=DEV)
    base = calibrated_teacher(x)
    with torch.no_grad():
        ref = base(x).float()
    rows, teachers = {}, {}
    for dtype in (BF16, torch.float16):
        name = str(dtype).replace("torch.", "")
        plain = conv_weights_to(copy.deepcopy(base), dtype)
        fused, note = fuse_teacher(copy.deepcopy(base))
        fused = conv_weights_to(fused.to(memory_format=CL), dtype)
        out = forward(fused, x, dtype)().float()
        print(f"{name}: {note}; fused logits max |diff| from float32 {(out - ref).abs().max().item():.3f} "
              f"(plain: {(forward(plain, x, dtype)().float() - ref).abs().max().item():.3f}, logit std {ref.std().item():.2f})")
        rows[f"teacher forward, O1 storage, {name}"] = timed(forward(plain, x, dtype))
        rows[f"teacher forward, fused, {name}"] = timed(forward(fused, x, dtype))
        teachers[name] = (plain, fused)
    plain, fused = teachers["bfloat16"]

    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            forward(fused, x)()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        forward(fused, x)()
    rows["teacher forward, fused, bfloat16, CUDA graph"] = timed(graph.replay)

    torch.manual_seed(1)
    student = torchvision.models.resnet18().to(DEV, memory_format=CL)
    opt = torch.optim.SGD(student.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, fused=True)
    t_logits = forward(fused, x)().float()

    def student_step(model, t):
        with torch.autocast("cuda", dtype=BF16):
            s = model(x).float()
        ce = F.cross_entropy(s, y)
        kl = F.kl_div(F.log_softmax(s / 4, 1), F.log_softmax(t / 4, 1), reduction="batchmean", log_target=True)
        (0.5 * ce + 8.0 * kl).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def ahead(model, teacher):
        """The teacher of the next batch on a side stream while the student steps on this one."""
        state = {"cur": forward(teacher, x)().float()}
        main = torch.cuda.current_stream()

        def step():
            side.wait_stream(main)
            with torch.cuda.stream(side):
                nxt = forward(teacher, x_next)().float()
            student_step(model, state["cur"])
            main.wait_stream(side)
            state["cur"] = nxt
        return step

    rows["student step, eager bf16"] = timed(lambda: student_step(student, t_logits))
    rows["fused teacher, then eager student"] = timed(lambda: student_step(student, forward(fused, x)().float()))
    rows["fused teacher of the next batch on a side stream, eager student"] = timed(ahead(student, fused))
    rows["plain teacher of the next batch on a side stream, eager student"] = timed(ahead(student, plain))
    start = time.time()
    compiled = torch.compile(student)
    rows["student step, compiled bf16"] = timed(lambda: student_step(compiled, t_logits), warmup=3)
    print(f"student compiled and timed in {time.time() - start:.0f} s")
    rows["fused teacher, then compiled student"] = timed(lambda: student_step(compiled, forward(fused, x)().float()))
    rows["fused teacher of the next batch on a side stream, compiled student"] = timed(ahead(compiled, fused))

    import torch._inductor.config as inductor_config

    inductor_config.freezing = True  # inductor folds BatchNorm into the convolutions itself
    rows["teacher forward, compiled with freezing, bf16"] = timed(forward(torch.compile(copy.deepcopy(plain)), x),
                                                                  warmup=3)
    rows["teacher forward, fused and compiled, bf16"] = timed(forward(torch.compile(fused), x), warmup=3)

    print("\n| variant | ms per batch of 256 | images/s |\n|---|---|---|")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.2f} | {1000 * BATCH / ms:,.0f} |")


if __name__ == "__main__":
    main()
