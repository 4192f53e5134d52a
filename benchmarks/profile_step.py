"""Where the time of kd's step goes, per method, on one GPU.

    python benchmarks/profile_step.py --opt O1 --amp-dtype bfloat16
    python benchmarks/profile_step.py --opt O1 --variant fuse_teacher=false --variant cudnn_benchmark=false
    python benchmarks/profile_step.py --teacher resnet34 --methods kd,at,ofd,crd,reviewkd --amp-dtype float16

Builds the run as ``kd train`` does (``Trainer`` on the ``single`` backend, synthetic input,
random-init models, the teacher's BatchNorm statistics calibrated on the input), then times
with CUDA events, each phase alone over ``--iters``: the teacher forward; the student
forward + KD loss + backward; the optimizer step; and the whole training step as the
engine runs it. ``--variant KEY=VALUE[,KEY=VALUE]`` (repeatable) adds a row built with those
config overrides, for A/B comparisons. One torch.profiler pass over whole steps of the
first configuration groups the GPU kernel time by kind. ``--methods`` repeats all of it per method
(KD first: each method's extra milliseconds per kind are against it). Prints markdown tables.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import backends  # noqa: E402
from kd import config as kd_config  # noqa: E402
from kd.run.loop import Trainer  # noqa: E402
from kd.run.record import step_inputs  # noqa: E402
from kd.run.students import Students  # noqa: E402
from kd.run.timing import StepTimer  # noqa: E402


def build(args, overrides, method="kd"):
    options = dict(
        kd_loss=method,
        teacher=args.teacher,
        student=args.student,
        data="synthetic",
        batch_size=args.batch_size,
        opt=args.opt,
        amp_dtype=args.amp_dtype,
        teacher_weights="none",
        student_weights="none",
        epochs=1,
        limit_train_batches=args.warmup + args.iters,
        compile=args.compile,
        progress_bar=False,
        backend="single",
        device=args.device,
    )
    cfg = kd_config.resolve(options=options, sets=overrides)
    backend = backends.get("single")(cfg)
    backend.setup()
    timer = StepTimer(args.warmup, backend)
    out = tempfile.mkdtemp(prefix="kd-profile-")
    return Trainer(Students.alone(dataclasses.replace(cfg, out=out)), backend, hooks=[timer], validate=False), timer


def timed(fn, iters: int, warmup: int = 3) -> float:
    """Milliseconds per call of ``fn``, CUDA events around ``iters`` calls after ``warmup`` (the host's
    clock on the CPU: a dry run of the script)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        start_s = time.perf_counter()
        for _ in range(iters):
            fn()
        return 1000 * (time.perf_counter() - start_s) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def phases(trainer, timer, iters: int):
    lane = trainer.lane
    prec = lane.precision
    batch = next(iter(trainer.data.train))
    images = prec.input_cast(batch.images)
    inputs = step_inputs(batch, trainer.targets(batch), lane.loss, lane.t_layers, prec.input_cast, 0.0, 0)

    def teacher():
        trainer.teacher.forward(images)

    def student():
        with prec.autocast():
            parts = trainer.lane.model(inputs)
        loss = parts["loss"].float().mean()
        (prec.scaler.scale(loss) if prec.scaler else loss).backward()
        trainer.lane.loss.after_step()  # CRD's memory update, as each step of the engine makes it
        for p in trainer.lane.params:
            p.grad = None

    def optimizer():
        trainer.lane.optimizer.step()

    rows = {"teacher forward": timed(teacher, iters), "student fwd+loss+bwd": timed(student, iters)}
    with prec.autocast():  # gradients to step with
        parts = trainer.lane.model(inputs)
    parts["loss"].float().mean().backward()
    prec._gradients_to_optimizer(trainer.lane.params)
    rows["optimizer step"] = timed(optimizer, iters)
    trainer.lane.optimizer.zero_grad(set_to_none=True)
    trainer.train_epoch()  # the engine's own loop, timed by the StepTimer hook after the warm-up
    result = timer.result(trainer.backend)
    rows["whole step"] = 1000 * result["timed_seconds"] / max(result["timed_steps"], 1)
    return rows


KINDS = [  # the first that matches: cuDNN's BatchNorm kernels are BatchNorm, not convolutions
    ("batchnorm", r"batch_?norm|bn_"),
    ("conv / matmul", r"conv|gemm|xmma|cudnn|cutlass|wgmma|sm90|sm80|implicit|winograd|fprop|dgrad|wgrad"),
    ("optimizer", r"sgd|adam|multi_tensor"),
    ("pooling", r"pool"),
    ("softmax / reductions", r"softmax|reduce|norm|sum|topk"),
    ("layout / copy / cast", r"copy|cast|nchw|nhwc|transpose|memcpy|memset|fill"),
    ("compiled (triton)", r"^triton"),
    ("elementwise", r"elementwise|vectorized|unrolled|relu|add|mul|threshold"),
]


