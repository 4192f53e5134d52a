"""The loaders ``--loader`` chooses from, registered by name.

Each name is registered as the function that makes its loader, imported when first used:
configuration and the command line know the names without importing torch, and a spawned loader
worker never imports torchvision or the GPU pipeline through here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List

from kd.registry import Registry

if TYPE_CHECKING:
    from kd.data.loader import DeviceLoader

#: ``--loader NAME``: ``make(cfg, samples, train, shard, every_sample=False, views=1)`` for each name
#: (``shard``: a :class:`kd.data.loader.Shard`), returning a :class:`kd.data.loader.DeviceLoader` (or a
#: subclass); ``every_sample``: training keeps its last short batch (kd teach's store); ``views`` 2:
#: training batches carry each sample's strong view (:mod:`kd.data.views`).
LOADERS: Registry[Callable[..., DeviceLoader]] = Registry("loader")
LOADERS.register_lazy("pil", "kd.data.loader:make_pil_loader")
LOADERS.register_lazy("gpu", "kd.data.gpu:make_gpu_loader")
#: ``--loader auto``: one of the registered loaders, chosen for the device (kd.data.pipeline.choose_loader)
AUTO_LOADER = "auto"


def loader_choices() -> List[str]:
    """What ``--loader`` accepts: auto and every registered loader."""
    return [AUTO_LOADER, *LOADERS.names()]


def check_loader(name: str) -> str:
    """``name`` where ``--loader`` accepts it, else a KDError naming the near names and every choice."""
    return LOADERS.check(name, also=(AUTO_LOADER,))
