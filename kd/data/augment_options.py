"""What the training augmentations' options mean without torch (:mod:`kd.data.augment` applies them):
the random-erasing modes, and whether a config asks for any augmentation, for the checks made before
torch is imported."""

from __future__ import annotations

#: timm's random-erasing modes (``--remode``)
ERASE_MODES = ("const", "rand", "pixel")


def wanted(cfg) -> bool:
    """Whether ``cfg`` asks for any augmentation of :mod:`kd.data.augment`."""
    return bool(cfg.aa) or cfg.color_jitter is not None or cfg.reprob > 0 or cfg.train_interpolation != "bilinear"
