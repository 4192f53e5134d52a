"""The second, strongly augmented view of a training sample, for methods that learn from two views
(MLKD, ``views = 2``): the official MLKD ImageNet strong augmentation, drawn from the sample's seed.

Jin-Ying/Multi-Level-Logit-Distillation ``mdistiller/dataset/imagenet.py``
(``get_imagenet_train_transform_strong``) makes two views of each image, each with its own
``RandomResizedCrop(224)`` and ``RandomHorizontalFlip``: the weak one is that alone, the strong one
adds ``RandAugment(2, 10)``: two operations drawn with replacement from fourteen (autocontrast,
brightness, colour, contrast, equalize, identity, posterize, rotate, sharpness, shear x and y,
solarize, translate x and y), each at a magnitude drawn uniformly from its range (the ``10`` is
unused), then a Cutout of a grey (125, 123, 114) square of side up to half the crop's width. Here the
strong view is the training crop of :class:`kd.data.folder.ImageFolderPIL` at the seed
:func:`view_seed` gives, followed by :func:`strong_augment`, whose draws come from a torch
generator of the sample (the official ones from Python's and NumPy's global generators), so the
view is the same whatever the workers, processes or resume.
"""

from __future__ import annotations

from typing import Callable, List, Tuple

import torch
from PIL import Image, ImageDraw, ImageEnhance, ImageOps

from kd.data.sampler import sample_seed

_AFFINE = Image.AFFINE  # type: ignore[attr-defined]  # defined in a loop over Pillow's enums

#: the strong view's crop seed (view 1) and its augmentation's seed (view 2), from the sample's seed
STRONG_CROP, STRONG_AUGMENT = 1, 2
#: the Cutout's fill, the official one
CUTOUT_FILL = (125, 123, 114)
#: the Cutout's largest side, as a share of the crop's width (official ``random() * 0.5``)
CUTOUT_MAX = 0.5


def view_seed(seed: int, part: int) -> int:
    """A seed for ``part`` of a sample's second view, a pure function of the sample's ``seed``."""
    return sample_seed(seed, part, 0)


def _shear(axis: int) -> Callable[[Image.Image, float], Image.Image]:
    def shear(img: Image.Image, v: float) -> Image.Image:
        coeffs = (1, v, 0, 0, 1, 0) if axis == 0 else (1, 0, 0, v, 1, 0)
        return img.transform(img.size, _AFFINE, coeffs)

    return shear


def _translate(axis: int) -> Callable[[Image.Image, float], Image.Image]:
    def translate(img: Image.Image, v: float) -> Image.Image:
        shift = v * img.size[axis]
        coeffs = (1, 0, shift, 0, 1, 0) if axis == 0 else (1, 0, 0, 0, 1, shift)
        return img.transform(img.size, _AFFINE, coeffs)

    return translate


#: RandAugment's operations and their magnitude ranges, in the official list's order
OPERATIONS: List[Tuple[str, Callable[[Image.Image, float], Image.Image], float, float]] = [
    ("autocontrast", lambda img, v: ImageOps.autocontrast(img), 0.0, 1.0),
    ("brightness", lambda img, v: ImageEnhance.Brightness(img).enhance(v), 0.05, 0.95),
    ("color", lambda img, v: ImageEnhance.Color(img).enhance(v), 0.05, 0.95),
    ("contrast", lambda img, v: ImageEnhance.Contrast(img).enhance(v), 0.05, 0.95),
    ("equalize", lambda img, v: ImageOps.equalize(img), 0.0, 1.0),
    ("identity", lambda img, v: img, 0.0, 1.0),
    ("posterize", lambda img, v: ImageOps.posterize(img, max(1, int(v))), 4.0, 8.0),
    ("rotate", lambda img, v: img.rotate(v), -30.0, 30.0),
    ("sharpness", lambda img, v: ImageEnhance.Sharpness(img).enhance(v), 0.05, 0.95),
    ("shear_x", _shear(0), -0.3, 0.3),
    ("shear_y", _shear(1), -0.3, 0.3),
    # a float threshold, as the official code passes it (Pillow compares each level with it)
    ("solarize", lambda img, v: ImageOps.solarize(img, v), 0.0, 256.0),  # type: ignore[arg-type]
    ("translate_x", _translate(0), -0.3, 0.3),
    ("translate_y", _translate(1), -0.3, 0.3),
]
#: operations RandAugment applies to each image
RAND_AUGMENT_OPS = 2


def _uniform(gen: torch.Generator) -> float:
    return torch.rand(1, generator=gen, dtype=torch.float64).item()


def cutout(img: Image.Image, gen: torch.Generator) -> Image.Image:
    """The official Cutout after RandAugment: a square of side ``u * 0.5 * width`` (u uniform) filled
    with :data:`CUTOUT_FILL`. Its centre is drawn as the official ``np.random.uniform(w)``, which is
    ``uniform(low=w, high=1)``: in (1, w] and (1, h], not [0, w); kept."""
    side = _uniform(gen) * CUTOUT_MAX
    if side <= 0.0:
        return img
    side *= img.size[0]
    w, h = img.size
    x0 = w + (1.0 - w) * _uniform(gen)
    y0 = h + (1.0 - h) * _uniform(gen)
    x0, y0 = int(max(0, x0 - side / 2.0)), int(max(0, y0 - side / 2.0))
    box = (x0, y0, min(w, x0 + side), min(h, y0 + side))
    img = img.copy()
    ImageDraw.Draw(img).rectangle(box, CUTOUT_FILL)
    return img


def strong_augment(img: Image.Image, gen: torch.Generator) -> Image.Image:
    """RandAugment(2, 10) and Cutout on a finished RGB crop, as the official strong view (module
    docstring), every draw from ``gen``."""
    for _ in range(RAND_AUGMENT_OPS):
        _, op, low, high = OPERATIONS[int(torch.randint(len(OPERATIONS), (1,), generator=gen).item())]
        img = op(img, low + (high - low) * _uniform(gen))
    return cutout(img, gen)
