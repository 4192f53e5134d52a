"""Learnable JPEG ImageFolders for the GPU checks (benchmarks/user_path_gpu.sh) and CPU probes.

``stripes``: 100 classes of a hue, a stripe angle and a stripe period, with noise. Its classes are
the colours and the stripes' geometry, which MLKD's strong view (RandAugment's colour, rotate and
shear ops) changes. ``shapes``: 20 classes, 10 shapes filled or outlined, of random colour, size,
place and tilt on a random smooth background: classes that survive the strong view.

Usage: python benchmarks/learnable_folders.py {stripes,shapes} ROOT [--train N] [--val N]
       [--classes N] [--size MIN MAX]   (a folder that exists is left as it is)
"""

from __future__ import annotations

import argparse
import os
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ["circle", "triangle", "square", "pentagon", "hexagon", "star", "cross", "arrow", "ell", "tee"]
#: unit-sized outlines around the origin; the others are regular polygons or a star
OUTLINES = {
    "cross": [(-1, -0.3), (-0.3, -0.3), (-0.3, -1), (0.3, -1), (0.3, -0.3), (1, -0.3)]
    + [(1, 0.3), (0.3, 0.3), (0.3, 1), (-0.3, 1), (-0.3, 0.3), (-1, 0.3)],
    "arrow": [(-1, -0.3), (0.2, -0.3), (0.2, -0.8), (1, 0), (0.2, 0.8), (0.2, 0.3), (-1, 0.3)],
    "ell": [(-0.7, -1), (-0.1, -1), (-0.1, 0.4), (0.7, 0.4), (0.7, 1), (-0.7, 1)],
    "tee": [(-1, -1), (1, -1), (1, -0.4), (0.3, -0.4), (0.3, 1), (-0.3, 1), (-0.3, -0.4), (-1, -0.4)],
}


def canvas(rng: np.random.Generator, size: tuple) -> tuple:
    """(width, height) between size's bounds, a third of them portrait."""
    w, h = int(rng.integers(size[0], size[1])), int(rng.integers(size[0] * 4 // 5, size[1] * 4 // 5))
    return (h, w) if rng.random() < 0.3 else (w, h)


def stripes(c: int, classes: int, rng: np.random.Generator, size: tuple) -> Image.Image:
    w, h = canvas(rng, size)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    phase = c / classes
    hue = np.array([np.cos(2 * np.pi * (phase + k / 3)) for k in range(3)])
    angle, period = np.pi * (c % 10) / 10, 6 + 2 * (c // 10)
    wave = np.sin((x * np.cos(angle) + y * np.sin(angle)) * 2 * np.pi / period)
    img = 128 + 70 * hue[None, None] + 45 * wave[..., None] + rng.normal(0, 18, (h, w, 3))
    mode = "L" if rng.random() < 0.02 else "RGB"
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).convert(mode)


def outline(shape: str) -> np.ndarray:
    if shape in OUTLINES:
        return np.array(OUTLINES[shape], dtype=np.float64)
    if shape == "star":
        a = np.pi * np.arange(10) / 5 - np.pi / 2
        r = np.where(np.arange(10) % 2 == 0, 1.0, 0.42)
        return np.stack([r * np.cos(a), r * np.sin(a)], 1)
    n = {"circle": 72, "triangle": 3, "square": 4, "pentagon": 5, "hexagon": 6}[shape]
    a = 2 * np.pi * np.arange(n) / n - np.pi / 2
    return np.stack([np.cos(a), np.sin(a)], 1)


def shapes(c: int, classes: int, rng: np.random.Generator, size: tuple) -> Image.Image:
    w, h = canvas(rng, size)
    field = Image.fromarray(rng.integers(0, 256, (3, 4, 3), dtype=np.uint8)).resize((w, h), Image.BILINEAR)
    noisy = np.asarray(field, np.float32) + rng.normal(0, 12, (h, w, 3))
    img = Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))
    radius = min(w, h) * rng.uniform(0.25, 0.4)
    tilt = rng.uniform(-np.pi / 12, np.pi / 12)
    turn = np.array([[np.cos(tilt), -np.sin(tilt)], [np.sin(tilt), np.cos(tilt)]])
    centre = (rng.uniform(radius * 1.1, w - radius * 1.1), rng.uniform(radius * 1.1, h - radius * 1.1))
    points = [tuple(p) for p in outline(SHAPES[c % 10]) @ turn.T * radius + centre]
    colour = tuple(int(v) for v in rng.integers(0, 256, 3))
    draw = ImageDraw.Draw(img)
    if c < 10:
        draw.polygon(points, fill=colour)
    else:
        draw.line(points + points[:1], fill=colour, width=max(2, int(radius * 0.12)), joint="curve")
    return img


KINDS = {"stripes": (stripes, 100), "shapes": (shapes, 20)}


def class_name(kind: str, c: int) -> str:
    return f"{SHAPES[c % 10]}_{'filled' if c < 10 else 'outlined'}" if kind == "shapes" else f"c{c:03d}"


def write(job) -> None:
    kind, path, c, classes, seed, size = job
    rng = np.random.default_rng(seed)
    KINDS[kind][0](c, classes, rng, size).save(
        path, quality=int(rng.integers(75, 95)), progressive=bool(rng.random() < 0.1)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("root", type=Path)
    parser.add_argument("--train", type=int, default=None, help="images per class (stripes 50, shapes 250)")
    parser.add_argument("--val", type=int, default=None, help="images per class (stripes 10, shapes 50)")
    parser.add_argument("--classes", type=int, default=None, help="stripes only (100)")
    parser.add_argument("--size", type=int, nargs=2, default=(300, 500), help="the longer side's bounds")
    a = parser.parse_args()
    kind = a.kind
    classes = (a.classes or 100) if kind == "stripes" else 20
    train = a.train or (50 if kind == "stripes" else 250)
    val = a.val or (10 if kind == "stripes" else 50)
    if not (a.root / "val").is_dir():
        jobs = []
        for split, n, offset in (("train", train, 0), ("val", val, 10**6)):
            for c in range(classes):
                folder = a.root / split / class_name(kind, c)
                folder.mkdir(parents=True, exist_ok=True)
                seeds = [offset + c * 1000 + i for i in range(n)]
                jobs += [(kind, folder / f"{i:04d}.jpg", c, classes, s, tuple(a.size)) for i, s in enumerate(seeds)]
        with Pool(os.cpu_count()) as pool:
            pool.map(write, jobs, chunksize=32)
    print(f"{sum(1 for _ in a.root.rglob('*.jpg'))} JPEGs in {a.root}")


if __name__ == "__main__":
    main()
