"""JPEG decode alone on the GPU: nvImageCodec backend choices and torchvision's nvJPEG.

    python benchmarks/gpu_decoders.py --data /tmp/jpegs      # the folder loader_stages.py writes

Decodes the first ``--images`` train JPEGs in batches of ``--batch-size`` (after two warm-up
batches) and prints images/s and the mean absolute difference from PIL's pixels over 16
images. ``fancy`` is nvImageCodec's libjpeg-style chroma upsampling, which kd's decoder asks
for. nvImageCodec rows need its wheels (nvidia-nvimgcodec-cu13, nvidia-nvjpeg).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kd.data.decoders import pil_rgb  # noqa: E402


def timed(name, decode, count: int, batch: int, ref) -> None:
    for _ in range(2):
        decode(0, batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for s in range(0, count, batch):
        decode(s, batch)
    torch.cuda.synchronize()
    rate = count / (time.perf_counter() - start)
    first = decode(0, len(ref))
    diff = np.mean(
        [np.abs(first[i].permute(1, 2, 0).cpu().numpy().astype(np.float32) - ref[i]).mean() for i in range(len(ref))]
    )
    print(f"| {name} | {rate:,.0f} | {diff:.2f} |", flush=True)


def nvimgcodec_rows(arrays, count, batch, ref) -> None:
    try:
        from nvidia import nvimgcodec as nv
    except ImportError:
        print("| nvImageCodec | not installed | |")
        return
    kind = nv.BackendKind
    params = nv.DecodeParams()
    params.apply_exif_orientation = False
    params.color_spec = nv.ColorSpec.SRGB if hasattr(nv.ColorSpec, "SRGB") else nv.ColorSpec.RGB
    rows = [
        ("hardware, CUDA, hybrid; fancy (kd's)", [kind.HW_GPU_ONLY, kind.GPU_ONLY, kind.HYBRID_CPU_GPU], True),
        ("hardware, CUDA, hybrid", [kind.HW_GPU_ONLY, kind.GPU_ONLY, kind.HYBRID_CPU_GPU], False),
        ("hardware only; fancy", [kind.HW_GPU_ONLY], True),
        ("hardware only", [kind.HW_GPU_ONLY], False),
    ]
    for name, kinds, fancy in rows:
        try:
            dec = nv.Decoder(
                device_id=torch.cuda.current_device(),
                backends=[nv.Backend(k) for k in kinds],
                options=":fancy_upsampling=1" if fancy else "",
            )

            def decode(s, n, dec=dec):
                out = dec.decode(arrays[s : s + n], params=params, cuda_stream=torch.cuda.current_stream().cuda_stream)
                return [torch.as_tensor(o, device="cuda").permute(2, 0, 1) for o in out]

            timed(f"nvImageCodec {nv.__version__}: {name}", decode, count, batch, ref)
        except Exception as exc:  # a backend this GPU or build lacks
            print(f"| nvImageCodec: {name} | failed: {type(exc).__name__} {str(exc)[:80]} | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=256)
    args = ap.parse_args()
    files = sorted(args.data.glob("train/*/*.jpg"))[: args.images]
    if not files:
        raise SystemExit(f"no JPEGs under {args.data}/train/ (write them with benchmarks/loader_stages.py)")
    blobs = [f.read_bytes() for f in files]
    count = len(blobs) - len(blobs) % args.batch_size or len(blobs)
    ref = [pil_rgb(b) for b in blobs[:16]]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {count} JPEGs, batches of {args.batch_size}\n")
    print("| decoder | images/s | mean abs. difference from PIL |\n|---|---|---|")
    nvimgcodec_rows([np.frombuffer(b, dtype=np.uint8) for b in blobs], count, args.batch_size, ref)
    from torchvision.io import ImageReadMode, decode_jpeg

    tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
    timed(
        "torchvision nvJPEG, batched",
        lambda s, n: decode_jpeg(tensors[s : s + n], mode=ImageReadMode.RGB, device="cuda"),
        count,
        args.batch_size,
        ref,
    )


if __name__ == "__main__":
    main()
