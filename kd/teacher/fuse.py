"""Inference fusion of the frozen teacher: fewer passes over its activations in every step.

A frozen teacher in eval mode computes ``relu(bn(conv(x)))`` and ``relu(bn(conv(x)) + z)``
over and over. Done op by op, each BatchNorm, addition and ReLU reads and writes the whole
activation tensor again; at ImageNet batch sizes these memory-bound passes cost as much as the
convolutions. :func:`fuse_teacher` rewrites the model's torch.fx graph:

* each BatchNorm that only follows a convolution is folded into that convolution's weight
  and bias (exact up to rounding);
* ``relu(conv(x) + bias)`` becomes one :func:`conv_bias_relu` call and
  ``relu(conv(x) + bias + z)`` one :func:`conv_bias_add_relu` call, which on CUDA are cuDNN's
  fused convolutions (the bias, residual and ReLU applied in the convolution's epilogue) and
  elsewhere the plain ops, so the rewrite is tested on the CPU.

The fused calls run in the weights' dtype: the precision object stores the teacher's weights
in the reduced dtype at O1-O3 (after fusion), and the calls cast their inputs to it, which is
what autocast would do. Tapped tensors (``taps``: kd.utils.taps keys) become outputs of the
graph, so the fusion goes on around them: a stage's output is the fused op that makes it, and a
pre-ReLU sum is kept as the value it is (its block's last convolution, sum and ReLU then run
unfused, the ReLU out of place). The fused model returns ``(logits, {key: tensor})`` and names the
keys in its graph (:func:`returned_taps`, which a copy of the model keeps).
"""

from __future__ import annotations

import operator
from typing import Dict, Optional, Sequence, Tuple, Type, TypeVar, Union

import torch
import torch.nn.functional as F
from torch import fx, nn

from kd.utils.taps import wanted_calls

RELUS = (F.relu, torch.relu, torch.relu_)
ADDS = (operator.add, operator.iadd, torch.add)

M = TypeVar("M", bound=nn.Module)
#: How often the graph calls each submodule (by qualified name).
Calls = Dict[str, int]


def conv_bias_relu(x, weight, bias, stride, padding, dilation, groups: int):
    """``relu(conv2d(x, weight) + bias)``: one cuDNN call on CUDA."""
    x = x.to(weight.dtype)
    if x.is_cuda:
        return torch.cudnn_convolution_relu(x, weight, bias, stride, padding, dilation, groups)
    return F.relu(F.conv2d(x, weight, bias, stride, padding, dilation, groups))


def conv_bias_add_relu(x, weight, z, bias, stride, padding, dilation, groups: int):
    """``relu(conv2d(x, weight) + bias + z)``: one cuDNN call on CUDA."""
    x, z = x.to(weight.dtype), z.to(weight.dtype)
    if x.is_cuda:
        return torch.cudnn_convolution_add_relu(x, weight, z, 1.0, bias, stride, padding, dilation, groups)
    return F.relu(F.conv2d(x, weight, bias, stride, padding, dilation, groups) + z)


class _Tracer(fx.Tracer):
    """torch.fx's tracer that also finds the graph values of tap keys: a module's output (its last
    call's), or the input of its K-th call."""

    def __init__(self, taps: Sequence[str]):
        super().__init__()
        self.wanted = wanted_calls(taps)
        self.calls: Dict[str, int] = {}
        self.found: Dict[str, fx.Node] = {}

    def _keep(self, key: str, value: object) -> None:
        if not isinstance(value, fx.Proxy):
            raise TypeError(f"tap {key!r} is not one tensor")
        self.found[key] = value.node

    def call_module(self, m: nn.Module, forward, args, kwargs):
        name = self.path_of_module(m)
        calls = self.wanted.get(name, ())
        if calls:
            self.calls[name] = n = self.calls.get(name, 0) + 1
            if n in calls:
                self._keep(f"{name}<{n}", args[0] if args else None)
        out = super().call_module(m, forward, args, kwargs)
        if 0 in calls:
            self._keep(name, out)
        return out


