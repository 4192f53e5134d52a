"""What kd's checksums cost (issue 44): writing and verifying a checkpoint of a given size, and
verifying a prepared copy of a given size, and one epoch of a soft-label store, on this machine's CPU.

A checkpoint: a dict of float32 tensors of ``--checkpoint-mb`` MB, written by ``save_atomic``
(with its sums file) against the same write without checksums (torch.save, fsync, rename, as
kd wrote before), then checked as a resume checks it (``checkpoint_io.verify``) against loading it.
A prepared copy: ``kd prepare`` (raw, longer side 256) of a folder of generated 320x240 JPEGs
sized to give about ``--copy-gb`` GB, then the check at a run's start (``open_copy``) and
``kd verify`` (every byte). Each timing is the median of ``--repeat``; files are read from the
page cache (just written), so a cold read adds the disk's read time to the SHA-256 time.

    python benchmarks/checksum_cost.py --work /tmp/kd-checksum [--checkpoint-mb 100] [--copy-gb 1]
        [--store 1281167,1000,10]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from kd.data.prepared import open_copy, verify_copy  # noqa: E402
from kd.data.prepared_writer import Settings, prepare  # noqa: E402
from kd.utils import checkpoint_io  # noqa: E402

RAW_BYTES = 256 * 192 * 3  # a 320x240 source at --max-side 256, as raw RGB pixels


def median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def plain_save(obj, path: Path) -> None:
    """kd's save_atomic before the checksums: temporary file, fsync, rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def checkpoint_costs(work: Path, mb: int, repeat: int) -> None:
    work.mkdir(parents=True, exist_ok=True)
    count = 25
    per = mb * 2**20 // 4 // count
    state = {"student": {f"layer{i}.weight": torch.randn(per) for i in range(count)}, "format": 1}
    plain, summed = work / "plain.pt", work / "last.pt"
    t_plain = median_seconds(lambda: plain_save(state, plain), repeat)
    t_summed = median_seconds(lambda: checkpoint_io.save_atomic(state, summed), repeat)

    def verify():
        checkpoint_io._verified.clear()  # as a fresh process does
        assert checkpoint_io.verify(summed) is True

    t_verify = median_seconds(verify, repeat)
    t_load = median_seconds(lambda: checkpoint_io.read(summed, "cannot load"), repeat)
    size = summed.stat().st_size
    print(f"checkpoint {size / 2**20:.0f} MiB ({size:,} bytes), median of {repeat}:")
    print(f"  write without checksum (torch.save, fsync, rename): {t_plain:.3f} s")
    print(f"  write with its sums file (save_atomic):              {t_summed:.3f} s (+{t_summed - t_plain:.3f} s)")
    print(f"  verify (SHA-256 of the file, as a resume does):      {t_verify:.3f} s")
    print(f"  load (torch.load, weights_only, for comparison):     {t_load:.3f} s")


def jpeg_folder(root: Path, images: int) -> None:
    """``images`` training JPEGs (320x240, noise over a colour per class) in 10 classes, and 10 val."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (240, 320, 3), dtype=np.uint8)
    for split, count in (("train", images), ("val", 10)):
        for i in range(count):
            folder = root / split / f"c{i % 10}"
            folder.mkdir(parents=True, exist_ok=True)
            pixels = np.roll(base, i * 7, axis=1)
            Image.fromarray(pixels).save(folder / f"{i:06d}.jpg", quality=90)


def copy_costs(work: Path, gb: float, repeat: int) -> None:
    src, dst = work / "jpegs", work / "copy"
    images = int(gb * 1e9 / RAW_BYTES)
    if not (src / "val").is_dir():
        start = time.perf_counter()
        jpeg_folder(src, images)
        print(f"wrote {images:,} JPEGs in {time.perf_counter() - start:.0f} s")
    start = time.perf_counter()
    prepare(str(src), str(dst), Settings(format="raw", max_side=256), progress=False, echo=lambda s: None)
    print(f"kd prepare in {time.perf_counter() - start:.0f} s")
    size = sum(p.stat().st_size for p in dst.iterdir() if p.is_file())
    t_start = median_seconds(lambda: open_copy(dst), repeat)
    t_verify = median_seconds(lambda: verify_copy(dst, echo=lambda s: None), repeat)
    block = os.urandom(1 << 28)
    per_gb = median_seconds(lambda: hashlib.sha256(block).hexdigest(), repeat) / len(block) * 1e9
    print(f"prepared copy {size / 1e9:.2f} GB ({size:,} bytes, {images:,} train images), median of {repeat}:")
    print(f"  a run's start check (open_copy: sizes, manifest, index SHA-256): {t_start:.3f} s")
    print(f"  kd verify (every byte):                                     {t_verify:.2f} s")
    print(f"  SHA-256 alone, of bytes in memory: {per_gb:.2f} s per GB")


def store_costs(work: Path, samples: int, classes: int, k: int) -> None:
    """One epoch of a soft-label store (float16, random logits): its commit (fsync and SHA-256 of
    each file), ``kd verify STORE`` (every byte and every row's finiteness) and a student run's
    start check (the manifest and the files' sizes)."""
    from kd.teacher import store

    root = work / "store"
    root.mkdir(parents=True, exist_ok=True)
    shape = {"samples": samples, "classes": classes, "k": k, "dtype": "float16"}
    writer = store.EpochWriter(root, 0, shape, create=True)
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for first in range(0, samples, 16384):
        rows = torch.arange(first, min(first + 16384, samples))
        writer.write(rows, torch.randn(len(rows), classes, generator=gen) * 5)
    writer.flush()
    t_write = time.perf_counter() - start
    start = time.perf_counter()
    files = writer.commit()
    t_commit = time.perf_counter() - start
    manifest = {"format": store.FORMAT, **shape, "epochs": 1, "epochs_done": 1, "epoch_files": [files]}
    store.write_manifest(root, {**manifest, "epoch_largest_logit": [float(writer.largest)]})
    start = time.perf_counter()
    store.verify(root)
    t_verify = time.perf_counter() - start
    start = time.perf_counter()
    store.check_listing(root, store.read_manifest(root))
    t_start = time.perf_counter() - start
    size = sum(f["bytes"] for f in files.values())
    kept = "every logit" if k >= classes else f"top {k}"
    print(f"store epoch {size / 1e6:.0f} MB ({samples:,} samples, {classes} classes, {kept}, float16):")
    print(f"  writing {t_write:.1f} s; commit (fsync, SHA-256) {t_commit:.2f} s; kd verify {t_verify:.2f} s; "
          f"a run's start check {t_start * 1e3:.2f} ms")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/kd-checksum"))
    parser.add_argument("--checkpoint-mb", type=int, default=100)
    parser.add_argument("--copy-gb", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--store", default="1281167,1000,10", metavar="SAMPLES,CLASSES,K", help="'' for none")
    parser.add_argument("--keep", action="store_true", help="keep --work afterwards")
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        checkpoint_costs(args.work / "ckpt", args.checkpoint_mb, args.repeat)
        if args.copy_gb > 0:
            copy_costs(args.work, args.copy_gb, args.repeat)
        if args.store:
            samples, classes, k = (int(x) for x in args.store.split(","))
            store_costs(args.work, samples, classes, k)
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
