"""``kd prepare SRC DST``: write a prepared copy of an ImageNet-layout folder (read by
:mod:`kd.data.prepared`), in parallel over the cores, resumable, with a progress bar.

Training images are reduced once here instead of every epoch in the loaders: their longer side
capped (``max_side``) and stored as raw RGB pixels (``raw``: the loaders decode nothing) or as
re-encoded baseline JPEGs (``jpeg``: a sixth of the size or less). Validation images keep their
source bytes. Work is cut into shards of ``shard_images`` images; each finished shard is
committed by its own small JSON file, so a stopped run starts again where it stopped. The
manifest holds the source's listing checksum and the settings: a copy of another folder, of a
folder that changed since, or with other settings is refused in one line. It also holds each
shard's, index's and paths file's SHA-256 and, sealing it, the SHA-256 of its own listing (see
:mod:`kd.data.prepared`).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import os
import shutil
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image

from kd.checksum import file_sha256
from kd.data.layout import scan
from kd.data.prepared import (
    FORMAT_VERSION,
    FORMATS,
    INDEX_DTYPE,
    MANIFEST,
    ORIGINAL,
    read_manifest,
    sealed,
    shard_name,
)
from kd.errors import KDError
from kd.runfolder import nearest_folder, why_unwritable, write_json

SPLITS = ("train", "val")
#: images sampled (evenly over the train split) for the size estimate printed before the work
ESTIMATE_SAMPLES = 64


#: ``kd prepare --format``: training images as raw RGB pixels or as re-encoded baseline JPEGs
TRAIN_FORMATS = ("raw", "jpeg")


@dataclass(frozen=True)
class Settings:
    """What a copy's training images become; validation images are always kept as they are."""

    format: str = "raw"  # raw | jpeg
    max_side: int = 256  # the longer side at most this (smaller images are kept at their size)
    quality: int = 90  # jpeg only
    shard_images: int = 1024

    def check(self) -> None:
        if self.format not in TRAIN_FORMATS:
            raise KDError(f"--format must be {' or '.join(TRAIN_FORMATS)}, got {self.format!r}")
        if self.max_side < 32:
            raise KDError(f"--max-side must be at least 32, got {self.max_side}")
        if not 1 <= self.quality <= 100:
            raise KDError(f"--quality must be between 1 and 100, got {self.quality}")
        if self.shard_images < 1:
            raise KDError("the shard size must be at least 1 image")

    def describe(self) -> str:
        kind = "raw RGB pixels" if self.format == "raw" else f"JPEG (quality {self.quality})"
        return f"{kind}, longer side at most {self.max_side}"


def size_text(nbytes: float) -> str:
    """``nbytes`` for people: 33 KB, 2.9 MB, 181.3 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes / 1e3:,.0f} KB"


def reduced_size(width: int, height: int, max_side: int) -> Tuple[int, int]:
    """(width, height) with the longer side at most ``max_side``, the aspect ratio kept."""
    scale = max_side / max(width, height)
    if scale >= 1:
        return width, height
    return max(1, round(width * scale)), max(1, round(height * scale))


def encode_train(path: str, settings: Settings) -> Tuple[bytes, int, int]:
    """The stored bytes of a training image, and its stored height and width."""
    with Image.open(path) as im:
        size = reduced_size(im.width, im.height, settings.max_side)
        if size != im.size:
            im.draft("RGB", size)  # a JPEG decodes at a fraction of its size where that keeps >= size
        img = im.convert("RGB")
        if img.size != size:
            img = img.resize(size, Image.LANCZOS)  # type: ignore[attr-defined]  # antialiased, once
    if settings.format == "raw":
        return np.asarray(img, dtype=np.uint8).tobytes(), img.height, img.width
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=settings.quality)  # baseline: the GPU decoders' fast path
    return buf.getvalue(), img.height, img.width


def original(path: str) -> Tuple[bytes, int, int]:
    """A validation image's own bytes, checked to decode, and its height and width."""
    data = Path(path).read_bytes()
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        return data, im.height, im.width


@dataclass(frozen=True)
class Job:
    """One shard: its images (source path, label) and where it goes."""

    dst: str
    split: str
    shard: int
    samples: Tuple[Tuple[str, int], ...]
    settings: Settings


def sidecar(dst: Path, split: str, shard: int) -> Path:
    """The file whose presence commits a finished shard."""
    return dst / f"{shard_name(split, shard)}.json"