def _return_taps(gm: fx.GraphModule, taps: Sequence[str], found: Dict[str, fx.Node]) -> None:
    """The graph returns ``(its output, {key: tapped value})``. An in-place module that reads a
    tapped input (a block's ReLU reading its sum) would overwrite it: a ReLU runs out of place
    instead, any other such module on a copy."""
    missing = [key for key in taps if key not in found]
    if missing:
        raise KeyError(f"the forward never reached tap {missing[0]!r}")
    # the output first: a rewrite below that replaces a tapped node (a stage's output that is the
    # ReLU run out of place) updates the output too
    (output,) = [node for node in gm.graph.nodes if node.op == "output"]
    output.args = ((output.args[0], {key: found[key] for key in taps}),)
    for key in taps:
        node = found[key]
        if "<" not in key:
            continue
        for user in list(node.users):
            module = gm.get_submodule(_target(user)) if user.op == "call_module" else None
            if not getattr(module, "inplace", False):
                continue
            # what eager reads of the sum after the in-place call is its result: so does the graph
            order = {n: i for i, n in enumerate(gm.graph.nodes)}  # anew: earlier rewrites inserted nodes
            later = [u for u in node.users if u is not user and u is not output and order[u] > order[user]]
            with gm.graph.inserting_before(user):
                if isinstance(module, (nn.ReLU, nn.ReLU6)):
                    fn = F.relu6 if isinstance(module, nn.ReLU6) else torch.relu
                    result = gm.graph.call_function(fn, (node,))
                    user.replace_all_uses_with(result)
                    gm.graph.erase_node(user)
                else:
                    copy = gm.graph.call_method("clone", (node,))
                    user.replace_input_with(node, copy)
                    result = copy
            for u in later:
                u.replace_input_with(node, result)


def _target(node: fx.Node) -> str:
    """The qualified name of the submodule a ``call_module`` or ``get_attr`` node refers to."""
    assert isinstance(node.target, str), f"{node.op} node with target {node.target!r}"
    return node.target


def _module(gm: fx.GraphModule, node: object, kinds: Union[Type[M], Tuple[Type[M], ...]]) -> Optional[M]:
    if isinstance(node, fx.Node) and node.op == "call_module":
        mod = gm.get_submodule(_target(node))
        if isinstance(mod, kinds):
            return mod
    return None


