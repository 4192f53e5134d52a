"""Architectures kd adds to timm's registry (``timm:NAME``), built by timm from its own blocks.

``mobilenetv1_100_relu``: timm's ``mobilenetv1_100`` with ReLU for its ReLU6, the MobileNet-V1 of
the papers' ResNet-50 -> MobileNet-V1 rows (the official OFD and ReviewKD code and mdistiller:
a 3x3 conv and 13 depthwise-separable blocks, each conv followed by BatchNorm and ReLU, then
the pooled feature and one linear classifier). timm publishes no weights for it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

#: kd's architecture name -> (the timm architecture it is built as, the arguments that make it kd's)
KD_ARCHS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "mobilenetv1_100_relu": ("mobilenetv1_100", {"act_layer": "relu"}),
}


def builder(name: str, base: str, fixed: Dict[str, Any]) -> Callable[..., Any]:
    """timm's entry point for kd's architecture ``name``: timm's ``base`` built with ``fixed``."""

    def build(pretrained: bool = False, **kwargs: Any):
        import timm

        if pretrained:
            raise ValueError(f"timm publishes no weights for kd's {name}")
        for key in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"):
            kwargs.pop(key, None)
        return timm.create_model(base, pretrained=False, **fixed, **kwargs)

    build.__name__ = build.__qualname__ = name
    return build


def register() -> None:
    """Registers :data:`KD_ARCHS` with timm, once per process (its model lists then name them)."""
    from timm.models import is_model, register_model

    for name, (base, fixed) in KD_ARCHS.items():
        if not is_model(name):
            register_model(builder(name, base, fixed))
