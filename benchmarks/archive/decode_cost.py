"""What torchvision's nvJPEG call costs the calling thread per file, alone on the GPU or beside a step.

    python benchmarks/archive/decode_cost.py /tmp/in1k/train
    python benchmarks/archive/decode_cost.py /tmp/in1k/train --beside-step

Reads the baseline JPEGs under the folder (the files ``--loader gpu`` sends to the device
decoder) and times ``torchvision.io.decode_jpeg(list, device='cuda')`` calls on random samples
of them: the same count every call against counts that vary (as the PIL share makes them vary),
several batch sizes, and pinned input. Prints wall and thread-CPU milliseconds per call and
per file: where they are equal the call is host work throughout, and since torchvision decodes
one batch at a time per process (a lock around its one decoder), that work is serial.

``--beside-step`` times batches of 230 files alone, then while another thread of the same
process trains a resnet50 (batch 256, float16 autocast, channels_last, fused SGD) on its own
CUDA stream, as kd's step runs beside its loader; once reading RGB and once the luma plane
only (``ImageReadMode.GRAY``: no colour conversion on the GPU). It prints the training loop's
steps/s alone and during each timing, so both sides of the contention show.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

import torch
from torchvision.io import ImageReadMode, decode_jpeg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from kd.data.bytes_dataset import jpeg_size  # noqa: E402
from kd.data.decoders import BASELINE_ONLY  # noqa: E402


class TrainingLoop:
    """resnet50 training steps on their own CUDA stream in a thread, at most two steps queued."""

    def __init__(self, device: torch.device):
        import torchvision

        self.device, self.steps, self.stop = device, 0, threading.Event()
        self.model = torchvision.models.resnet50().to(device, memory_format=torch.channels_last)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9, fused=True)
        self.x = torch.randn(256, 3, 224, 224, device=device).to(memory_format=torch.channels_last)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        stream, queued = torch.cuda.Stream(self.device), []
        with torch.cuda.stream(stream):
            while not self.stop.is_set():
                with torch.autocast("cuda", torch.float16):
                    loss = self.model(self.x).float().mean()
                loss.backward()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                done = torch.cuda.Event()
                done.record(stream)
                queued.append(done)
                if len(queued) > 2:
                    queued.pop(0).synchronize()
                self.steps += 1
        stream.synchronize()

    def rate(self, seconds: float = 3.0) -> float:
        start = self.steps
        time.sleep(seconds)
        return (self.steps - start) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument(
        "--beside-step", action="store_true", help="time batches of 230 alone and beside a training loop"
    )
    args = parser.parse_args()
    blobs = []
    for path in sorted(Path(args.folder).rglob("*")):
        if path.suffix.lower() in (".jpg", ".jpeg"):
            data = path.read_bytes()
            if jpeg_size(data, BASELINE_ONLY) is not None:  # progressive files go to PIL, not nvJPEG
                blobs.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    print(f"{len(blobs)} baseline JPEGs")
    device = torch.device("cuda")
    rng = random.Random(0)

    def run(label, counts, pinned=False, mode=ImageReadMode.RGB, loop=None):
        source = [b.pin_memory() for b in blobs] if pinned else blobs
        torch.cuda.synchronize()
        wall = cpu = 0.0
        steps, start = (loop.steps if loop else 0), time.perf_counter()
        for count in counts:
            batch = rng.sample(source, count)
            t0, c0 = time.perf_counter(), time.thread_time()
            decode_jpeg(batch, mode=mode, device=device)
            wall += time.perf_counter() - t0
            cpu += time.thread_time() - c0
        torch.cuda.synchronize()
        calls, files = len(counts), sum(counts)
        elapsed = time.perf_counter() - start  # the loop's rate over the whole timing, sampling included
        beside = f"; the training loop {(loop.steps - steps) / elapsed:.1f} steps/s" if loop else ""
        print(
            f"{label}: {1e3 * wall / calls:.2f} ms/call wall, {1e3 * cpu / calls:.2f} CPU; "
            f"per file {1e3 * wall / files:.4f} ms wall, {1e3 * cpu / files:.4f} CPU{beside}"
        )

    run("warm-up", [256] * 3)
    if args.beside_step:
        for _ in range(2):
            run("alone, RGB, 230", [230] * 20)
            run("alone, luma only, 230", [230] * 20, mode=ImageReadMode.GRAY)
        loop = TrainingLoop(device)
        loop.thread.start()
        time.sleep(8)  # cuDNN's algorithm search and the allocator's warm-up
        print(f"the training loop alone: {loop.rate():.1f} steps/s")
        for _ in range(2):
            run("beside the loop, RGB, 230", [230] * 20, loop=loop)
            run("beside the loop, luma only, 230", [230] * 20, mode=ImageReadMode.GRAY, loop=loop)
        print(f"the training loop alone: {loop.rate():.1f} steps/s")
        loop.stop.set()
        loop.thread.join()
        return
    for _ in range(2):
        run("constant 230", [230] * 20)
        run("varying 220-240", [rng.randint(220, 240) for _ in range(20)])
        run("constant 115", [115] * 20)
        run("varying 105-125", [rng.randint(105, 125) for _ in range(20)])
        run("constant 460", [460] * 10)
        run("constant 32", [32] * 40)
    run("constant 230, pinned input", [230] * 20, pinned=True)


if __name__ == "__main__":
    main()
