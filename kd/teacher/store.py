"""A store of the teacher's outputs on kd's own training crops: written once by ``kd teach``, read
by ``kd train --soft-labels STORE`` in place of the teacher's forward (the idea of FKD: Shen and
Xing, "A Fast Knowledge Distillation Framework for Visual Recognition", ECCV 2022).

kd draws every training crop and flip from a per-sample seed, a pure function of (seed, epoch,
sample index) (:mod:`kd.data.sampler`), whatever the loader, the ranks or the batch size. So a
store needs no crop boxes: the manifest pins what the crops depend on (the data's listing, the
image size, the crop scale, the seed), and the store keeps, per epoch and per sample, the
teacher's logits on that sample's crop:

* all of them (``k`` = the number of classes), in float16 or float32: the student trained from a
  float32 store of every logit is the student trained with the live teacher, bit for bit;
* or the ``k`` largest with their classes and the log-sum-exp of the other logits. The other
  classes then get one shared logit such that the softmax at temperature 1 keeps the k largest
  probabilities and spreads the rest of the mass evenly over the other classes: FKD's "marginal
  smoothing" (its ``marginal_smoothing_k5`` / ``_k10`` soft labels, which keep the top-k
  probabilities and their classes), written as logits so that every logit loss, at any
  temperature, reads a full row.

Layout: ``kd-soft-labels.json`` (the manifest: format, teacher, its weights' checksum, data
listing checksum, image size, crop scale, seed, k, dtype, epochs, the epochs complete, each
complete epoch's files with their sizes and sha256 and its largest |logit|, and a sha256 of the
manifest's own content, checked at every read) and per
epoch ``epoch-NNN.values.npy`` (samples x k), plus ``epoch-NNN.classes.npy`` (int16 or int32)
and ``epoch-NNN.rest.npy`` (float32) where k is less than the number of classes, and
``epoch-NNN.written.npy`` (one byte a sample: its row was written; a row the teacher never saw,
an image unreadable when it was taught, is refused when a run asks for it), and
``kd-teach-log.jsonl`` (a line per kd teach run: its epochs, seconds and img/s). An epoch is
written under ``.partial`` names and renamed once every rank has written its samples, so a
stopped ``kd teach`` starts again at its first incomplete epoch.

A store never holds a non-finite value: the stored dtype follows the teacher's largest |logit| on
its probe batches (:func:`choose_dtype`), every batch is checked as stored (on the device) before
its epoch is committed, and a run from the store checks the manifest's record of those checks and
its files' sizes at its start, and every row it reads (its logits finite, its classes in range:
:func:`damaged_row`, on the host, where the rows are read); :func:`verify` reads every byte again
(``kd verify``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from kd import checksum
from kd.data.augment import augment_key
from kd.errors import KDError
from kd.runfolder import LOCK_FILE, why_unwritable, write_json
from kd.teacher.source import Targets

FORMAT = 2  # 2: checksums of each epoch's files and of the manifest, each epoch's largest |logit|
MANIFEST = "kd-soft-labels.json"
TEACHING_LOG = "kd-teach-log.jsonl"  # a line per kd teach run: its epochs, seconds, img/s, processes, device
DTYPES = {"float16": np.float16, "float32": np.float32}
FLOAT16_MAX = 65504.0
#: ``--logits-dtype auto`` stores float16 where the teacher's largest |logit| on its probe batches is
#: at most this: float16 rounds such a logit by at most 1/16, with 256 times float16's range above
#: it for crops the probe did not see (each written batch is checked all the same)
FLOAT16_AUTO_LARGEST = 256.0
#: the manifest's keys a run must match (what the crops and the labels depend on)
PINNED = ("listing_sha256", "samples", "classes", "image_size", "min_crop_scale", "seed", "augment")


def is_store(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def file_sha256(path: str) -> Optional[str]:
    """SHA-256 of a weights file (None for a named or no weight, which the manifest records by name)."""
    return checksum.file_sha256(path) if os.path.isfile(path) else None


def listing_sha256(samples: Sequence[Tuple[str, int]]) -> str:
    """A checksum of the training split: each sample's place, file name and label, in order."""
    digest = hashlib.sha256()
    for path, label in samples:
        digest.update(f"{os.path.basename(os.path.dirname(path))}/{os.path.basename(path)}\t{label}\n".encode())
    return digest.hexdigest()


