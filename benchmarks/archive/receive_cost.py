"""What receiving one ``--loader gpu`` batch from the workers costs the main process: CPU and wall
time of the receiving thread per batch, with the workers' queue already full (so only the
hand-over is timed), and how many tensors (shared-memory file descriptors) each batch carries.

    python benchmarks/archive/receive_cost.py --data DIR [-j 2] [-b 128] [--batches 4]

Runs on the CPU (no pinning thread): the same hand-over the pinning thread does on a GPU machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from kd import config as kd_config  # noqa: E402
from kd.data.bytes_dataset import JpegBytes, collate_packed  # noqa: E402
from kd.data.layout import scan  # noqa: E402
from kd.data.loader import Shard, dataloader_and_sampler  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("-j", "--workers", type=int, default=2)
    ap.add_argument("-b", "--batch-size", type=int, default=128)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()
    _, train, _ = scan(args.data)
    options = dict(data=args.data, no_teacher=True, student="resnet18", workers=args.workers, loader="gpu")
    cfg = kd_config.resolve(options=options)
    dataset = JpegBytes(train, cfg.image_size, True)
    loader, sampler = dataloader_and_sampler(
        cfg, dataset, collate_packed, True, Shard(1, 0, args.batch_size, torch.device("cpu"))
    )
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        it = iter(loader)
        next(it)
        time.sleep(3)  # the workers fill the queue: then only the hand-over is timed
        wall, cpu = time.perf_counter(), time.thread_time()
        n, batch = 0, {}
        for n, batch in enumerate(it, 1):
            if n == args.batches:
                break
        if n == 0:
            raise SystemExit(f"--data has too few images for {args.batches + 1} batches of {args.batch_size}")
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        tensors = sum(isinstance(v, torch.Tensor) for v in batch.values())
        print(
            f"epoch {epoch}: {1000 * cpu / n:.2f} ms CPU, {1000 * wall / n:.2f} ms wall per batch received; "
            f"{tensors} tensor(s) per batch"
        )


if __name__ == "__main__":
    main()
