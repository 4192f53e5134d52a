"""Where the host time of a real training epoch goes: ``kd train``'s own Trainer on a JPEG folder,
one warm epoch, then ``--steps`` steps under cProfile (the main thread) with the time spent
waiting for batches and in :meth:`Trainer.step` measured apart.

    python benchmarks/profile_e2e.py --data /tmp/in1k [--loader gpu] [-j 15] [--set KEY=VALUE ...]

Prints the seconds per step of: waiting for the loader, the step's host side, the device, and the
25 functions with the most cumulative time. Needs CUDA.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import backends  # noqa: E402
from kd import config as kd_config  # noqa: E402
from kd.engine import Trainer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--loader", default="gpu")
    ap.add_argument("-j", "--workers", type=int, default=15)
    ap.add_argument("-b", "--batch-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--set", dest="sets", action="append", default=[])
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
    trainer = Trainer(cfg, backend, Path(tempfile.mkdtemp(prefix="kd-profile-e2e-")), validate=False)
    loader = trainer.data.train
    print(loader.describe())
    trainer.side.train()
    for epoch in range(2):  # the first starts the workers and warms cuDNN; the second is profiled
        loader.set_epoch(epoch)
        it = iter(loader)
        steps = args.steps if epoch else min(args.steps, len(loader))
        wait = step_host = 0.0
        profile = cProfile.Profile() if epoch else None
        torch.cuda.synchronize()
        start = time.perf_counter()
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
        close = getattr(it, "close", None)
        if close:
            close()
        print(
            f"epoch {epoch}: {steps} steps, {steps * args.batch_size / total:.0f} img/s; per step: "
            f"{1000 * total / steps:.1f} ms, waiting for the loader {1000 * wait / steps:.1f} ms, "
            f"the step's host side {1000 * step_host / steps:.1f} ms"
        )
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
    print(text.getvalue())
    trainer.close()
    backend.teardown()


if __name__ == "__main__":
    main()