def wanted_manifest(cfg, samples, classes: int) -> Dict[str, Any]:
    """What a store for ``cfg`` pins (:data:`kd.teacher.store.PINNED`), from its training split."""
    return {
        "listing_sha256": listing_sha256(samples),
        "samples": len(samples),
        "classes": classes,
        "image_size": cfg.image_size,
        "min_crop_scale": cfg.min_crop_scale,
        "seed": cfg.seed,
        "augment": augment_key(cfg),  # None without them: a store written before they existed matches
    }


def epoch_bytes(samples: int, classes: int, k: int, dtype: str) -> int:
    """Bytes one epoch takes on disk (the .npy headers aside)."""
    width = np.dtype(DTYPES[dtype]).itemsize
    if k >= classes:
        return samples * (classes * width + 1)
    return samples * (k * (width + np.dtype(class_dtype(classes)).itemsize) + 4 + 1)


def disk_bytes(samples: int, classes: int, k: int, dtype: str, epochs: int, block: int) -> int:
    """Bytes ``epochs`` epochs and the manifest take on a disk of ``block``-byte blocks: each file
    with its .npy header, rounded up to whole blocks (a small store on a tmpfs takes a page a file)."""
    width = np.dtype(DTYPES[dtype]).itemsize
    sizes = [samples * min(k, classes) * width, samples]  # values, written
    if k < classes:
        sizes += [samples * k * np.dtype(class_dtype(classes)).itemsize, samples * 4]  # classes, rest
    whole = sum(-(-(128 + size) // block) * block for size in sizes)
    manifest = -(-(4096 + 1200 * epochs) // block) * block  # its listing grows an epoch at a time
    return epochs * whole + 2 * manifest + block  # the manifest and its replacement, the teaching log


def class_dtype(classes: int):
    return np.int16 if classes <= np.iinfo(np.int16).max else np.int32


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"  # pragma: no cover


# ----------------------------------------------------------------------------- compress / expand
def compress(logits: torch.Tensor, k: int) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """float32 ``logits`` (B x C) -> (values B x k, classes B x k or None, the log-sum-exp of the
    classes not kept B or None)."""
    if k >= logits.shape[1]:
        return logits, None, None
    values, classes = logits.topk(k, dim=1)
    rest = torch.logsumexp(logits.scatter(1, classes, float("-inf")), dim=1)
    return values, classes, rest


def expand(values: torch.Tensor, classes: Optional[torch.Tensor], rest: Optional[torch.Tensor], num_classes: int):
    """Full float32 logits (B x C) from a store's row: as stored where it holds every logit; else
    the k stored logits in their classes and one shared logit ``c`` in every other class, with
    ``(C - k) * exp(c)`` the mass of the classes not kept (``rest``, their log-sum-exp): FKD's
    marginal smoothing at temperature 1. ``c`` comes from ``rest`` alone, never from a difference
    of the rounded values, and stays at most the smallest kept logit."""
    values = values.float()
    if classes is None:
        return values
    assert rest is not None
    shared = torch.minimum(rest.float() - math.log(num_classes - values.shape[1]), values.min(dim=1).values)
    out = shared[:, None].expand(-1, num_classes).clone()
    return out.scatter_(1, classes.long(), values)


# ----------------------------------------------------------------------------- manifest
def _where(root: Path, flag: str) -> str:
    return f"{flag} {root}" if flag else f"soft-label store {root}"


def manifest_sha256(manifest: Dict[str, Any]) -> str:
    """The manifest's own checksum: of its content (``manifest_sha256`` aside), keys sorted."""
    content = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def read_manifest(root: Path, flag: str = "--soft-labels") -> Dict[str, Any]:
    """The store's manifest, refused in one line where it is missing, unreadable, of another
    format, or edited by hand or damaged (its checksum does not match its content)."""
    where = _where(root, flag)
    try:
        manifest = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KDError(f"{where}: not a soft-label store (no {MANIFEST}); write one with kd teach") from None
    except (OSError, ValueError) as exc:
        raise KDError(f"{where}: {MANIFEST} cannot be read ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise KDError(
            f"{where}: store format {got}, this kd reads format {FORMAT} (with checksums, every row checked "
            f"finite); write it again with this kd's kd teach into a new --out"
        )
    if manifest.get("manifest_sha256") != manifest_sha256(manifest):
        raise KDError(
            f"{where}: {MANIFEST} was edited or damaged (its checksum does not match its content); "
            f"write the store again with kd teach"
        )
    return manifest


def write_manifest(root: Path, manifest: Dict[str, Any]) -> None:
    """``manifest`` with its own checksum, whole or not at all; a full disk in one line."""
    manifest["manifest_sha256"] = manifest_sha256(manifest)
    try:
        write_json(root / MANIFEST, manifest)
    except OSError as exc:
        tmp = root / (MANIFEST + ".tmp")
        tmp.unlink(missing_ok=True)
        raise disk_error(root, exc) from None


def disk_error(root: Path, exc: OSError) -> KDError:
    """What kd teach says where the store cannot be written (a full disk, most often)."""
    fix = "free space" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "fix that"
    return KDError(
        f"cannot write the soft-label store at {root}: {exc.strerror or exc}; it keeps its complete epochs: "
        f"{fix} and run the same kd teach again to continue"
    )


def choose_dtype(asked: str, largest: float, images: int, teacher: str, how: str = "as given") -> Tuple[str, str]:
    """(the dtype the logits are stored in, a log line saying why) for ``--logits-dtype asked``
    (auto, float16, float32) and the teacher's largest |logit| on ``images`` probe images; float16
    asked for where it cannot hold them is refused, before anything is written."""
    seen = f"the teacher's largest |logit| is {largest:.4g} on {images} probe image(s)"
    if not math.isfinite(largest):
        raise KDError(
            f"teacher {teacher} gives non-finite logits ({seen}); check --teacher-weights and --teacher-precision"
        )
    if asked == "auto":
        dtype = "float16" if largest <= FLOAT16_AUTO_LARGEST else "float32"
        how = "at most" if dtype == "float16" else "above"
        return dtype, f"kd teach: logits stored in {dtype} (auto: {seen}, {how} {FLOAT16_AUTO_LARGEST:.0f})"
    if asked == "float16" and largest > FLOAT16_MAX:
        raise KDError(
            f"--logits-dtype float16 cannot hold teacher {teacher}'s logits ({seen}, float16's largest is "
            f"{FLOAT16_MAX:.0f}); use --logits-dtype float32 (or auto)"
        )
    return asked, f"kd teach: logits stored in {asked} ({how}; {seen})"


def log_teaching(root: Path, record: Dict[str, Any]) -> None:
    """One more line in the store's teaching log (what teaching cost, for its break-even)."""
    with open(root / TEACHING_LOG, "a") as f:
        f.write(json.dumps(record) + "\n")


def teaching_log(root: Path) -> List[Dict[str, Any]]:
    path = root / TEACHING_LOG
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def mismatch(store: Dict[str, Any], wanted: Dict[str, Any]) -> Optional[str]:
    """Why a store made with ``store``'s settings cannot serve a run with ``wanted``'s, or None."""
    names = {
        "listing_sha256": "the training images (their listing)",
        "samples": "the number of training images",
        "classes": "the number of classes",
        "image_size": "--image-size",
        "min_crop_scale": "the crop scale (min_crop_scale)",
        "seed": "--seed",
        "augment": "timm's augmentations (--aa, --color-jitter, --reprob, --remode, --recount, --train-interpolation)",
    }
    for key in PINNED:
        if store.get(key) != wanted.get(key):
            shown = "" if key == "listing_sha256" else f": the store has {store.get(key)}, the run {wanted.get(key)}"
            if key == "listing_sha256" and store.get("data") == "synthetic":
                shown = " (synthetic tensors: the run's -b, processes and --limit-train-batches must be the store's)"
            return f"{names[key]} differ{shown}"
    return None


def check_out(root: Path) -> None:
    """``kd teach --out``: a new folder, an empty one or a store (continued where the settings
    match, :class:`kd.run.loop.Teaching` checks them); anything else is refused, untouched."""
    if root.exists() and not root.is_dir():
        raise KDError(f"--out {root} exists and is not a folder")
    if root.is_dir() and any(p.name != LOCK_FILE for p in root.iterdir()) and not is_store(root):
        raise KDError(f"--out {root} holds files that are not a soft-label store; give a new or empty folder")
    if is_store(root):
        read_manifest(root, "--out")  # one this kd cannot read fails here
    why = why_unwritable(root)
    if why:
        raise KDError(f"--out {root} cannot be written: {why}")


def _name(root: Path, epoch: int, part: str, partial: bool = False) -> Path:
    return root / f"epoch-{epoch + 1:03d}.{part}{'.partial' if partial else ''}.npy"


def parts(manifest: Dict[str, Any]) -> List[str]:
    return (["values"] if manifest["k"] >= manifest["classes"] else ["values", "classes", "rest"]) + ["written"]


def check_listing(root: Path, manifest: Dict[str, Any], flag: str = "--soft-labels") -> None:
    """The cheap check at a run's start: each complete epoch listed with its files and its check
    (every row finite as stored, its largest |logit|), and each file there with the listed size."""
    where = _where(root, flag)
    done, listed = int(manifest.get("epochs_done", 0)), manifest.get("epoch_files", [])
    largest = manifest.get("epoch_largest_logit", [])
    if len(listed) != done or len(largest) != done:
        raise KDError(f"{where} is damaged: its manifest lists {len(listed)} epoch(s) and says {done} are complete")
    for epoch, files in enumerate(listed):
        if sorted(files) != sorted(parts(manifest)) or not math.isfinite(largest[epoch]):
            raise KDError(f"{where} is damaged: its manifest's listing of epoch {epoch + 1} is not a checked epoch's")
        for part, record in files.items():
            path = _name(root, epoch, part)
            try:
                size = path.stat().st_size
            except OSError as exc:
                raise KDError(f"{where} is damaged: {path.name} cannot be read ({exc.strerror})") from None
            if size != record["bytes"]:
                raise KDError(
                    f"{where} is damaged: {path.name} holds {size} bytes, its manifest says {record['bytes']}; "
                    f"teach the store again"
                )


#: a float dtype a store holds: its bits read as an unsigned integer, and its exponent's bits (all
#: set: inf or NaN)
EXPONENT_BITS = {np.dtype(np.float16): (np.uint16, 0x7C00), np.dtype(np.float32): (np.uint32, 0x7F800000)}


def damaged_row(part: str, block: np.ndarray, classes: int) -> Optional[Tuple[int, str]]:
    """The first of ``block``'s rows (rows of a store's ``part`` file) that kd teach never writes,
    and what it holds: a logit that is not finite (``values``, ``rest``), a class outside the
    ``classes`` (``classes``); None where every row is sound. Integer comparisons, vectorised: a
    float16 batch of 256 x 1,000 logits in about 20 us (docs/benchmarks.md)."""
    if part not in ("values", "rest", "classes") or not block.size:
        return None
    if part == "classes":
        if block.min() >= 0 and block.max() < classes:
            return None
        bad = (block < 0) | (block >= classes)
        row = int(np.argmax(bad.any(axis=1)))
        return row, f"class {int(block[row][bad[row]][0])}, the store's classes are 0 to {classes - 1}"
    uint, exponent = EXPONENT_BITS[block.dtype]
    bits = np.ascontiguousarray(block).view(uint) & exponent
    if bits.max() < exponent:
        return None
    return int(np.argmax((bits == exponent).reshape(len(block), -1).any(axis=1))), "a non-finite logit"


def verify(root: Path) -> str:
    """Every byte of the store at ``root`` read again: each file against its sha256 in the manifest
    (itself checked against its own), and every stored logit (the top-k rows' log-sum-exp too)
    finite. Raises :class:`KDError` naming the first damaged file; returns a one-line summary."""
    root = Path(root)
    manifest = read_manifest(root, flag="")
    check_listing(root, manifest, flag="")
    where, total = _where(root, ""), 0
    for epoch, files in enumerate(manifest["epoch_files"]):
        for part, record in files.items():
            path = _name(root, epoch, part)
            try:
                digest = checksum.file_sha256(path)
            except OSError as exc:
                raise KDError(checksum.unreadable(path, exc)) from None
            if digest != record["sha256"]:
                raise KDError(f"{where} is damaged: {path.name} does not match its checksum; teach the store again")
            total += record["bytes"]
            array = np.load(path, mmap_mode="r")
            for start in range(0, len(array), 1 << 16):  # a block of rows at a time: bounded memory
                found = damaged_row(part, array[start : start + (1 << 16)], int(manifest["classes"]))
                if found is not None:
                    raise KDError(f"{where} is damaged: {path.name}, row {start + found[0]}: {found[1]}")
            del array
    m = manifest
    kept = "every logit" if m["k"] >= m["classes"] else f"the top {m['k']} logits"
    return (
        f"{root}: a sound soft-label store: {m['epochs_done']} epoch(s) of {m['samples']:,} samples, {kept} in "
        f"{m['dtype']}; {human(total)} read, every file matches its sha256, every logit is finite and every "
        f"class one of the {m['classes']}"
    )


# ----------------------------------------------------------------------------- reading
class SoftLabels:
    """A store opened for a run: the teacher's logits of a batch's samples in an epoch."""

    def __init__(
        self,
        root: Path,
        wanted: Dict[str, Any],
        epochs: int,
        teacher: Optional[str] = None,
        device: Optional[torch.device] = None,
    ):
        """``wanted``: the run's :func:`wanted_manifest`; ``teacher``: the run's --teacher, if given;
        ``device``: where :meth:`targets` puts the logits (the CPU where not given)."""
        self.root = root
        self.device = device if device is not None else torch.device("cpu")
        self.epoch = 0
        self.manifest = read_manifest(root)
        why = mismatch(self.manifest, wanted)
        if why is None and teacher is not None and teacher != self.manifest.get("teacher"):
            why = f"its teacher is {self.manifest.get('teacher')}, the run's --teacher {teacher}"
        if why:
            raise KDError(f"--soft-labels {root} was written for another run: {why}")
        done = self.manifest.get("epochs_done", 0)
        if epochs > done:
            raise KDError(
                f"--soft-labels {root} holds {done} epoch(s) of the teacher's outputs and the run wants {epochs}; "
                f"extend it with kd teach --epochs {epochs} --out {root}"
            )
        check_listing(root, self.manifest)
        self.classes = int(self.manifest["classes"])
        self._open: Dict[int, Dict[str, np.ndarray]] = {}
        #: rows the teacher never wrote (images unreadable when it was taught), over the run's epochs
        self.unwritten = sum(int((self._load(e, "written") == 0).sum()) for e in range(epochs))

    def describe(self) -> str:
        m = self.manifest
        kept = "every logit" if m["k"] >= m["classes"] else f"the top {m['k']} logits (marginal smoothing for the rest)"
        return (
            f"teacher {m['teacher']} from the soft-label store {self.root}: {kept} in {m['dtype']}, "
            f"{m['epochs_done']} epoch(s), taught through the {m.get('loader', '?')} loader; no teacher forward"
            + (
                f"; {self.unwritten} row(s) missing (images unreadable when it was taught: a run that reads them stops)"
                if self.unwritten
                else ""
            )
        )

    def _load(self, epoch: int, part: str) -> np.ndarray:
        path = _name(self.root, epoch, part)
        try:
            array = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise KDError(f"--soft-labels {self.root} is damaged: {path.name} cannot be read ({exc})") from None
        if len(array) != self.manifest["samples"]:
            raise KDError(f"--soft-labels {self.root} is damaged: {path.name} holds {len(array)} rows")
        return array

    def _epoch(self, epoch: int) -> Dict[str, np.ndarray]:
        if epoch not in self._open:
            self._open = {epoch: {p: self._load(epoch, p) for p in parts(self.manifest)}}  # one epoch open at a time
        return self._open[epoch]

    def logits(self, epoch: int, indices: torch.Tensor, device: torch.device) -> torch.Tensor:
        """float32 logits (B x classes) on ``device`` for the samples ``indices`` of ``epoch``."""
        files = self._epoch(epoch)
        rows = indices.numpy()
        written = files["written"][rows]
        if not written.all():
            missing = int(rows[np.argmin(written)])
            raise KDError(
                f"--soft-labels {self.root} has no logits for training image {missing} in epoch {epoch + 1} "
                f"(it was unreadable when the store was taught); teach the store again, or fix the image"
            )
        read = {p: np.ascontiguousarray(a[rows]) for p, a in files.items() if p != "written"}
        for part, block in read.items():
            found = damaged_row(part, block, self.classes)
            if found is not None:
                raise KDError(
                    f"--soft-labels {self.root} is damaged: {_name(self.root, epoch, part).name}, training image "
                    f"{int(rows[found[0]])}: {found[1]}; kd verify {self.root} checks the whole store, kd teach "
                    f"writes it again"
                )
        got = {p: torch.from_numpy(a) for p, a in read.items()}
        on = {p: (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True) for p, t in got.items()}
        return expand(on["values"], on.get("classes"), on.get("rest"), self.classes)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def targets(self, batch) -> Targets:
        """The stored logits of ``batch``'s samples in this epoch (:class:`kd.teacher.source.TeacherSource`)."""
        return Targets(self.logits(self.epoch, batch.indices, self.device), {})

    def close(self) -> None:
        self._open = {}


# ----------------------------------------------------------------------------- writing
def reserve(path: Path) -> None:
    """The file's blocks taken now (a memory map writes a sparse file: a full disk would end the
    process with SIGBUS at some later row); an OSError (a full disk) fails here, in one line."""
    if not hasattr(os, "posix_fallocate"):
        return
    with open(path, "rb+") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without it: sparse as before
                return
            raise KDError(f"cannot write the soft-label store at {path.parent}: {exc.strerror}") from None


class EpochWriter:
    """One epoch's files, opened by every rank (rank 0 made them); rows written at sample indices,
    each batch checked as stored (on the device): :attr:`nonfinite` counts the rows that are not
    finite, :attr:`largest` is the largest |logit| written."""

    def __init__(self, root: Path, epoch: int, manifest: Dict[str, Any], create: bool, device=None):
        self.root, self.epoch, self.k = root, epoch, int(manifest["k"])
        self.dtype = {"float16": torch.float16, "float32": torch.float32}[manifest["dtype"]]
        n, k, classes = int(manifest["samples"]), int(manifest["k"]), int(manifest["classes"])
        shapes: Dict[str, Tuple[Tuple[int, ...], Any]] = {"values": ((n, min(k, classes)), DTYPES[manifest["dtype"]])}
        if k < classes:
            shapes.update(classes=((n, k), class_dtype(classes)), rest=((n,), np.float32))
        shapes["written"] = ((n,), np.uint8)
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        self.largest = torch.zeros((), device=device)
        self.files = {}
        for part, (shape, dtype) in shapes.items():
            path = _name(root, epoch, part, partial=True)
            if create:
                try:
                    self.files[part] = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
                    reserve(path)
                except (OSError, KDError) as exc:  # a full disk: this epoch's files go, the complete ones stay
                    self.discard()
                    raise exc if isinstance(exc, KDError) else disk_error(root, exc) from None
            else:
                self.files[part] = np.load(path, mmap_mode="r+")

    def write(self, indices: torch.Tensor, logits: torch.Tensor) -> None:
        values, classes, rest = compress(logits.float(), self.k)
        stored = values.to(self.dtype)  # rounded on the device, as the file holds it, and checked there
        bad = ~torch.isfinite(stored).all(dim=1)
        if rest is not None:
            bad |= ~torch.isfinite(rest)
        self.nonfinite += bad.sum()
        self.largest = torch.maximum(self.largest, logits.detach().abs().max().float())
        rows = indices.numpy()
        self.files["values"][rows] = stored.cpu().numpy()
        if classes is not None and rest is not None:
            self.files["classes"][rows] = classes.cpu().numpy()
            self.files["rest"][rows] = rest.cpu().numpy()
        self.files["written"][rows] = 1

    def flush(self) -> None:
        for array in self.files.values():
            array.flush()
        self.files = {}

    def discard(self) -> None:
        """Rank 0: the epoch's partial files removed (a stop for a non-finite batch or a full disk)."""
        self.files = {}
        for part in ("values", "classes", "rest", "written"):
            _name(self.root, self.epoch, part, partial=True).unlink(missing_ok=True)

    def commit(self) -> Dict[str, Dict[str, Any]]:
        """Rank 0, once every rank has flushed: the epoch's files under their final names; their
        sizes and sha256, for the manifest."""
        records: Dict[str, Dict[str, Any]] = {}
        for part in ("values", "classes", "rest", "written"):
            partial = _name(self.root, self.epoch, part, partial=True)
            if partial.exists():
                with open(partial, "rb+") as f:
                    os.fsync(f.fileno())
                records[part] = {"bytes": partial.stat().st_size, "sha256": file_sha256(str(partial))}
                os.replace(partial, _name(self.root, self.epoch, part))
        return records