def _is_relu(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in RELUS:
        return True
    if node.op == "call_method" and node.target in ("relu", "relu_"):
        return True
    return _module(gm, node, nn.ReLU) is not None


def _is_add(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.target in ADDS
        and len(node.args) == 2
        and not node.kwargs
        and all(isinstance(a, fx.Node) for a in node.args)
    )


def _fusable_conv(gm: fx.GraphModule, node: fx.Node, calls: Calls) -> Optional[nn.Conv2d]:
    """The Conv2d this node calls, if its output has no other use and it is called only here."""
    conv = _module(gm, node, nn.Conv2d)
    if conv is None or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return None
    if len(node.users) != 1 or calls[_target(node)] != 1:
        return None
    return conv


def _conv_operand(gm: fx.GraphModule, add: fx.Node, calls: Calls) -> Optional[Tuple[fx.Node, fx.Node, nn.Conv2d]]:
    """The first operand of ``add`` that is a fusable convolution: its node, the other operand, the Conv2d."""
    for a, other in (add.args, add.args[::-1]):
        if isinstance(a, fx.Node) and isinstance(other, fx.Node):
            conv = _fusable_conv(gm, a, calls)
            if conv is not None:
                return a, other, conv
    return None


def _fold_batchnorms(gm: fx.GraphModule, calls: Calls) -> int:
    from torch.nn.utils.fusion import fuse_conv_bn_weights

    folded = 0
    for node in list(gm.graph.nodes):
        bn = _module(gm, node, nn.modules.batchnorm._BatchNorm)
        if bn is None or bn.running_mean is None or bn.running_var is None:
            continue
        if calls[node.target] != 1 or not node.args:
            continue
        src = node.args[0]
        conv = _module(gm, src, (nn.Conv1d, nn.Conv2d, nn.Conv3d))
        if conv is None or not isinstance(src, fx.Node) or len(src.users) != 1 or calls[_target(src)] != 1:
            continue
        weight, bias = fuse_conv_bn_weights(
            conv.weight, conv.bias, bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias
        )
        conv.weight, conv.bias = weight.requires_grad_(False), bias.requires_grad_(False)
        node.replace_all_uses_with(src)
        gm.graph.erase_node(node)
        folded += 1
    return folded


def _conv_args(gm: fx.GraphModule, conv_node: fx.Node, conv: nn.Conv2d) -> Tuple:
    weight = gm.graph.get_attr(f"{conv_node.target}.weight")
    bias = gm.graph.get_attr(f"{conv_node.target}.bias") if conv.bias is not None else None
    return weight, bias, tuple(conv.stride), tuple(conv.padding), tuple(conv.dilation), conv.groups


def _fuse_relus(gm: fx.GraphModule, calls: Calls) -> Tuple[int, int]:
    convs = adds = 0
    for node in list(gm.graph.nodes):
        if not _is_relu(gm, node) or not node.args:
            continue
        src = node.args[0]
        if not isinstance(src, fx.Node):
            continue
        conv = _fusable_conv(gm, src, calls)
        with gm.graph.inserting_before(node):
            if conv is not None:
                w, b, *rest = _conv_args(gm, src, conv)
                fused = gm.graph.call_function(conv_bias_relu, (src.args[0], w, b, *rest))
                convs += 1
            elif _is_add(src) and len(src.users) == 1:
                pick = _conv_operand(gm, src, calls)
                if pick is None:
                    continue
                conv_node, z, conv = pick
                w, b, *rest = _conv_args(gm, conv_node, conv)
                fused = gm.graph.call_function(conv_bias_add_relu, (conv_node.args[0], w, z, b, *rest))
                adds += 1
            else:
                continue
        node.replace_all_uses_with(fused)
    gm.graph.eliminate_dead_code()
    return convs, adds


def returned_taps(model: nn.Module) -> Tuple[str, ...]:
    """The tap keys a fused model returns beside its output (:func:`fuse_teacher`), read from its
    graph; none for any other model."""
    if not isinstance(model, fx.GraphModule):
        return ()
    outputs = [node.args[0] for node in model.graph.nodes if node.op == "output"]
    if len(outputs) != 1 or not isinstance(outputs[0], tuple) or len(outputs[0]) != 2:
        return ()
    taps = outputs[0][1]
    return tuple(taps) if isinstance(taps, dict) and all(isinstance(k, str) for k in taps) else ()


def fuse_teacher(model: nn.Module, taps: Sequence[str] = ()) -> Tuple[nn.Module, str]:
    """The eval-mode ``model`` with BatchNorms folded and conv+bias(+add)+ReLU fused.

    Returns the new module (a torch.fx GraphModule that reuses ``model``'s submodules and
    changes the folded convolutions in place: use it, not ``model``, afterwards) and a one-line
    account of what was done. With ``taps``, the module returns ``(output, {key: tensor})``
    (:func:`returned_taps`). A model torch.fx cannot trace, or whose taps it cannot
    find, is returned unchanged, and the account says so.
    """
    if model.training:
        raise ValueError("fuse_teacher needs a model in eval mode")
    tracer = _Tracer(taps)
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # dynamic control flow and the like: run the model as it is
        return model, f"not fused (torch.fx cannot trace it: {type(exc).__name__})"
    gm = fx.GraphModule(model, graph, class_name=type(model).__name__ + "Fused")
    if taps:
        try:
            _return_taps(gm, taps, tracer.found)
        except KeyError as exc:
            return model, f"not fused ({exc.args[0]})"
    calls: Calls = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    for node in list(gm.graph.nodes):  # Identity modules (folded away by their authors) are no-ops
        if _module(gm, node, nn.Identity) is not None and len(node.args) == 1:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    folded = _fold_batchnorms(gm, calls)
    convs, adds = _fuse_relus(gm, calls)
    gm.delete_all_unused_submodules()
    gm.graph.lint()
    gm.recompile()
    on_cuda = any(p.is_cuda for p in gm.parameters())
    return gm, (
        f"{folded} BatchNorm layers folded, {convs} conv+ReLU and {adds} conv+add+ReLU fused "
        f"({'cuDNN fused convolutions' if on_cuda else 'plain ops off CUDA'})"
    )
