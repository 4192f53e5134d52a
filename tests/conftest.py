"""Shared fixtures: small real JPEG ImageFolders and a runner for the kd command line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent


def make_image_folder(root: Path, classes: int = 3, train_per_class: int = 8, val_per_class: int = 4,
                      size=(40, 32), seed: int = 0) -> Path:
    """ImageNet layout with learnable JPEGs: each class has its own colour and stripe direction."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"class_{c:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                w, h = size
                base = np.zeros((h, w, 3), dtype=np.float32)
                base[..., c % 3] = 180
                stripes = (np.arange(w if c % 2 else h) // 4 % 2) * 60
                base += (stripes[None, :, None] if c % 2 else stripes[:, None, None])
                base += rng.normal(0, 20, size=base.shape)
                Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).save(folder / f"{i:03d}.jpg", quality=90)
    return root


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("data"))


def run_kd(*args, cwd=None, env=None, timeout=600) -> subprocess.CompletedProcess:
    """``kd ARGS`` as a user runs it, in a fresh interpreter."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "cli", *map(str, args)], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(autouse=True)
def _few_threads():
    torch.set_num_threads(2)
    yield
