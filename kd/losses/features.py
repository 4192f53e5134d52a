"""Helpers shared by the feature-based KD methods: default layers, layer pairs, resizing.

Layer specs. ``--feature-layers`` is a list of specs, one per distilled pair. A spec is a
module name (``layer3``), tapped on both models, or ``student_name:teacher_name``
(``features.13:layer3``) when the two architectures name their stages differently.
:func:`split_layers` turns the specs into the names to hook on each side. The engine hands
the features over as ``student_feats`` / ``teacher_feats`` keyed by each side's own module
name, in the order of the specs, and the losses pair them by position.
"""

from __future__ import annotations

from typing import List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from kd.errors import KDError

# torchvision models built on `features.N`: (number of features.N, a submodule that tells the
# family apart) -> indices of the stage outputs at strides 4, 8, 16 and 32. The stride-32
# entry is the module timm's feature_info names for the same network.
_TORCHVISION_FEATURES = {
    (19, "features.1.conv"): (3, 6, 13, 17),  # mobilenet_v2
    (17, "features.1.block"): (3, 6, 12, 16),  # mobilenet_v3_large
    (13, "features.1.block"): (1, 3, 8, 12),  # mobilenet_v3_small
    (9, "features.1.0.block"): (2, 3, 5, 7),  # efficientnet_b0..b7
}


def _children(names: Sequence[str], prefix: str) -> List[int]:
    """Sorted N of the modules named ``prefix.N`` (direct children only)."""
    found = set()
    for name in names:
        head, _, tail = name.partition(prefix + ".")
        if head == "" and tail.isdigit():
            found.add(int(tail))
    return sorted(found)


def stage_outputs(names: Sequence[str]) -> Optional[List[str]]:
    """The four stage outputs at strides 4, 8, 16, 32 of a known architecture, else None.

    ``names`` are the model's ``named_modules()`` names. Known: ResNet-style ``layer1..4``
    (torchvision and timm ResNets, ResNeXts, wide ResNets), RegNets (torchvision
    ``trunk_output.block1..4``, timm ``s1..s4``), timm models with four ``stages.N``
    (ConvNeXt, ResNetV2, ...), timm EfficientNet-family ``blocks.N`` (MobileNetV1, V2, V3-large,
    EfficientNet, MnasNet, FBNet) and torchvision MobileNetV2/V3 and EfficientNet ``features.N``.
    """
    present = set(names)
    for pattern in ("layer{}", "trunk_output.block{}", "s{}"):
        stages = [pattern.format(i) for i in range(1, 5)]
        if present.issuperset(stages):
            return stages
    stage_ids = _children(names, "stages")
    if stage_ids == [0, 1, 2, 3]:
        return [f"stages.{i}" for i in stage_ids]
    blocks = _children(names, "blocks")
    if "conv_stem" in present and blocks:
        if len(blocks) == 7:
            return [f"blocks.{i}" for i in (1, 2, 4, 6)]
        if len(blocks) == 5 and "blocks.0.0.conv_dw" in present:  # mobilenetv1
            return [f"blocks.{i}" for i in (1, 2, 3, 4)]
    features = _children(names, "features")
    for (count, marker), picks in _TORCHVISION_FEATURES.items():
        if len(features) == count and marker in present:
            return [f"features.{i}" for i in picks]
    return None


def default_stage_layers(
    method: str, student_layers: Sequence[str], teacher_layers: Sequence[str], stages: Sequence[int]
) -> List[str]:
    """Specs for the given stage indices (0..3 = strides 4..32) of both models.

    Same-named stages give plain names, differently named ones ``student:teacher`` pairs.
    Raises KDError asking for ``--feature-layers`` when either architecture is unknown.
    """
    student, teacher = stage_outputs(student_layers), stage_outputs(teacher_layers)
    if student is None or teacher is None:
        side = "student" if student is None else "teacher"
        raise KDError(
            f"KD loss {method!r} has no default feature layers for this {side} architecture; "
            "name them with --feature-layers, e.g. --feature-layers layer2,layer3 or "
            "student_module:teacher_module pairs such as features.13:layer3"
        )
    return [s if s == t else f"{s}:{t}" for s, t in ((student[i], teacher[i]) for i in stages)]


