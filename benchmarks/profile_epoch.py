"""Where the time of a real training epoch goes: ``kd train``'s own Trainer on a JPEG folder, one
warm epoch, then ``--steps`` steps with the time spent waiting for batches and in
:meth:`Trainer.step` measured apart.

    python benchmarks/profile_epoch.py --data /tmp/in1k [--loader gpu] [-j 15] [--set KEY=VALUE ...]
        [--cprofile] [--kernels TRACE.json]

Prints the milliseconds per step of: waiting for the loader and the step's host side, and the
CPU milliseconds per step of each thread of the process (by Python thread name) and of its
descendant processes (the loader's workers): which thread of the main process is busy beside the step.
For ``--loader gpu`` also the wall milliseconds per batch of the loader's stages
(``GpuLoader.stage_times``): its decode thread waiting for the workers' batches (``input``),
decoding (``decode``) and waiting for the step to take a batch (``output``), and the main
thread enqueueing crop, flip and normalisation (``prep``): the stage that never waits sets the pace.
``--cprofile``: the 25 functions of the main thread with the most cumulative time (cProfile
slows that thread: read the shares, not the rate). ``--kernels``: the profiled steps under
torch.profiler, kept as a Chrome trace, and per CUDA stream its kernels' and copies' time per
step, the top kernels, and how much of the window each stream and the whole GPU were busy: the
step's stream against the loader's decode and prep streams. Needs CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import collections
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import backends  # noqa: E402
from kd import config as kd_config  # noqa: E402
from kd.run.loop import Trainer
from kd.run.students import Students  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--loader", default="gpu")
    ap.add_argument("-j", "--workers", type=int, default=15)
    ap.add_argument("-b", "--batch-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--cprofile", action="store_true", help="cProfile the main thread")
    ap.add_argument("--kernels", type=Path, help="torch.profiler trace of the profiled steps, summarised by stream")
    args = ap.parse_args()
    options = dict(
        teacher="resnet101",
        student="resnet18",
        teacher_weights="none",
        data=args.data,
        loader=args.loader,
        workers=args.workers,
        batch_size=args.batch_size,
        opt="O1",
        amp_dtype="float16",
        epochs=2,
        progress_bar=False,
        device="cuda",
    )
    cfg = kd_config.resolve(options=options, sets=args.sets)
    backend = backends.get("single")(cfg)
    backend.setup()
    out = tempfile.mkdtemp(prefix="kd-profile-e2e-")
    trainer = Trainer(Students.alone(dataclasses.replace(cfg, out=out)), backend, validate=False)
    loader = trainer.data.train
    print(loader.describe())
    trainer.lane.side.train()
    for epoch in range(2):  # the first starts the workers and warms cuDNN; the second is profiled
        loader.set_epoch(epoch)
        it = iter(loader)
        steps = args.steps if epoch else min(args.steps, len(loader))
        wait = step_host = 0.0
        profile = cProfile.Profile() if epoch and args.cprofile else None
        tracer = None
        if epoch and args.kernels:
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            tracer = torch.profiler.profile(activities=activities)
        torch.cuda.synchronize()
        stages_before = dict(getattr(loader, "stage_times", {}))
        cpu_before = cpu_seconds()
        start = time.perf_counter()
        if tracer:
            tracer.__enter__()
        if profile:
            profile.enable()
        for _ in range(steps):
            t0 = time.perf_counter()
            batch = next(it)
            t1 = time.perf_counter()
            trainer.step(batch)
            t2 = time.perf_counter()
            wait += t1 - t0
            step_host += t2 - t1
        if profile:
            profile.disable()
        torch.cuda.synchronize()
        total = time.perf_counter() - start
        cpu_after = cpu_seconds()
        cpu_used = collections.Counter({k: v - cpu_before.get(k, 0.0) for k, v in cpu_after.items()})
        if tracer:
            tracer.__exit__(None, None, None)
            tracer.export_chrome_trace(str(args.kernels))
        close = getattr(it, "close", None)
        if close:
            close()
        print(
            f"epoch {epoch}: {steps} steps, {steps * args.batch_size / total:.0f} img/s; per step: "
            f"{1000 * total / steps:.1f} ms, waiting for the loader {1000 * wait / steps:.1f} ms, "
            f"the step's host side {1000 * step_host / steps:.1f} ms"
        )
        print("  CPU ms per step: " + ", ".join(f"{k} {1000 * v / steps:.1f}" for k, v in cpu_used.most_common()))
        stage_times = {k: v - stages_before.get(k, 0.0) for k, v in getattr(loader, "stage_times", {}).items()}
        if stage_times.get("batches"):
            n = stage_times.pop("batches")
            print(
                f"  loader stages, ms per batch ({n:.0f} batches): "
                + ", ".join(f"{k} {1000 * v / n:.1f}" for k, v in stage_times.items())
            )
    if profile:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
        print(text.getvalue())
    if args.kernels:
        print(stream_summary(json.loads(args.kernels.read_text()), args.steps))
    trainer.close()
    backend.teardown()


def _children(pid: str) -> list:
    """Child process ids of every thread of ``pid`` (/proc/PID/task/TID/children)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += (task / "children").read_text().split()
        except OSError:  # ended meanwhile, or a kernel without CONFIG_PROC_CHILDREN
            continue
    return out


def cpu_seconds() -> collections.Counter:
    """CPU seconds (user + system) so far of each thread of this process, named as Python names it
    where it is a Python thread, and of all its descendant processes together: the loader's
    workers, which under forkserver are the fork server's children (/proc; Linux only)."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}

    def used(stat: str) -> float:
        fields = stat[stat.rindex(")") + 2 :].split()  # from field 3 on: utime and stime are 14 and 15
        return (int(fields[11]) + int(fields[12])) / tick

    out: collections.Counter = collections.Counter()
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        out[names.get(int(task.name)) or stat[stat.index("(") + 1 : stat.rindex(")")]] += used(stat)
    pending, seen = _children(str(os.getpid())), set()
    while pending:
        pid = pending.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            out["descendant processes"] += used(Path(f"/proc/{pid}/stat").read_text())
        except OSError:
            continue
        pending += _children(pid)
    return out


def _busy(intervals) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def stream_summary(trace: dict, steps: int) -> str:
    """Per CUDA stream of a Chrome trace: kernels' and copies' ms per step, the share of the window
    it was busy, and its top kernels; then the whole GPU's busy share."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return "no CUDA kernels in the trace"
    window = max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)
    by_stream = collections.defaultdict(list)
    for e in gpu:
        by_stream[e.get("args", {}).get("stream", "?")].append(e)
    lines = [f"GPU window {window / 1000:.1f} ms over {steps} steps ({window / 1000 / steps:.2f} ms per step)"]
    for stream, evs in sorted(by_stream.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
        kernels = collections.Counter()
        for e in evs:
            kernels[e["name"][:70]] += e["dur"]
        busy = _busy((e["ts"], e["ts"] + e["dur"]) for e in evs)
        copies = sum(e["dur"] for e in evs if e.get("cat") != "kernel")
        compute = sum(kernels.values()) - copies
        lines.append(
            f"stream {stream}: {len(evs) / steps:.0f} launches, kernels {compute / 1000 / steps:.2f} "
            f"ms and copies {copies / 1000 / steps:.2f} ms per step, busy {100 * busy / window:.1f} % of the window"
        )
        lines += [f"    {us / 1000 / steps:7.3f} ms  {name}" for name, us in kernels.most_common(5)]
    busy = _busy((e["ts"], e["ts"] + e["dur"]) for e in gpu)
    lines.append(f"any stream busy {100 * busy / window:.1f} % of the window")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
