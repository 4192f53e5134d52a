"""Is kd's step bound by the GPU or by the host? Wall time per step, syncs, and a cProfile.

    python benchmarks/host_overhead.py [--opt O1] [--amp-dtype bfloat16] [--compile]

Builds the run as ``benchmarks/profile_step.py`` does (r101 -> r18, batch 256, synthetic input),
runs one epoch to warm up, then: the wall time per step when the host has queued the epoch
and when the GPU has finished it (equal: the host is the bottleneck, or a sync holds it);
the synchronising CUDA calls of one epoch (torch.cuda.set_sync_debug_mode) with kd's frames
that made them; and the host functions that took the time (cProfile, by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.profile_step import build  # noqa: E402

STEPS = 35


def epoch(trainer, timer):
    """(host done, GPU done) seconds per step over one epoch of the engine's own loop."""
    trainer.lane.batch_in_epoch = 0
    timer.warmup = 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    trainer.train_epoch()
    host = time.perf_counter()
    torch.cuda.synchronize()
    return (host - start) / STEPS, (time.perf_counter() - start) / STEPS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--opt", default="O1")
    ap.add_argument("--amp-dtype", default="bfloat16")
    ap.add_argument("--compile", action="store_true")
    cli = ap.parse_args()
    args = argparse.Namespace(
        teacher="resnet101",
        student="resnet18",
        batch_size=256,
        opt=cli.opt,
        amp_dtype=cli.amp_dtype,
        warmup=5,
        iters=STEPS - 5,
        compile=cli.compile,
    )
    trainer, timer = build(args, [])
    trainer.train_epoch()
    host, done = epoch(trainer, timer)
    print(
        f"{cli.opt} {cli.amp_dtype}{' compiled' if cli.compile else ''}: wall per step {1000 * host:.2f} ms "
        f"when the host has queued it, {1000 * done:.2f} ms when the GPU has run it"
    )

    seen = {}

    def record(message, *_args, **_kwargs):
        key = str(message)[:90]
        if key not in seen:
            frames = [
                f"{Path(f.filename).name}:{f.lineno} {f.name}"
                for f in traceback.extract_stack()
                if "/kd/" in f.filename or "/backends/" in f.filename
            ]
            seen[key] = frames[-3:]

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode(1)
    epoch(trainer, timer)
    torch.cuda.set_sync_debug_mode(0)
    print(f"\nsynchronising calls in one epoch of {STEPS} steps: {len(seen)}")
    for message, frames in seen.items():
        print(f"  {message} <- {' | '.join(frames)}")

    prof = cProfile.Profile()
    prof.enable()
    epoch(trainer, timer)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
    print(text.getvalue())


if __name__ == "__main__":
    main()