def write_shard(job: Job) -> Dict[str, Any]:
    """Encode and write one shard (in a pool process); its summary, also kept in its sidecar."""
    dst = Path(job.dst)
    name = shard_name(job.split, job.shard)
    rows, paths, bad = [], [], []
    digest = hashlib.sha256()
    offset = 0
    tmp = dst / f"{name}.tmp"
    with open(tmp, "wb") as fh:
        for path, label in job.samples:
            try:
                if job.split == "train":
                    data, height, width = encode_train(path, job.settings)
                    code = FORMATS[job.settings.format]
                else:
                    data, height, width = original(path)
                    code = ORIGINAL
            except Exception as exc:  # any decoder failure: left out, and listed
                bad.append(f"{path}: {type(exc).__name__}")
                continue
            fh.write(data)
            digest.update(data)
            rows.append((job.shard, offset, len(data), label, height, width, code, zlib.crc32(data)))
            paths.append(path)
            offset += len(data)
        fh.flush()
        os.fsync(fh.fileno())  # on disk before the commit below says it is
    index = np.array(rows, dtype=INDEX_DTYPE)
    np.save(dst / f"{name}.idx.npy", index)
    os.replace(tmp, dst / name)
    summary = {"file": name, "images": len(rows), "bytes": offset, "sha256": digest.hexdigest()}
    summary.update(paths=paths, bad=bad)
    write_json(sidecar(dst, job.split, job.shard), summary)
    return summary


def listing_digest(root: Path, samples: Sequence[Tuple[str, int]]) -> str:
    """A checksum of the source's listing: every image's path (relative to ``root``), label and size."""
    digest = hashlib.sha256()
    for path, label in samples:
        digest.update(f"{os.path.relpath(path, root)}\t{label}\t{os.path.getsize(path)}\n".encode())
    return digest.hexdigest()


