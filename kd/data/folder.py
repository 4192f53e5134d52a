"""ImageNet-layout folders read with PIL, in CPU-only, picklable, module-level code.

Workers only decode and augment; they never touch CUDA or a model. Randomness comes from
a per-sample seed carried by the sampler, so augmentation is the same whatever the number
of workers, the start method, persistent workers, or a resume in the middle of an epoch.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

from kd.data.augment import TrainAugment
from kd.data.prepared import Prepared, open_image
from kd.data.views import STRONG_AUGMENT, STRONG_CROP, strong_augment, view_seed
from kd.errors import KDError

# Pillow defines these in a loop over its enums, which mypy cannot see (Image.Resampling needs Pillow >= 9.1)
BILINEAR = Image.BILINEAR  # type: ignore[attr-defined]
BICUBIC = Image.BICUBIC  # type: ignore[attr-defined]
_FLIP_LEFT_RIGHT = Image.FLIP_LEFT_RIGHT  # type: ignore[attr-defined]


def flip_coin(gen: torch.Generator) -> bool:
    """The horizontal flip, drawn from the sample's generator after its crop (both loaders, every path)."""
    return torch.rand(1, generator=gen).item() < 0.5


def random_resized_crop_params(
    height: int, width: int, gen: torch.Generator, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)
) -> Tuple[int, int, int, int]:
    """(top, left, h, w) drawn as torchvision's RandomResizedCrop.get_params, from ``gen``."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * torch.rand(1, generator=gen).item())
        aspect = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * torch.rand(1, generator=gen).item())
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=gen).item())
            left = int(torch.randint(0, width - w + 1, (1,), generator=gen).item())
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def default_val_resize(image_size: int) -> int:
    """The short side before the validation centre crop when none is given (as for ImageNet: 256 for 224)."""
    return int(round(image_size * 256 / 224))


def val_geometry(height: int, width: int, size: int, resize: int) -> Tuple[int, int, int, int]:
    """torchvision's ``Resize(resize)`` then ``CenterCrop(size)``, as numbers: the resized width and
    height (the short side ``resize``, the long side truncated as torchvision does) and the crop's
    left and top (rounded half to even, as torchvision's ``int(round(...))``)."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = resize, int(resize * long / short)
    new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
    return new_w, new_h, int(round((new_w - size) / 2.0)), int(round((new_h - size) / 2.0))


#: A train region (ImageFolderPIL.region) of more than this many times the output's pixels is
#: resized by the worker instead (a large PNG, say, which no reduced decode shrinks): sending it
#: whole would cost more shared and pinned memory and copying than the resize saves.
MAX_REGION_AREA = 16

#: The reduced decode keeps at least this many pixels per output pixel (as Pillow's thumbnail):
#: libjpeg's block averaging then leaves the final resize a real reduction. Without it, crops of
#: detailed photos decoded at 1/8 drifted 3-6 levels from the full-size decode; with it, under 2.
REDUCING_GAP = 2


def reduced_decode(im: Image.Image, scale_x: float, scale_y: float) -> int:
    """Have libjpeg decode ``im`` at 1/2, 1/4 or 1/8 of its size (scaling in the DCT, before the
    inverse transform: the decode costs a fraction) where the result still has REDUCING_GAP
    pixels for every pixel of the full image resized by ``scale_x`` and ``scale_y``; returns the
    factor (1: full size, and for every other format). Call it before the image is loaded."""
    if im.format != "JPEG" or max(scale_x, scale_y) * REDUCING_GAP > 0.5:
        return 1
    need = (
        max(1, math.ceil(REDUCING_GAP * im.width * scale_x)),
        max(1, math.ceil(REDUCING_GAP * im.height * scale_y)),
    )
    full = im.width
    # libjpeg's choice: the largest factor that keeps both sides >= need. Pillow (>= 8, setup.cfg)
    # returns (mode, (0, 0, width / factor, height / factor)), or None where it reduces nothing; the
    # reduced size alone would round badly for tiny images.
    drafted = im.draft(im.mode, need)
    return max(1, round(full / drafted[1][2])) if drafted else 1


def rgb(im: Image.Image) -> Image.Image:
    """``im`` in RGB: itself where it is (convert() would copy the whole image first)."""
    return im if im.mode == "RGB" else im.convert("RGB")


def to_uint8_chw(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1).contiguous()


class ImageFolderPIL:
    """(path, label) samples decoded with PIL into uint8 CHW tensors of ``size`` x ``size``.

    Indexed by ``(index, seed)`` pairs (see :class:`kd.data.sampler.SeededSampler`). Train:
    RandomResizedCrop + horizontal flip, where a JPEG whose crop shrinks by 4 or more is decoded
    at 1/2, 1/4 or 1/8 size, keeping two decoded pixels per output pixel (:func:`reduced_decode`).
    Val: torchvision's ``Resize(resize)`` + ``CenterCrop(size)`` on the full decode, bit for bit
    (:func:`val_geometry`).
    An unreadable image yields ``None`` plus its path, and the collate function drops it.
    ``views`` 2 (training): each item holds two crops, stacked (2 x 3 x size x size): the one above
    and the strong view (:mod:`kd.data.views`), from the same file.
    """

    def __init__(
        self,
        samples: Sequence[Tuple[str, int]],
        size: int,
        train: bool,
        resize: Optional[int] = None,
        min_scale: float = 0.08,
        interpolation: str = "bilinear",
        views: int = 1,
        augment: Optional[TrainAugment] = None,
        train_interpolation: str = "bilinear",
    ):
        """``resize`` and ``interpolation`` (bilinear or bicubic) are validation's; training crops
        resize with ``train_interpolation`` (the crop both models of a KD step see), then go through
        ``augment`` (:mod:`kd.data.augment`: timm's ``--aa``, ``--color-jitter``, ``--reprob``)."""
        self.samples = samples if isinstance(samples, Prepared) else list(samples)
        self.scale = (min_scale, 1.0)
        self.size = size
        self.train = train
        self.resize = resize or default_val_resize(size)
        self.val_filter = BICUBIC if interpolation == "bicubic" else BILINEAR
        self.views = views if train else 1
        self.augment = augment if train else None
        self.train_filter = BICUBIC if train_interpolation == "bicubic" else BILINEAR

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item):
        """``(index, seed)`` (or an index) -> ``(CHW uint8 crop or None, label, path, index)``."""
        img, label, path = self.crop(item)
        index = item[0] if isinstance(item, tuple) else item
        if img is None:
            return None, label, path, index
        first = self.augmented(img, item[1] if isinstance(item, tuple) else 0)
        if self.views == 2:
            strong = self.strong_view(item)
            if strong is None:
                return None, label, path, index
            second = to_uint8_chw(strong)
            if self.augment is not None and self.augment.normalises:
                second = self.augment.normalise(second)
            return torch.stack([first, second]), label, path, index
        return first, label, path, index

    def augmented(self, img: Image.Image, seed: int) -> torch.Tensor:
        """A training crop as the CHW tensor a batch holds: uint8, or normalised and erased where
        random erasing runs (:mod:`kd.data.augment`), every draw from the sample's ``seed``."""
        if self.augment is None:
            return to_uint8_chw(img)
        pixels = to_uint8_chw(self.augment.image(img, seed))
        return self.augment.erase(pixels, seed) if self.augment.normalises else pixels

    def strong_view(self, item) -> Optional[Image.Image]:
        """The sample's strong view (:mod:`kd.data.views`): its own training crop and flip, then
        RandAugment and Cutout; ``None`` for an image PIL cannot read."""
        index, seed = item if isinstance(item, tuple) else (item, 0)
        img, _, _ = self.crop((index, view_seed(seed, STRONG_CROP)))
        if img is None:
            return None
        return strong_augment(img, torch.Generator().manual_seed(view_seed(seed, STRONG_AUGMENT)))

    def crop(self, item) -> Tuple[Optional[Image.Image], int, str]:
        """The finished ``size`` x ``size`` RGB crop of ``(index, seed)`` as a PIL image, its label
        and path; ``None`` for an image PIL cannot read."""
        index, seed = item if isinstance(item, tuple) else (item, 0)
        path, label = self.samples[index]
        try:
            with open_image(self.samples, index) as im:
                width, height = im.size
                if self.train:
                    gen, box = self._train_box(im, seed)
                    im.load()
                    img = rgb(im).resize((self.size, self.size), self.train_filter, box=box)
                else:  # torchvision's Resize + CenterCrop on the full decode, bit for bit
                    new_w, new_h, left, top = val_geometry(height, width, self.size, self.resize)
                    img = rgb(im).resize((new_w, new_h), self.val_filter)
                    img = img.crop((left, top, left + self.size, top + self.size))
        except KDError:  # a prepared copy's image damaged since kd prepare wrote it: a refusal
            raise
        except Exception:  # any decoder failure: truncated, not an image, unreadable
            return None, label, path
        if self.train and flip_coin(gen):
            img = img.transpose(_FLIP_LEFT_RIGHT)
        return img, label, path

    def _train_box(self, im: Image.Image, seed: int) -> Tuple[torch.Generator, Tuple[float, float, float, float]]:
        """The train crop of an opened, not yet loaded image: the sample's generator (the flip
        still to draw from it) and the box ``(x1, y1, x2, y2)`` in the pixels PIL will decode,
        which :func:`reduced_decode` may have made 2, 4 or 8 times smaller."""
        gen = torch.Generator().manual_seed(seed)
        top, left, h, w = random_resized_crop_params(im.height, im.width, gen, self.scale)
        factor = reduced_decode(im, self.size / w, self.size / h)
        return gen, (left / factor, top / factor, (left + w) / factor, (top + h) / factor)

    def region(self, item) -> Tuple[Optional[np.ndarray], Tuple[float, float, float, float], bool, int, str]:
        """A train sample decoded but not resized: the RGB pixels (HWC uint8) of the crop box plus
        a pixel of margin where the image has one, the box in the region's coordinates, the flip,
        the label and the path; ``None`` pixels for an image PIL cannot read.

        The same draws as :meth:`crop`. A bilinear resize of the box (roi_align's ``aligned``
        sampling, the one-kernel crop) reads pixels from half a pixel before the box to its
        rounded-up end, so on the region it gives what it gives on the whole decoded image;
        the resize itself, about a third of the PIL path's CPU time, is left to the device. A
        region of more than MAX_REGION_AREA times the output's pixels comes back as the finished
        crop instead (flipped, with the whole output as its box and no flip left to do).
        """
        index, seed = item
        path, label = self.samples[index]
        try:
            with open_image(self.samples, index) as im:
                gen, (x1, y1, x2, y2) = self._train_box(im, seed)
                im.load()  # im.size: the decoded (maybe reduced) size from here on
                left, top = max(0, math.floor(x1) - 1), max(0, math.floor(y1) - 1)
                right, bottom = min(im.width, math.ceil(x2) + 1), min(im.height, math.ceil(y2) + 1)
                finish = (right - left) * (bottom - top) > MAX_REGION_AREA * self.size * self.size
                if finish:
                    part = rgb(im).resize((self.size, self.size), BILINEAR, box=(x1, y1, x2, y2))
                else:
                    part = rgb(im.crop((left, top, right, bottom)))
        except KDError:  # a prepared copy's image damaged since kd prepare wrote it: a refusal
            raise
        except Exception:  # any decoder failure: truncated, not an image, unreadable
            return None, (0.0, 0.0, 0.0, 0.0), False, label, path
        flip = flip_coin(gen)
        if finish:
            part = part.transpose(_FLIP_LEFT_RIGHT) if flip else part
            return np.asarray(part), (0.0, 0.0, float(self.size), float(self.size)), False, label, path
        return np.asarray(part), (x1 - left, y1 - top, x2 - left, y2 - top), flip, label, path


def collate(batch):
    """Stack the good images; report the bad ones. Module-level so any start method can pickle it.
    ``(images, labels, bad paths, the good samples' dataset indices)``."""
    good = [(img, label, index) for img, label, _, index in batch if img is not None]
    bad = [path for img, _, path, _ in batch if img is None]
    if good:
        images = torch.stack([g[0] for g in good])
    else:
        images = torch.empty(0, 3, 1, 1, dtype=torch.uint8)
    labels = torch.tensor([g[1] for g in good], dtype=torch.long)
    indices = torch.tensor([g[2] for g in good], dtype=torch.long)
    return images, labels, bad, indices