def kernel_kinds(trainer, timer, steps: int, ops: int = 0):
    """(GPU time by kind, by kernel) over ``steps`` whole steps, and with ``ops`` the aten ops that
    launched the most of it, by their inputs' shapes and dtypes (the ``ops`` largest)."""
    trainer.data.train.steps = steps  # the synthetic loader's length
    trainer.lane.state.batch_in_epoch = 0  # phases() left the position at the end of its epoch
    timer.warmup = 0
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    if ops and cuda:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=activities, record_shapes=bool(ops)) as prof:
        trainer.lane.state.epoch = 0
        trainer.train_epoch()
        if cuda:
            torch.cuda.synchronize()
    totals, kernels = collections.Counter(), collections.Counter()
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None) if cuda else evt.self_cpu_time_total
        us = getattr(evt, "self_cuda_time_total", 0) if us is None else us
        if not us or evt.key.startswith("ProfilerStep") or (ops and cuda and evt.key.startswith("aten::")):
            continue
        name = evt.key
        kind = next((k for k, pat in KINDS if re.search(pat, name, re.I)), "other")
        totals[kind] += us
        kernels[name] += us
    by_op = collections.Counter()
    if ops:
        for evt in prof.events():
            us = getattr(evt, "self_device_time_total", 0) if cuda else evt.self_cpu_time_total
            if not us or not evt.name.startswith("aten::"):
                continue
            shapes = [tuple(s) for s in evt.input_shapes if s][:2]
            dtypes = [d for d in getattr(evt, "input_dtypes", []) if d][:2]
            by_op[f"{evt.name} {shapes} {dtypes}"] += us
    return totals, kernels, by_op.most_common(ops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", default="resnet101")
    ap.add_argument("--student", default="resnet18")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--opt", default="O1")
    ap.add_argument("--amp-dtype", default="bfloat16")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (host clock, CPU ops)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--profile-steps", type=int, default=6)
    ap.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]")
    ap.add_argument("--methods", default="kd", help="comma-separated KD methods, each profiled alone (KD first)")
    ap.add_argument("--ops", type=int, default=0, help="also the N aten ops with the most GPU time, per method")
    args = ap.parse_args()

    import timm
    import torchvision

    print(
        f"torch {torch.__version__}, torchvision {torchvision.__version__}, timm {timm.__version__}, "
        f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, {args.teacher} -> {args.student}, "
        f"batch {args.batch_size}, "
        f"{args.opt} {args.amp_dtype}{' compiled' if args.compile else ''}\n"
    )
    methods = [m for m in args.methods.split(",") if m]
    trainer, timer = build(args, [], methods[0])  # the process's first build and steps warm the GPU up, untimed
    phases(trainer, timer, args.iters)
    del trainer
    table = []
    profiles = {}
    for method in methods:
        for variant in ["", *args.variant]:
            sets = [s for s in variant.split(",") if s]
            trainer, timer = build(args, sets, method)
            rows = phases(trainer, timer, args.iters)
            table.append((method, variant or "default", rows))
            if method not in profiles:
                profiles[method] = kernel_kinds(trainer, timer, args.profile_steps, args.ops)
            del trainer
            torch.cuda.empty_cache()
            said = ", ".join(f"{n} {v:.2f} ms" for n, v in rows.items())
            print(f"profiled {method} {variant or 'default'}: {said}", file=sys.stderr, flush=True)

    names = list(table[0][2])
    print("| method | config | " + " | ".join(f"{n} (ms)" for n in names) + " | images/s (whole step) |")
    print("|---|---|" + "---|" * (len(names) + 1))
    for method, variant, rows in table:
        cells = " | ".join(f"{rows[n]:.2f}" for n in names)
        print(f"| {method} | {variant} | {cells} | {1000 * args.batch_size / rows['whole step']:,.0f} |")

    steps = args.profile_steps
    kinds = [kind for kind, _ in KINDS] + ["other"]
    print(f"\nGPU kernel time by kind, ms per step over {steps} whole steps (default config):\n")
    print("| kind | " + " | ".join(methods) + " |\n|---|" + "---|" * len(methods))
    for kind in kinds + ["all"]:
        cells = []
        for method in methods:
            totals = profiles[method][0]
            us = sum(totals.values()) if kind == "all" else totals.get(kind, 0)
            cells.append(f"{us / 1000 / steps:.2f}")
        print(f"| {kind} | " + " | ".join(cells) + " |")
    base = profiles[methods[0]][1]
    for method in methods:
        kernels = profiles[method][1]
        against = f" (and against {methods[0]})" if method != methods[0] else ""
        print(f"\n{method}: top kernels, ms per step{against}")
        print("| kernel | ms per step | extra |\n|---|---|---|")
        for name, us in kernels.most_common(12):
            extra = (us - base.get(name, 0)) / 1000 / steps
            print(f"| {name[:90]} | {us / 1000 / steps:.2f} | {extra:+.2f} |")
        if profiles[method][2]:
            print(f"\n{method}: aten ops by GPU time, ms per step (inputs' shapes and dtypes)")
            print("| op | ms per step |\n|---|---|")
            for op, us in profiles[method][2]:
                print(f"| {op[:160]} | {us / 1000 / steps:.2f} |")


if __name__ == "__main__":
    main()
