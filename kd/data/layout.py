"""The ImageNet layout of a data folder (``DIR/train/<class>/*.jpg``, ``DIR/val/<class>/*.jpg``)
or a prepared copy of one: its classes and samples, and the checks that refuse an unusable one,
without torch (``kd train`` answers a mistaken ``--data`` before torch is imported)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from kd.data.prepared import is_prepared, open_copy, read_manifest
from kd.errors import KDError

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _scan_split(root: Path, split: str) -> Tuple[List[str], List[Tuple[str, int]], List[str]]:
    """Classes, (path, label) pairs and the ``split/<class>`` folders that hold no image."""
    folder = root / split
    if not folder.is_dir():
        raise KDError(f"data folder {root} has no {split}/ subfolder (expected {root}/{split}/<class>/*.jpg)")
    classes = _classes(folder)
    samples: List[Tuple[str, int]] = []
    empty: List[str] = []
    for label, cls in enumerate(classes):
        count = len(samples)
        for dirpath, _, files in sorted(os.walk(folder / cls, followlinks=True)):
            for fname in sorted(files):
                if fname.lower().endswith(IMG_EXTENSIONS):
                    samples.append((os.path.join(dirpath, fname), label))
        if len(samples) == count:
            empty.append(f"{split}/{cls}")
    if not samples:
        raise KDError(f"{folder} has class folders but no images ({', '.join(IMG_EXTENSIONS[:3])}, ...)")
    return classes, samples, empty


def _refuse_empty(root: Path, empty: List[str]) -> None:
    """A class folder without images would still get a label and an output of the model: refuse it."""
    if empty:
        shown = ", ".join(empty[:6]) + (f" and {len(empty) - 6} more" if len(empty) > 6 else "")
        raise KDError(
            f"class folder{'s' if len(empty) > 1 else ''} with no image ({', '.join(IMG_EXTENSIONS[:3])}, "
            f"...) in {root}: {shown}; add images, or remove the class from both train/ and val/"
        )


def scan_split(root: Path, split: str) -> Tuple[List[str], Sequence[Tuple[str, int]]]:
    """Class names and (path, label) pairs of ``root/split/<class>/*`` (or the split of a prepared
    copy); KDError if unusable, a class folder without images included."""
    if is_prepared(root):
        classes, train, val = open_copy(root)
        return classes, train if split == "train" else val
    classes, samples, empty = _scan_split(root, split)
    _refuse_empty(root, empty)
    return classes, samples


def check_data(data: str) -> None:
    """``--data``: 'synthetic', a folder with train/ and val/ subfolders, or a prepared copy; the
    layout refused as :func:`scan` would refuse it (no class folder, no image, a class folder
    without images, classes that differ between train/ and val/), reading only until each class
    folder's first image, so a mistake is answered before any model or loader is made."""
    if data == "synthetic":
        return
    if is_prepared(Path(data)):
        read_manifest(Path(data))  # one that kd cannot read fails here, before anything starts
        return
    for split in ("train", "val"):
        if not (Path(data) / split).is_dir():
            what = "does not exist" if not Path(data).is_dir() else f"has no {split}/ subfolder"
            raise KDError(f"data folder {data} {what} (expected DIR/train/<class>/*.jpg and DIR/val/<class>/*.jpg)")
    root = Path(data)
    classes: Dict[str, List[str]] = {}
    empty: List[str] = []
    for split in ("train", "val"):
        classes[split] = _classes(root / split)
        split_empty = [f"{split}/{cls}" for cls in classes[split] if not _has_image(root / split / cls)]
        if len(split_empty) == len(classes[split]):
            raise KDError(f"{root / split} has class folders but no images ({', '.join(IMG_EXTENSIONS[:3])}, ...)")
        empty += split_empty
    _refuse_empty(root, empty)
    _refuse_different(data, classes["train"], classes["val"])


def _classes(folder: Path) -> List[str]:
    """The class folders of a split, sorted; KDError where there is none."""
    classes = sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise KDError(f"{folder} has no class folders (expected {folder}/<class>/*.jpg)")
    return classes


def _has_image(folder: Path) -> bool:
    """Whether ``folder`` or a folder below it (links followed, as :func:`scan` does) holds an
    image; it stops at the first."""
    below = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_dir():
                below.append(entry.path)
            elif entry.name.lower().endswith(IMG_EXTENSIONS):
                return True
    return any(_has_image(Path(path)) for path in sorted(below))


def _refuse_different(root: str, classes: List[str], val_classes: List[str]) -> None:
    if val_classes != classes:
        only_train = sorted(set(classes) - set(val_classes))
        only_val = sorted(set(val_classes) - set(classes))
        detail = "; ".join(
            s
            for s in (
                f"only in train: {', '.join(only_train[:3])}" if only_train else "",
                f"only in val: {', '.join(only_val[:3])}" if only_val else "",
            )
            if s
        )
        raise KDError(f"train/ and val/ of {root} have different classes ({detail})")


def scan(root: str) -> Tuple[List[str], Sequence[Tuple[str, int]], Sequence[Tuple[str, int]]]:
    """Classes, train samples and val samples of an ImageNet-layout folder, or of a prepared copy
    of one (``kd prepare``: :class:`kd.data.prepared.Prepared` sample lists)."""
    path = Path(root)
    if not path.is_dir():
        raise KDError(f"data folder {root} does not exist")
    if is_prepared(path):
        return open_copy(path)
    classes, train, empty_train = _scan_split(path, "train")
    val_classes, val, empty_val = _scan_split(path, "val")
    _refuse_empty(path, empty_train + empty_val)
    _refuse_different(root, classes, val_classes)
    return classes, train, val