def estimate(samples: Sequence[Tuple[str, int]], settings: Settings) -> float:
    """Bytes per training image in the copy, from up to ESTIMATE_SAMPLES images spread over the split."""
    step = max(1, len(samples) // ESTIMATE_SAMPLES)
    sizes = []
    for path, _ in list(samples)[::step][:ESTIMATE_SAMPLES]:
        try:
            if settings.format == "raw":  # from the header alone
                with Image.open(path) as im:
                    width, height = reduced_size(im.width, im.height, settings.max_side)
                sizes.append(3 * width * height)
            else:
                sizes.append(len(encode_train(path, settings)[0]))
        except Exception:  # unreadable: the work itself lists it
            continue
    return float(np.mean(sizes)) if sizes else 0.0


def prepare(
    src: str,
    dst: str,
    settings: Settings = Settings(),
    workers: Optional[int] = None,
    overwrite: bool = False,
    echo: Callable[[str], None] = print,
    progress: bool = True,
) -> Dict[str, Any]:
    """Write (or finish) the prepared copy of ``src`` in ``dst``; returns its manifest."""
    settings.check()
    source, out = Path(src).resolve(), Path(dst).resolve()
    if out == source or source in out.parents:
        raise KDError(f"the copy {dst} cannot be inside its source {src}")
    classes, train, val = scan(str(source))
    listing = {"train": listing_digest(source, train), "val": listing_digest(source, val)}
    wanted = {"source": str(source), "listing_sha256": listing, "settings": asdict(settings)}
    done = check_destination(out, wanted, overwrite)
    if done is not None and done["format_version"] == FORMAT_VERSION:
        echo(f"kd prepare: {dst} is complete already ({done['splits']['train']['images']:,} train images)")
        return done
    if done is not None:
        echo(
            f"kd prepare: {dst} is a copy in format {done['format_version']}, its images not checked as they are "
            f"read; writing it again in format {FORMAT_VERSION}, with a CRC-32 of each image"
        )
    per_image = estimate(train, settings)
    val_bytes = sum(os.path.getsize(p) for p, _ in val)
    echo(
        f"kd prepare: {len(train):,} train images -> {settings.describe()}: about {size_text(per_image)} an "
        f"image, {size_text(per_image * len(train))}; {len(val):,} val images as they are: {size_text(val_bytes)}"
    )
    check_room(out, per_image * len(train) + val_bytes)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "kind": "kd-prepared",
        "format_version": FORMAT_VERSION,
        **wanted,
        "classes": classes,
        "complete": False,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json(out / MANIFEST, sealed(manifest))
    jobs = [
        Job(str(out), split, shard, tuple(samples[start : start + settings.shard_images]), settings)
        for split, samples in (("train", train), ("val", val))
        for shard, start in enumerate(range(0, len(samples), settings.shard_images))
    ]
    summaries = run_jobs(jobs, workers, progress)
    splits = {}
    for split, samples in (("train", train), ("val", val)):
        mine = [summaries[(split, shard)] for shard in range(-(-len(samples) // settings.shard_images))]
        index = np.concatenate([np.load(out / f"{s['file']}.idx.npy") for s in mine])
        np.save(out / f"{split}.index.npy", index)
        (out / f"{split}.paths.txt").write_text("\n".join(p for s in mine for p in s["paths"]), encoding="utf-8")
        shards = [{k: s[k] for k in ("file", "images", "bytes", "sha256")} for s in mine]
        bad = [b for s in mine for b in s["bad"]]
        splits[split] = {
            "images": len(index),
            "bytes": sum(s["bytes"] for s in mine),
            "shards": shards,
            "bad": bad,
            "index_sha256": file_sha256(out / f"{split}.index.npy"),
            "paths_sha256": file_sha256(out / f"{split}.paths.txt"),
        }
    manifest.update(splits=splits, complete=True)
    write_json(out / MANIFEST, sealed(manifest))
    for job in jobs:  # the per-shard commits and indexes are in the manifest and the split index now
        for path in (sidecar(out, job.split, job.shard), out / f"{shard_name(job.split, job.shard)}.idx.npy"):
            path.unlink(missing_ok=True)
    images, size = splits["train"]["images"], splits["train"]["bytes"]
    echo(
        f"kd prepare: {dst}: {images:,} train images in {size_text(size)} "
        f"({size_text(size / max(images, 1))} an image), {splits['val']['images']:,} val"
        + "".join(f"; {len(splits[s]['bad'])} unreadable {s} image(s) left out" for s in SPLITS if splits[s]["bad"])
        + f"; train with: kd train --data {dst} ..."
    )
    return manifest


def check_room(out: Path, total: float) -> None:
    """Refuse, before anything is written, a destination that cannot be made or that has less free
    space than the copy's estimate needs (less what an unfinished copy there holds already)."""
    why = why_unwritable(out)
    if why:
        raise KDError(f"the copy {out} cannot be written: {why}")
    written = sum(p.stat().st_size for p in out.glob("*-*.bin")) if out.is_dir() else 0
    needed, free = 1.05 * total - written, shutil.disk_usage(nearest_folder(out)).free
    if needed > free:
        raise KDError(
            f"the copy {out} needs about {size_text(needed)} more and the disk has {size_text(free)} free; "
            f"free space, or choose a smaller --max-side or --format jpeg"
        )


def check_destination(out: Path, wanted: Dict[str, Any], overwrite: bool) -> Optional[Dict[str, Any]]:
    """Refuse a destination that holds something else; the manifest of a complete copy of the same
    source and settings (nothing to do); else None. ``overwrite`` clears a copy there, whatever it
    is a copy of and whatever state it is in (the way to repair a damaged one)."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise KDError(f"{out} is a file, not a folder for a prepared copy")
    if not (out / MANIFEST).is_file():
        if any(out.iterdir()):
            raise KDError(f"{out} exists and is not a kd prepared copy; choose a new or empty folder")
        return None
    if overwrite:  # replaced whatever it holds: another copy, or this one damaged (a sealed manifest edited)
        clear(out)
        return None
    manifest = read_manifest(out)
    differs = [
        why
        for why, same in (
            (f"it is a copy of {manifest.get('source')}", manifest.get("source") == wanted["source"]),
            (
                f"{wanted['source']} changed since it was prepared (its listing differs)",
                manifest.get("listing_sha256") == wanted["listing_sha256"],
            ),
            (
                f"it was prepared with {Settings(**manifest['settings']).describe()}",
                manifest.get("settings") == wanted["settings"],
            ),
        )
        if not same
    ]
    if differs:
        raise KDError(f"{out} is not a prepared copy of this source with these settings: {differs[0]}; "
                      f"use --overwrite to replace it")  # fmt: skip
    return manifest if manifest.get("complete") else None


def clear(out: Path) -> None:
    """Remove a prepared copy's files (and nothing else) from ``out``; the manifest last, so that a
    stopped removal still leaves a folder kd recognises as its own."""
    for path in out.iterdir():
        if path.name.startswith(SPLITS) and path.is_file():
            path.unlink()
    (out / MANIFEST).unlink(missing_ok=True)


def finished(job: Job) -> Optional[Dict[str, Any]]:
    """The summary of a shard an earlier run committed, where its files are whole."""
    out = Path(job.dst)
    try:
        summary = json.loads(sidecar(out, job.split, job.shard).read_text(encoding="utf-8"))
        whole = (out / summary["file"]).stat().st_size == summary["bytes"]
        whole = whole and (out / f"{summary['file']}.idx.npy").is_file()
    except (OSError, ValueError, KeyError):
        return None
    return summary if whole else None


def run_jobs(jobs: List[Job], workers: Optional[int], progress: bool) -> Dict[Tuple[str, int], Dict[str, Any]]:
    """Every shard's summary: those committed before, and the rest written in a process pool."""
    from tqdm import tqdm

    from kd.data.loader import available_cores, default_mp_context, mp_context

    summaries = {}
    todo = []
    for job in jobs:
        summary = finished(job)
        if summary is None:
            todo.append(job)
        else:
            summaries[(job.split, job.shard)] = summary
    total = sum(len(j.samples) for j in jobs)
    bar = tqdm(
        total=total,
        initial=total - sum(len(j.samples) for j in todo),
        unit="img",
        desc="kd prepare",
        disable=not progress,
        file=sys.stderr,
    )
    workers = workers or available_cores()
    with (
        bar,
        concurrent.futures.ProcessPoolExecutor(
            max_workers=max(1, min(workers, len(todo) or 1)), mp_context=mp_context(default_mp_context())
        ) as pool,
    ):
        futures = {pool.submit(write_shard, job): job for job in todo}
        try:
            for future in concurrent.futures.as_completed(futures):
                job = futures[future]
                summaries[(job.split, job.shard)] = future.result()
                bar.update(len(job.samples))
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return summaries
