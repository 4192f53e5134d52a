"""Reading a prepared copy (``kd prepare SRC DST``): the samples of an ImageNet-layout folder in a
few large shard files, with training images reduced so that the loaders do less per image.

A copy is a folder with a manifest (MANIFEST, JSON), and per split shard files
(``train-00000.bin``, ...), one index (``train.index.npy``: for every image its shard, byte
offset and length, label, height, width, format and the CRC-32 of its bytes) and the source
paths (``train.paths.txt``). A training image is stored as ``raw`` RGB pixels (HWC uint8,
nothing to decode) or re-encoded as ``jpeg``, its longer side capped; a validation image is its
source file's bytes, unchanged, so validation crops stay torchvision's bit for bit.
:class:`Prepared` is a split's sample list: it reads like the ``(path, label)`` list of a
folder, and opens each image from its shard (:meth:`Prepared.image`, :meth:`Prepared.data`).
Module-level and picklable: DataLoader workers receive the folder and split only, and open the
index (memory-mapped) and the shards themselves.

What is checked: the manifest carries the SHA-256 of its own listing (``contents_sha256``:
source, settings, classes, and per split the shards with their sizes and SHA-256s and the
index's and paths' SHA-256s), so a manifest edited by hand is refused wherever it is read, and
the class names a run takes come from a verified manifest. At a run's start (:func:`open_copy`)
the cheap checks: every shard's size, the index files' SHA-256 (37 bytes an image) and length.
As an image is read (:meth:`Prepared.data`, in the loaders' workers) its bytes against its
CRC-32: a KDError naming the shard and the image (format 1, without CRC-32s, is read unchecked,
and says so in the loader's log line). ``kd verify COPY`` (:func:`verify_copy`) reads
everything: every shard's SHA-256, the paths, each record within its shard.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image

from kd.checksum import file_sha256, unreadable
from kd.errors import KDError

MANIFEST = "kd-prepared.json"
#: shard files a process keeps open at once (a sampler's order visits them all, every batch)
MAX_OPEN_SHARDS = 64
#: 2: each image's CRC-32 in its index record, checked as the image is read
FORMAT_VERSION = 2
#: the formats this kd reads: format 1's images are read unchecked (its index has no CRC-32s)
READ_FORMATS = (1, 2)
#: the index's record: where an image's bytes are, what they are, where they came from, and the
#: CRC-32 of its bytes (format 2 on; format 1's records end with ``format``)
INDEX_DTYPE = np.dtype(
    [
        ("shard", "<i4"),
        ("offset", "<i8"),
        ("length", "<i8"),
        ("label", "<i4"),
        ("height", "<i4"),
        ("width", "<i4"),
        ("format", "<i1"),
        ("crc32", "<u4"),
    ]
)
#: index ``format`` codes: raw RGB pixels, a JPEG kd encoded, the source file's bytes
RAW, JPEG, ORIGINAL = 0, 1, 2
FORMATS = {"raw": RAW, "jpeg": JPEG, "original": ORIGINAL}
#: the manifest's keys its own checksum covers (``kind``, ``format_version``, ``complete`` and
#: ``created`` are checked or harmless on their own)
SEALED = ("source", "listing_sha256", "settings", "classes", "splits")


def is_prepared(root: Path) -> bool:
    return (root / MANIFEST).is_file()


def read_manifest(root: Path) -> Dict[str, Any]:
    """The manifest of the copy in ``root``; KDError (one line) for a manifest kd cannot use."""
    path = root / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KDError(f"{path} is not a readable kd prepared-copy manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != "kd-prepared":
        raise KDError(f"{path} is not a kd prepared-copy manifest")
    version = manifest.get("format_version")
    if version not in READ_FORMATS:
        raise KDError(
            f"{root} is a prepared copy in format {version}; this kd reads format "
            f"{' or '.join(map(str, READ_FORMATS))}: prepare it again with this kd "
            f"(kd prepare SOURCE {root} --overwrite)"
        )
    # a manifest from before kd sealed them has no checksum (nor its index files' sums), and is read as it was
    splits = manifest.get("splits") or {}
    if "contents_sha256" not in manifest and any("index_sha256" in split for split in splits.values()):
        raise KDError(
            f"{path} was changed after kd prepare wrote it (its seal removed): restore it from where the "
            f"copy came from, or prepare the copy again (kd prepare {manifest.get('source')} {root} --overwrite)"
        )
    if "contents_sha256" in manifest and manifest["contents_sha256"] != contents_sha256(manifest):
        raise KDError(
            f"{path} was changed after kd prepare wrote it (its listing no longer matches its checksum): "
            f"restore it from where the copy came from, or prepare the copy again (kd prepare "
            f"{manifest.get('source')} {root} --overwrite)"
        )
    return manifest


def contents_sha256(manifest: Dict[str, Any]) -> str:
    """The SHA-256 of a manifest's listing (the keys of SEALED), in a canonical JSON form."""
    sealed = {key: manifest[key] for key in SEALED if key in manifest}
    text = json.dumps(sealed, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def sealed(manifest: Dict[str, Any]) -> Dict[str, Any]:
    """``manifest`` with the checksum of its listing (what kd prepare writes)."""
    return {**manifest, "contents_sha256": contents_sha256(manifest)}


def checked_sha256(path: Path) -> str:
    """:func:`kd.checksum.file_sha256`, an unreadable file a KDError of one line."""
    try:
        return file_sha256(path)
    except OSError as exc:
        raise KDError(unreadable(path, exc)) from None


def damaged(root: Path, manifest: Dict[str, Any], what: str) -> KDError:
    return KDError(
        f"prepared copy {root} is damaged: {what}; prepare it again "
        f"(kd prepare {manifest.get('source')} {root} --overwrite)"
    )


def open_copy(root: Path) -> Tuple[List[str], Prepared, Prepared]:
    """Classes, train samples and val samples of the complete prepared copy in ``root``."""
    manifest = read_manifest(root)
    if not manifest.get("complete"):
        raise KDError(
            f"{root} is an unfinished prepared copy of {manifest.get('source')}; finish it with: "
            f"kd prepare {manifest.get('source')} {root}"
        )
    check_files(root, manifest)
    return list(manifest["classes"]), Prepared(root, "train"), Prepared(root, "val")


def check_files(root: Path, manifest: Dict[str, Any]) -> None:
    """The cheap checks of a complete copy against its manifest: every shard's size, and each
    split's index (SHA-256, where the manifest has it, and length)."""
    for split in ("train", "val"):
        listing = manifest["splits"][split]
        for shard in listing["shards"]:
            path = root / shard["file"]
            size = path.stat().st_size if path.is_file() else None
            if size != shard["bytes"]:
                found = "missing" if size is None else f"{size:,} bytes, not {shard['bytes']:,}"
                raise damaged(root, manifest, f"{shard['file']} is {found}")
        index = root / f"{split}.index.npy"
        if not index.is_file():
            raise damaged(root, manifest, f"{index.name} is missing")
        if "index_sha256" in listing and checked_sha256(index) != listing["index_sha256"]:
            raise damaged(root, manifest, f"{index.name} does not match its SHA-256 in the manifest")
        try:
            count = len(np.load(index, mmap_mode="r"))
        except (OSError, ValueError) as exc:
            raise damaged(root, manifest, f"{index.name} cannot be read ({exc})") from None
        if count != listing["images"]:
            raise damaged(root, manifest, f"{index.name} lists {count:,} images, the manifest {listing['images']:,}")


def verify_copy(root: Path, echo=print) -> str:
    """Every byte of the complete copy in ``root`` against its manifest, a line through ``echo``
    per file (``OK``, or ``DAMAGED: why`` and a KDError for the first damage); returns a summary."""
    root = Path(root)
    manifest = read_manifest(root)
    if not manifest.get("complete"):
        source = manifest.get("source")
        raise KDError(f"{root} is an unfinished prepared copy; finish it with: kd prepare {source} {root}")
    sealed_note = "" if "contents_sha256" in manifest else " (no checksum of its own: written by an older kd)"
    if manifest["format_version"] != FORMAT_VERSION:
        sealed_note += (
            f" (format {manifest['format_version']}: its images are not checked as a run reads them; "
            f"kd prepare {manifest.get('source')} {root} adds the check)"
        )
    echo(f"{root / MANIFEST}: OK{sealed_note}")
    shards = files = 0
    for split in ("train", "val"):
        listing = manifest["splits"][split]
        sizes = []
        for shard in listing["shards"]:
            path = root / shard["file"]
            problem = None
            if not path.is_file():
                problem = "missing"
            elif path.stat().st_size != shard["bytes"]:
                problem = f"{path.stat().st_size:,} bytes, not {shard['bytes']:,}"
            elif checked_sha256(path) != shard["sha256"]:
                problem = "its bytes do not match its SHA-256 in the manifest"
            if problem:
                echo(f"{path}: DAMAGED: {problem}")
                raise damaged(root, manifest, f"{shard['file']}: {problem}")
            echo(f"{path}: OK")
            sizes.append(shard["bytes"])
            shards += 1
        for name, key in ((f"{split}.index.npy", "index_sha256"), (f"{split}.paths.txt", "paths_sha256")):
            path = root / name
            problem = None
            if not path.is_file():
                problem = "missing"
            elif key in listing and checked_sha256(path) != listing[key]:
                problem = "its bytes do not match its SHA-256 in the manifest"
            if problem:
                echo(f"{path}: DAMAGED: {problem}")
                raise damaged(root, manifest, f"{name}: {problem}")
            files += 1
        records = np.load(root / f"{split}.index.npy", mmap_mode="r")
        problem = records_problem(records, np.array(sizes, dtype=np.int64), len(manifest["classes"]), listing["images"])
        if problem:
            echo(f"{root / f'{split}.index.npy'}: DAMAGED: {problem}")
            raise damaged(root, manifest, f"{split}.index.npy: {problem}")
        echo(f"{root / f'{split}.index.npy'}: OK")
        echo(f"{root / f'{split}.paths.txt'}: OK")
    total = sum(manifest["splits"][s]["bytes"] for s in ("train", "val"))
    return f"prepared copy {root}: sound ({shards} shards, {total:,} bytes, and {files} index and path files)"


def records_problem(records: np.ndarray, shard_bytes: np.ndarray, classes: int, images: int) -> Optional[str]:
    """What is wrong with a split's index (its count, a record outside its shard, a label outside the
    classes), or None."""
    if len(records) != images:
        return f"it lists {len(records):,} images, the manifest {images:,}"
    if not len(records):
        return None
    shard = records["shard"].astype(np.int64)
    if shard.min() < 0 or shard.max() >= len(shard_bytes):
        return "a record names a shard the manifest does not list"
    end = records["offset"].astype(np.int64) + records["length"].astype(np.int64)
    if (records["offset"] < 0).any() or (records["length"] < 0).any() or (end > shard_bytes[shard]).any():
        return "a record lies outside its shard"
    if (records["label"] < 0).any() or (records["label"] >= classes).any():
        return "a record's label is not one of the classes"
    return None


class Prepared(Sequence[Tuple[str, int]]):
    """One split of a prepared copy as a sample list: ``samples[i]`` is ``(source path, label)``
    as for a folder, and :meth:`image` / :meth:`data` read image ``i`` from its shard."""

    def __init__(self, root: Path, split: str):
        self.root = Path(root)
        self.split = split
        self._index: Optional[np.ndarray] = None
        self._files: OrderedDict[int, int] = OrderedDict()  # shard -> descriptor, this process's, last used last
        self._pid = os.getpid()

    def __getstate__(self) -> Dict[str, Any]:  # a worker opens the index and the shards itself
        return {"root": self.root, "split": self.split}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["root"], state["split"])  # type: ignore[misc]

    @property
    def records(self) -> np.ndarray:
        if self._index is None:
            self._index = np.load(self.root / f"{self.split}.index.npy", mmap_mode="r")
        return self._index

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i):  # type: ignore[override]  # ints only: the loaders index one sample at a time
        """``(where, label)``: ``where`` names the image in messages (``{split}.paths.txt`` line ``i``
        holds its source path; not read here, where every worker would hold them all)."""
        record = self.records[i]
        return f"{self.root / shard_name(self.split, int(record['shard']))}#{i}", int(record["label"])

    @property
    def checked(self) -> bool:
        """Whether its images are checked as they are read (their CRC-32s: format 2 on)."""
        names = self.records.dtype.names
        return names is not None and "crc32" in names

    def describe(self) -> str:
        """What the loaders read: the copy and its training images' format (for the loader's log line);
        for a copy of format 1, that its images are not checked as they are read."""
        manifest = read_manifest(self.root)
        settings = manifest["settings"]
        kind = "raw RGB pixels" if settings["format"] == "raw" else f"JPEG (quality {settings['quality']})"
        unchecked = (
            ""
            if self.checked
            else f"; format {manifest['format_version']}: its images are not checked as they are read; "
            f"kd prepare {manifest.get('source')} {self.root} adds the check"
        )
        reduced = f"longer side at most {settings['max_side']}"
        return f"the prepared copy {self.root} ({self.split}: {kind}, {reduced}{unchecked})"

    def left_out(self) -> List[str]:
        """The source files of this split that ``kd prepare`` could not read and left out of the copy
        (its manifest lists them): a validation counts them as unreadable, as on the folder."""
        bad = read_manifest(self.root)["splits"][self.split].get("bad", [])
        return [entry.rsplit(": ", 1)[0] for entry in bad]  # "path: ExceptionName"

    def format(self, i: int) -> int:
        return int(self.records[i]["format"])

    def data(self, i: int) -> bytes:
        """Image ``i``'s stored bytes (raw pixels, or an encoded file), checked against its CRC-32
        where the copy has them: damaged bytes are a KDError naming the shard and the image."""
        record = self.records[i]
        fd = self._fd(int(record["shard"]))
        data = os.pread(fd, int(record["length"]), int(record["offset"]))
        if self.checked and zlib.crc32(data) != int(record["crc32"]):
            raise self.damaged_image(i, "its bytes do not match their CRC-32")
        return data

    def damaged_image(self, i: int, why: str) -> KDError:
        """The refusal of image ``i``: its shard, its place in the split and its source file."""
        try:
            source = (self.root / f"{self.split}.paths.txt").read_text(encoding="utf-8").splitlines()[i]
        except (OSError, IndexError, UnicodeDecodeError):
            source = "its source unknown"
        shard = shard_name(self.split, int(self.records[i]["shard"]))
        return damaged(self.root, read_manifest(self.root), f"{shard}, image {i} ({source}): {why}")

    def image(self, i: int) -> Image.Image:
        """Image ``i`` as a PIL image (an opened file, or RGB pixels with no copy)."""
        record = self.records[i]
        data = self.data(i)
        if int(record["format"]) == RAW:
            size = (int(record["width"]), int(record["height"]))
            return Image.frombuffer("RGB", size, data, "raw", "RGB", 0, 1)
        return Image.open(io.BytesIO(data))

    def _fd(self, shard: int) -> int:
        """An open descriptor of ``shard``; at most MAX_OPEN_SHARDS per process (ImageNet's copy has
        over a thousand shards, more than a process may usually open), the least recently read closed."""
        if self._pid != os.getpid():  # a forked worker: its parent's descriptors are not its own to share
            self._files, self._pid = OrderedDict(), os.getpid()
        fd = self._files.get(shard)
        if fd is not None:
            self._files.move_to_end(shard)
            return fd
        while len(self._files) >= MAX_OPEN_SHARDS:
            os.close(self._files.popitem(last=False)[1])
        fd = self._files[shard] = os.open(self.root / shard_name(self.split, shard), os.O_RDONLY)
        return fd

    def close(self) -> None:
        """Close this process's descriptors (reading again opens them again)."""
        if self._pid == os.getpid():
            for fd in self._files.values():
                os.close(fd)
        self._files = OrderedDict()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit os may be gone already
            pass


def shard_name(split: str, shard: int) -> str:
    return f"{split}-{shard:05d}.bin"


def open_image(samples: Sequence[Tuple[str, int]], index: int) -> Image.Image:
    """Sample ``index`` of a folder's list (its file) or of a prepared copy (its shard), opened."""
    if isinstance(samples, Prepared):
        return samples.image(index)
    return Image.open(samples[index][0])
