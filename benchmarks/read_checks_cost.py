"""What kd's checks as it reads cost, on this machine's CPU: a soft-label store's rows (every
logit finite, every class in range: ``kd.teacher.store.damaged_row``) and a prepared copy's
images (each image's bytes against its CRC-32: ``Prepared.data``).

A store: batches of ``--batch`` random rows gathered from one epoch's files (memory-mapped, in the
page cache), as a student run gathers them, for every logit of ``--classes`` and for the top
``--top-k``, float16, with the check of each batch after its gather (as the run does, on rows
still in the cache) and without, per batch and per 1,281,167 samples (ImageNet-1k's epoch). A
copy: ``kd prepare`` (raw, longer side 256) of ``--images`` generated 320x240 JPEGs; every image
read through ``Prepared.data`` with its CRC-32 checked, against the same read without it, against
a training crop of it at 224 (what a loader worker does with the bytes), and zlib's CRC-32 per GB
of bytes in memory. Each timing is the median of ``--repeat``.

    python benchmarks/read_checks_cost.py [--work /tmp/kd-read-checks] [--images 400] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from checksum_cost import jpeg_folder, median_seconds  # noqa: E402

from kd.data.folder import ImageFolderPIL  # noqa: E402
from kd.data.prepared import open_copy  # noqa: E402
from kd.data.prepared_writer import Settings, prepare  # noqa: E402
from kd.teacher.store import class_dtype, damaged_row  # noqa: E402

IMAGENET_TRAIN = 1_281_167


def store_costs(work: Path, samples: int, classes: int, k: int, batch: int, repeat: int) -> None:
    """The row check of batches gathered from one epoch's files, against the gather."""
    rng = np.random.default_rng(0)
    width = min(k, classes)
    parts = {"values": (np.float16, (samples, width))}
    if k < classes:
        parts.update(classes=(class_dtype(classes), (samples, k)), rest=(np.float32, (samples,)))
    files = {}
    for part, (dtype, shape) in parts.items():
        path = work / f"epoch-001.{part}.npy"
        array = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
        for start in range(0, samples, 65536):
            rows = array[start : start + 65536]
            if part == "classes":
                rows[:] = rng.integers(0, classes, rows.shape)
            else:
                rows[:] = rng.normal(0, 5, rows.shape)
        array.flush()
        files[part] = np.load(path, mmap_mode="r")
    batches = [np.sort(rng.choice(samples, batch, replace=False)) for _ in range(200)]

    def gather(checked: bool) -> None:
        for rows in batches:
            for part, a in files.items():
                block = np.ascontiguousarray(a[rows])
                assert not checked or damaged_row(part, block, classes) is None

    gathered = median_seconds(lambda: gather(False), repeat) / len(batches)
    both = median_seconds(lambda: gather(True), repeat) / len(batches)
    per_batch = {"gather": gathered, "gather and check": both, "check": both - gathered}
    scale = IMAGENET_TRAIN / batch
    kept = "every logit" if k >= classes else f"top {k}"
    print(f"store rows, {classes} classes, {kept}, float16, batches of {batch} (median of {repeat}):")
    for name, seconds in per_batch.items():
        print(f"  {name}: {seconds * 1e6:.1f} us a batch, {seconds * scale:.2f} s per {IMAGENET_TRAIN:,} samples")
    print(f"  check / gather: {per_batch['check'] / per_batch['gather']:.1%}")


def copy_costs(work: Path, images: int, repeat: int) -> None:
    """Every image of a raw copy read with its CRC-32 checked, without it, and cropped."""
    src, dst = work / "jpegs", work / "copy"
    jpeg_folder(src, images)
    prepare(str(src), str(dst), Settings(format="raw", max_side=256), progress=False, echo=lambda s: None)
    _, train, _ = open_copy(dst)
    records = train.records
    size = int(records["length"].sum())

    def checked():
        for i in range(len(train)):
            train.data(i)

    def unchecked():
        for i in range(len(train)):
            record = records[i]
            os.pread(train._fd(int(record["shard"])), int(record["length"]), int(record["offset"]))

    pil = ImageFolderPIL(train, 224, train=True)

    def cropped():
        for i in range(len(train)):
            pil.crop((i, i))

    block = os.urandom(1 << 28)
    per_gb = median_seconds(lambda: zlib.crc32(block), repeat) / len(block) * 1e9
    times = {name: median_seconds(fn, repeat) / len(train) for name, fn in (("checked", checked),
             ("unchecked", unchecked), ("cropped", cropped))}  # fmt: skip
    print(f"prepared copy, raw at 256: {len(train):,} images of {size / len(train) / 1e3:.0f} KB (median of {repeat}):")
    print(f"  read with its CRC-32 checked: {times['checked'] * 1e6:7.1f} us an image")
    print(f"  read alone (os.pread):        {times['unchecked'] * 1e6:7.1f} us an image")
    print(f"  its training crop at 224 (PIL, read included): {times['cropped'] * 1e6:7.1f} us an image")
    extra = times["checked"] - times["unchecked"]
    print(
        f"  the check: {extra * 1e6:.1f} us an image, {extra * IMAGENET_TRAIN:.1f} s of one core per "
        f"{IMAGENET_TRAIN:,} images, {extra / times['cropped']:.1%} of a crop; zlib.crc32 {per_gb:.2f} s per GB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/kd-read-checks"))
    parser.add_argument("--samples", type=int, default=100_000, help="rows of the store's epoch files")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        for k in (args.classes, args.top_k):
            folder = args.work / f"store-{k}"
            folder.mkdir(parents=True, exist_ok=True)
            store_costs(folder, args.samples, args.classes, k, args.batch, args.repeat)
        copy_costs(args.work, args.images, args.repeat)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
