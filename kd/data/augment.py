"""timm's training augmentations after the crop and flip: ``--aa`` (RandAugment, AutoAugment, AugMix
strings), ``--color-jitter`` and ``--reprob`` (random erasing), each drawn from the sample's seed.

The pieces are timm's own, built by ``timm.data.transforms_factory.transforms_imagenet_train``
(``separate=True``): its secondary transforms (the auto-augmentation, or the colour jitter, which timm
leaves out when an auto-augmentation runs) on the PIL crop, and its :class:`RandomErasing` on the
normalised tensor. They draw from Python's ``random``, NumPy's and torch's global generators; here
each call runs with those seeded from the sample's seed and restored after (:func:`seeded_globals`),
so a sample augments alike whatever the workers, the processes or a resume.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

from kd.data.augment_options import wanted
from kd.data.sampler import sample_seed
from kd.errors import KDError

#: the parts of a sample's seed the augmentations draw from (the strong view's are 1 and 2: kd.data.views)
AUGMENT_PART, ERASE_PART = 3, 4
#: random erasing's fill modes and the default (timm's --remode)


def augment_seed(seed: int, part: int) -> int:
    """A seed for one augmentation ``part`` of a sample, a pure function of the sample's ``seed``."""
    return sample_seed(seed, part, 0)


@contextmanager
def seeded_globals(seed: int) -> Iterator[None]:
    """Python's, NumPy's and torch's (CPU) global generators seeded from ``seed`` inside, restored after."""
    saved = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.random.default_generator.manual_seed(seed)  # the CPU's alone: torch.manual_seed seeds CUDA's too
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.random.set_rng_state(saved[2])


def timm_pieces(size: int, cfg, norm: Tuple[Sequence[float], Sequence[float]]):
    """timm's secondary transform (``None`` where it has none) and its RandomErasing (``None`` where
    ``cfg.reprob`` is 0) for ``cfg``'s options at crop ``size``; ``norm`` on the 0-255 scale. An
    ``--aa`` string timm cannot read is a :class:`KDError` of one line."""
    from timm.data.random_erasing import RandomErasing
    from timm.data.transforms_factory import transforms_imagenet_train

    mean, std = (tuple(v / 255 for v in norm[0]), tuple(v / 255 for v in norm[1]))
    try:
        _, secondary, final = transforms_imagenet_train(
            size,
            auto_augment=cfg.aa,
            color_jitter=cfg.color_jitter,  # type: ignore[arg-type]  # timm reads None as none
            interpolation=cfg.train_interpolation,
            mean=mean,
            std=std,
            re_prob=cfg.reprob,
            re_mode=cfg.remode,
            re_count=cfg.recount,
            separate=True,
        )
    except (AssertionError, ValueError, KeyError, IndexError) as e:
        examples = "rand-m9-mstd0.5-inc1, augmix-m5, original"
        why = f": {e}" if str(e) else ""  # timm's asserts carry no message
        raise KDError(f"--aa {cfg.aa} is no augmentation string timm reads ({examples}){why}") from None
    erasing = next((t for t in final.transforms if isinstance(t, RandomErasing)), None)
    return (secondary if secondary.transforms else None), erasing


class TrainAugment:
    """The augmentations after a sample's crop and flip (module docstring); picklable for the workers."""

    def __init__(self, size: int, cfg, norm: Tuple[Sequence[float], Sequence[float]]):
        self.norm = norm
        self.secondary, self.erasing = timm_pieces(size, cfg, norm)

    @property
    def normalises(self) -> bool:
        """Whether the worker normalises (random erasing needs the normalised crop): float batches."""
        return self.erasing is not None

    def image(self, img: Image.Image, seed: int) -> Image.Image:
        """timm's auto-augmentation or colour jitter on the PIL crop, drawn from the sample's ``seed``."""
        if self.secondary is None:
            return img
        with seeded_globals(augment_seed(seed, AUGMENT_PART)):
            return self.secondary(img)

    def normalise(self, pixels: torch.Tensor) -> torch.Tensor:
        """CHW uint8 pixels normalised as the loaders do on the device (kd.data.loader.Normalisation)."""
        mean = torch.tensor(self.norm[0]).view(3, 1, 1)
        std = torch.tensor(self.norm[1]).view(3, 1, 1)
        return pixels.float().sub_(mean).div_(std)

    def erase(self, pixels: torch.Tensor, seed: int) -> torch.Tensor:
        """The normalised crop with timm's random erasing, drawn from the sample's ``seed``."""
        x = self.normalise(pixels)
        if self.erasing is None:
            return x
        with seeded_globals(augment_seed(seed, ERASE_PART)):
            return self.erasing(x)


def augment_key(cfg) -> Optional[str]:
    """The augmentation options as a soft-label store pins them (the crops depend on them); None without any."""
    if not wanted(cfg):
        return None
    keys = ("aa", "color_jitter", "reprob", "remode", "recount", "train_interpolation")
    return " ".join(f"{k}={getattr(cfg, k)}" for k in keys)


def describe(cfg) -> str:
    """What the PIL loader's log line says of the augmentations: which run in its workers, after the crop."""
    jitter = cfg.color_jitter is not None and (not cfg.aa or "3a" in cfg.aa)  # timm's rule: none under --aa
    parts = [f"--aa {cfg.aa}" if cfg.aa else "", f"--color-jitter {cfg.color_jitter:g}" if jitter else ""]
    parts += [f"--reprob {cfg.reprob:g}" if cfg.reprob > 0 else ""]
    parts += [f"--train-interpolation {cfg.train_interpolation}" if cfg.train_interpolation != "bilinear" else ""]
    done = ", ".join(p for p in parts if p)
    return f"timm's {done} on the crops there" if done else ""
