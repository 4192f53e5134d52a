"""A model's data config (how it wants its images) and the renormalisation from the loaders' to it.

The data config: mean, std, interpolation, its training and evaluation sizes and crop
(:mod:`kd.data.model_data` finds a model's from its name and weights); the renormalisation: from
the loaders' mean and std to a model's, on the device."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from kd.errors import KDError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
INTERPOLATIONS = ("bilinear", "bicubic")


@dataclass(frozen=True)
class DataConfig:
    """How a model wants its images (timm's ``resolve_data_config``, torchvision's weight transforms):
    the normalisation (0-1 scale), and its evaluation transform, the short side resized to
    ``val_resize(image_size)`` with ``interpolation``, then the centre crop."""

    mean: Tuple[float, float, float] = IMAGENET_MEAN
    std: Tuple[float, float, float] = IMAGENET_STD
    interpolation: str = "bilinear"
    #: the short side before the crop, as a multiple of the crop (256/224 for torchvision's ImageNet)
    resize_ratio: float = 256 / 224
    #: timm floors ``image_size / crop_pct``; torchvision's resize sizes are published numbers, kd rounds
    floor: bool = False
    source: str = "torchvision's ImageNet defaults"
    #: the resolution its weights were trained at (timm's ``input_size``, torchvision's crop size, a kd
    #: run's ``--image-size``); None: no weights of a known size, it takes the run's crop as it is
    size: Optional[int] = None
    #: its weights' published evaluation crop (timm's ``test_input_size`` where given), and the short
    #: side as a multiple of it there (timm's ``1 / test_crop_pct``; None: ``resize_ratio``)
    eval_size: Optional[int] = None
    eval_ratio: Optional[float] = None
    #: timm's ``crop_mode`` (center, squash, border); kd's evaluation crops from the centre
    crop_mode: str = "center"

    def val_resize(self, image_size: int, ratio: Optional[float] = None) -> int:
        value = image_size * (ratio or self.resize_ratio)
        return int(math.floor(value + 1e-6)) if self.floor else int(round(value))

    def train_size(self, crop: int) -> int:
        """The side this model is fed during training when the run's crops are ``crop`` pixels."""
        return self.size or crop

    def evaluation(self, crop: int) -> Tuple[int, int]:
        """Its evaluation crop and short-side resize: its weights' published ones, else at ``crop``."""
        if not self.eval_size:
            return crop, self.val_resize(crop)
        return self.eval_size, self.val_resize(self.eval_size, self.eval_ratio)

    def training_line(self, crop: int) -> str:
        """What the model sees in training: ``train 224`` or ``train 224->299 (resized on the device)``."""
        size = self.train_size(crop)
        return f"train {crop}" if size == crop else f"train {crop}->{size} (resized on the device)"

    def describe(
        self, image_size: int, resize: Optional[int] = None, interpolation: Optional[str] = None, own: bool = False
    ) -> str:
        """One line: the normalisation and the evaluation transform; ``resize`` and ``interpolation``
        where the run's options (``--val-resize``, ``val_interpolation``) replace the model's; ``own``:
        evaluated at its weights' own size where they have one (:meth:`evaluation`), not ``image_size``."""
        mean = ", ".join(f"{m:g}" for m in self.mean)
        std = ", ".join(f"{s:g}" for s in self.std)
        if own:
            image_size, resize = self.evaluation(image_size)
        size = resize or self.val_resize(image_size)
        option = " (--val-resize)" if resize and not own else ""
        how = f"{interpolation} (val_interpolation)" if interpolation else self.interpolation
        line = f"mean ({mean}) std ({std}); eval: {how} resize {size}{option}, centre crop {image_size} ({self.source})"
        if self.crop_mode != "center":
            line += f"; timm crops these weights by {self.crop_mode!r}, kd from the centre"
        if size < image_size:  # torchvision's CenterCrop pads; kd's crop is the same, bit for bit
            line += f"; resize {size} is smaller than the crop: its border is padded with black, as torchvision does"
        return line

    def to_dict(self) -> Dict[str, Any]:
        return {
            "mean": list(self.mean),
            "std": list(self.std),
            "interpolation": self.interpolation,
            "resize_ratio": self.resize_ratio,
            "floor": self.floor,
            "source": self.source,
            "size": self.size,
            "eval_size": self.eval_size,
            "eval_ratio": self.eval_ratio,
            "crop_mode": self.crop_mode,
        }

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> DataConfig:
        if d.get("interpolation", "bilinear") not in INTERPOLATIONS:
            raise KDError(f"interpolation {d.get('interpolation')!r}: kd resizes with {' or '.join(INTERPOLATIONS)}")
        return cls(
            tuple(float(x) for x in d.get("mean", IMAGENET_MEAN)),  # type: ignore[arg-type]
            tuple(float(x) for x in d.get("std", IMAGENET_STD)),  # type: ignore[arg-type]
            str(d.get("interpolation", "bilinear")),
            float(d.get("resize_ratio", 256 / 224)),
            bool(d.get("floor", False)),
            str(d.get("source", "given")),
            _size(d.get("size")),
            _size(d.get("eval_size")),
            float(d["eval_ratio"]) if d.get("eval_ratio") else None,
            str(d.get("crop_mode") or "center"),
        )


def _size(value: Any) -> Optional[int]:
    return int(value) if value else None


MeanStd = Tuple[Sequence[float], Sequence[float]]


class Renormalise:
    """Images normalised with one mean and std (the loaders') as another model wants them:
    ``x * std_a / std_b + (mean_a - mean_b) / std_b`` per channel, one kernel on the device."""

    def __init__(
        self, source: Tuple[Sequence[float], Sequence[float]], target: Tuple[Sequence[float], Sequence[float]]
    ):
        (mean_a, std_a), (mean_b, std_b) = source, target
        self.scale = [sa / sb for sa, sb in zip(std_a, std_b)]
        self.shift = [(ma - mb) / sb for ma, mb, sb in zip(mean_a, mean_b, std_b)]
        self._on: Dict[Any, Tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        key = images.device
        if key not in self._on:
            self._on[key] = (
                torch.tensor(self.scale, device=key).view(1, 3, 1, 1),
                torch.tensor(self.shift, device=key).view(1, 3, 1, 1),
            )
        scale, shift = self._on[key]
        return torch.addcmul(shift, images, scale)


def renormaliser(loader_norm: Optional[MeanStd], data: Optional[Dict[str, Any]]) -> Optional[Renormalise]:
    """A :class:`Renormalise` from the loaders' normalisation (0-255 scale, as the loaders keep it)
    to a model's data config, or None where they agree (or either is unknown: synthetic data)."""
    if loader_norm is None or not data:
        return None
    source = ([m / 255 for m in loader_norm[0]], [s / 255 for s in loader_norm[1]])
    target = (list(data["mean"]), list(data["std"]))
    if all(abs(a - b) < 1e-9 for a, b in zip([*source[0], *source[1]], [*target[0], *target[1]])):
        return None
    return Renormalise(source, target)
