"""Datasets, samplers and loaders (CPU-only workers; the GPU pipeline in its own module)."""

from kd.data.loader import Batch
from kd.data.pipeline import Data, build

__all__ = ["Batch", "Data", "build"]