def split_layers(specs: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(student module names, teacher module names) of the layer specs, in order."""
    student, teacher = [], []
    for spec in specs:
        s, sep, t = spec.partition(":")
        if not s or (sep and not t) or ":" in t:
            raise KDError(f"bad feature layer {spec!r}: use NAME or STUDENT_NAME:TEACHER_NAME")
        student.append(s)
        teacher.append(t if sep else s)
    for side, names in (("student", student), ("teacher", teacher)):
        if len(set(names)) != len(names):
            raise KDError(f"feature layers name a {side} module twice: {', '.join(specs)}")
    return student, teacher


def feature_pairs(method: str, student: Mapping[str, object], teacher: Mapping[str, object]) -> List[Tuple[str, str]]:
    """(student name, teacher name) pairs of two feature (or shape) dicts, matched by position."""
    if len(student) != len(teacher) or not student:
        raise KDError(
            f"KD loss {method!r} needs the same non-zero number of student and teacher feature "
            f"layers; got {len(student)} and {len(teacher)}"
        )
    return list(zip(student, teacher))


def map_pairs(
    method: str, student: Mapping[str, Sequence[int]], teacher: Mapping[str, Sequence[int]]
) -> List[Tuple[str, str]]:
    """:func:`feature_pairs` of two shape dicts, each shape checked to be a batch of feature maps."""
    pairs = feature_pairs(method, student, teacher)
    for s, t in pairs:
        check_maps(method, s, student[s])
        check_maps(method, t, teacher[t])
    return pairs


def check_maps(method: str, name: str, shape: Sequence[int]) -> None:
    """KDError unless ``shape`` is that of a batch of feature maps (N, C, H, W)."""
    if len(shape) != 4:
        raise KDError(
            f"KD loss {method!r} needs (N, C, H, W) feature maps, but layer {name!r} gives shape "
            f"{tuple(shape)}; choose convolutional stages with --feature-layers"
        )


#: the dtypes autocast gives feature maps, where AT's and OFD's losses avoid float32 copies of them
REDUCED_DTYPES = (torch.float16, torch.bfloat16)


def for_layer(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` as a layer with ``weight`` takes it: as it is under autocast, which casts it for the
    layer once (a float32 copy first would be cast straight back: two passes over the map for the
    same values), else in the weight's dtype."""
    return x if torch.is_autocast_enabled(x.device.type) else x.to(weight.dtype)


def nearest(x: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """``x`` resized to ``size`` by nearest neighbour in its own dtype: a gather, exact in any dtype
    (autocast would run it in float32, and everything after it, on maps of hundreds of channels)."""
    with torch.autocast(x.device.type, enabled=False):
        return F.interpolate(x, size=tuple(size), mode="nearest")


def pool_to_common(a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Average-pools the larger spatial map(s) down to the smaller size, per dimension."""
    size = (min(a.shape[-2], b.shape[-2]), min(a.shape[-1], b.shape[-1]))
    if tuple(a.shape[-2:]) != size:
        a = F.adaptive_avg_pool2d(a, size)
    if tuple(b.shape[-2:]) != size:
        b = F.adaptive_avg_pool2d(b, size)
    return a, b


class Connector(nn.Module):
    """1x1 convolution + BatchNorm from the student's channels to the teacher's (FitNets' and OFD's).
    ``weight_std``: the convolution's weights drawn from N(0, weight_std^2) after torch's own
    initialisation (OFD's official init); None keeps torch's."""

    def __init__(self, in_channels: int, out_channels: int, weight_std: Optional[float] = None):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)
        if weight_std is not None:
            nn.init.normal_(self.conv.weight, 0.0, weight_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(for_layer(x, self.conv.weight)))
