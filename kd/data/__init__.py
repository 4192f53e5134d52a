"""Datasets, samplers and loaders (CPU-only workers; the GPU pipeline in its own module; the
``--loader`` names in :mod:`kd.data.registry`), and each model's data config (:mod:`kd.data.data_config`,
:mod:`kd.data.model_data`).

``Batch``, ``Data`` and ``build`` load their modules when first used: a spawned loader worker
imports ``kd.data.folder`` or ``kd.data.bytes_dataset`` through this package, and should not pay
for torchvision and the GPU pipeline it never runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kd.data.loader import Batch
    from kd.data.pipeline import Data, build

__all__ = ["Batch", "Data", "build"]


def __getattr__(name: str) -> Any:
    if name == "Batch":
        from kd.data.loader import Batch

        return Batch
    if name in ("Data", "build"):
        from kd.data import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'kd.data' has no attribute {name!r}")
