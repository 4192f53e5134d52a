"""What torchvision's nvJPEG call costs the calling thread per file, alone on the GPU.

    python benchmarks/decode_cost.py /tmp/in1k/train

Reads the baseline JPEGs under the folder (the files ``--loader gpu`` sends to the device
decoder) and times ``torchvision.io.decode_jpeg(list, device='cuda')`` calls on random samples
of them: the same count every call against counts that vary (as the PIL share makes them vary),
several batch sizes, and pinned input. Prints wall and thread-CPU milliseconds per call and
per file: where they are equal the call is host work throughout, and since torchvision decodes
one batch at a time per process (a lock around its one decoder), that work is serial.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch
from torchvision.io import ImageReadMode, decode_jpeg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kd.data.bytes_dataset import jpeg_size  # noqa: E402
from kd.data.decoders import BASELINE_ONLY  # noqa: E402


def main() -> None:
    blobs = []
    for path in sorted(Path(sys.argv[1]).rglob("*")):
        if path.suffix.lower() in (".jpg", ".jpeg"):
            data = path.read_bytes()
            if jpeg_size(data, BASELINE_ONLY) is not None:  # progressive files go to PIL, not nvJPEG
                blobs.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    print(f"{len(blobs)} baseline JPEGs")
    device = torch.device("cuda")
    rng = random.Random(0)

    def run(label, counts, pinned=False):
        source = [b.pin_memory() for b in blobs] if pinned else blobs
        torch.cuda.synchronize()
        wall = cpu = 0.0
        for count in counts:
            batch = rng.sample(source, count)
            t0, c0 = time.perf_counter(), time.thread_time()
            decode_jpeg(batch, mode=ImageReadMode.RGB, device=device)
            wall += time.perf_counter() - t0
            cpu += time.thread_time() - c0
        torch.cuda.synchronize()
        calls, files = len(counts), sum(counts)
        print(
            f"{label}: {1e3 * wall / calls:.2f} ms/call wall, {1e3 * cpu / calls:.2f} CPU; "
            f"per file {1e3 * wall / files:.4f} ms wall, {1e3 * cpu / files:.4f} CPU"
        )

    run("warm-up", [256] * 3)
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
