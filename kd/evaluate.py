"""``kd eval``: top-1/top-5 of one model with local weights on ``DATA/val``."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict

import torch

from kd import models
from kd.config import RunConfig
from kd.data.folder import scan_split
from kd.data.loader import make_loader
from kd.engine import evaluate
from kd.teacher import TeacherPrecision


def evaluate_model(model: str, weights: str, data: str, batch_size: int = 256, device: str = "auto",
                   image_size: int = 224, workers: int = 8, num_classes=None, opt: str = "O0",
                   amp_dtype=None) -> Dict[str, float]:
    """Evaluate ``model`` with ``weights`` (a file, or pretrained) on the ``val/`` split of ``data``."""
    import backends

    cfg = RunConfig(data=data, student=model, teacher=model, batch_size=batch_size, device=device,
                    image_size=image_size, workers=workers, num_classes=num_classes, opt=opt, amp_dtype=amp_dtype)
    backend = backends.get("single")(cfg)
    backend.setup()
    classes, samples = scan_split(Path(data), "val")
    n = num_classes or len(classes)
    net = models.freeze(models.build(model, n, weights))
    channels_last = backend.device.type == "cuda"
    net = net.to(backend.device, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    precision = TeacherPrecision(backend.device, backend.precision().dtype)  # a frozen model, as kd runs a teacher
    net = precision.prepare(net)
    loader = make_loader(dataclasses.replace(cfg), samples, False, 1, 0, batch_size, backend.device, channels_last)
    result = evaluate(net, loader, backend, precision)
    return {"model": model, "weights": weights, **result}
