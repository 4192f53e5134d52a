"""kd.nest: tensors inside the nested containers models return (dicts, lists, tuples, named tuples, dataclasses)."""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import torch

from kd.nest import map_tensors, tensors

Outputs = namedtuple("Outputs", "logits aux")  # as torchvision's GoogLeNet / Inception return in training


@dataclasses.dataclass
class Parts:
    loss: torch.Tensor
    names: tuple


def test_map_tensors_rebuilds_every_container_and_leaves_the_rest():
    a, b, c = torch.ones(2), torch.zeros(3, dtype=torch.int64), torch.full((1,), 2.0)
    obj = {"out": Outputs(a, [b, "text"]), "parts": Parts(c, ("x", 3)), "none": None}
    got = map_tensors(lambda t: t + 1, obj)
    assert isinstance(got["out"], Outputs) and isinstance(got["parts"], Parts)
    assert torch.equal(got["out"].logits, a + 1) and torch.equal(got["out"].aux[0], b + 1)
    assert got["out"].aux[1] == "text" and got["none"] is None and got["parts"].names == ("x", 3)
    assert torch.equal(got["parts"].loss, c + 1)
    assert torch.equal(obj["out"].logits, a)  # the input is not changed


def test_tensors_yields_every_tensor_in_order():
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    found = list(tensors([a, {"x": Outputs(b, None)}, Parts(c, ())]))
    assert [t.numel() for t in found] == [1, 2, 3]
