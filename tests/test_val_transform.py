"""Validation crops are torchvision's: ``Resize(resize)`` then ``CenterCrop(size)`` on the decoded
image, bit for bit on the PIL path, on non-square JPEGs of odd sizes (where rounding the long
side or flooring the offset shows), large ones too (where a reduced decode would show)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image

from kd.data.bytes_dataset import val_box
from kd.data.folder import ImageFolderPIL

SIZES = [(300, 301), (301, 300), (333, 517), (517, 333), (401, 299), (519, 311), (375, 500), (1503, 1001), (2000, 999)]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("odd")
    rng = np.random.default_rng(0)
    paths = []
    for i, (w, h) in enumerate(SIZES):
        y, x = np.mgrid[0:h, 0:w]
        pixels = np.stack([(x * 7 + y * 3) % 256, (x * x // 97 + y) % 256, (y * 5) % 256], axis=-1).astype(np.float32)
        pixels += rng.normal(0, 25, pixels.shape)
        path = root / f"{i}.jpg"
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, quality=92)
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("size,resize", [(224, 256), (224, 232), (192, 219), (160, 183)])
def test_pil_val_crops_equal_torchvision(images, size, resize):
    reference = T.Compose([T.Resize(resize), T.CenterCrop(size), T.PILToTensor()])
    dataset = ImageFolderPIL([(p, 0) for p in images], size, train=False, resize=resize)
    for i, path in enumerate(images):
        with Image.open(path) as im:
            expected = reference(im.convert("RGB"))
        got, _, _, _ = dataset[(i, 0)]
        assert torch.equal(got, expected), (SIZES[i], size, resize)


def test_the_device_path_crops_the_same_box():
    """The GPU loader's val box (in source pixels) is the region torchvision's crop keeps."""
    for w, h in SIZES:
        x1, y1, x2, y2 = val_box(h, w, 224, 256)
        new_w, new_h = (256, int(256 * h / w)) if w <= h else (int(256 * w / h), 256)
        sx, sy = w / new_w, h / new_h
        left, top = int(round((new_w - 224) / 2.0)), int(round((new_h - 224) / 2.0))
        assert (x1, y1, x2, y2) == pytest.approx((left * sx, top * sy, (left + 224) * sx, (top + 224) * sy))
