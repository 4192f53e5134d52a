"""Feature taps: intermediate tensors through hooks, without changing model code.

A tap key names what is kept:

* ``NAME``: the output of submodule ``NAME`` (``layer3``);
* ``NAME<K``: the input of the K-th call of submodule ``NAME`` in one forward (``layer1.1.relu<2``,
  the pre-ReLU sum of a torchvision BasicBlock, whose one ReLU module runs twice; ``fc<1``, the
  pooled feature the classifier reads). An input that an in-place module then overwrites is cloned.

:func:`pre_relu_keys` and :func:`pooled_key` find these keys for a model from one forward.

Hooks are registered once per tapped module and stay (:class:`Taps`): a forward keeps tensors only while
its module is armed, so ``torch.compile`` traces the hooks as part of the model's forward instead of
falling back to eager for a block that registers and removes them. What one armed forward kept lives
on the tapped module itself (its ``_kd_tap`` slot), so DataParallel's replicas, which share each
module's hook dict but not its attributes, each keep their own.
"""

from __future__ import annotations

import contextlib
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch import nn

from kd.errors import KDError

#: activation modules whose input is a stage's pre-activation output
ACTIVATIONS = (nn.ReLU, nn.ReLU6)


def layer_names(model: nn.Module) -> List[str]:
    return [name for name, _ in model.named_modules() if name]


def check_layers(model: nn.Module, layers: List[str], role: str) -> None:
    names = set(layer_names(model))
    missing = [layer for layer in layers if layer not in names]
    if missing:
        tops = [n for n in layer_names(model) if "." not in n]
        raise KDError(f"{role} has no module {missing[0]!r} for --feature-layers; top-level modules: {', '.join(tops)}")


def split_key(key: str) -> Tuple[str, int]:
    """(module name, call): call 0 for the module's output, K >= 1 for the input of its K-th call."""
    name, sep, call = key.partition("<")
    if not sep:
        return name, 0
    if not call.isdigit() or int(call) < 1:
        raise ValueError(f"bad tap key {key!r}")
    return name, int(call)


def wanted_calls(keys: Sequence[str]) -> Dict[str, FrozenSet[int]]:
    """For each tapped module, the calls ``keys`` want of it (0: its output; K: its K-th call's input)."""
    wanted: Dict[str, set] = {}
    for key in keys:
        name, call = split_key(key)
        wanted.setdefault(name, set()).add(call)
    return {name: frozenset(calls) for name, calls in wanted.items()}


#: the attribute of a tapped module that holds what its armed forward kept (None when not armed)
SLOT = "_kd_tap"


def _keep_output(module: nn.Module, _inputs, output) -> None:
    slot = getattr(module, SLOT, None)
    if slot is not None and 0 in slot["want"]:
        slot[0] = output


def _keep_input(module: nn.Module, inputs) -> None:
    slot = getattr(module, SLOT, None)
    if slot is not None:
        slot["calls"] += 1
        if slot["calls"] in slot["want"]:
            x = inputs[0]
            slot[slot["calls"]] = x.clone() if getattr(module, "inplace", False) else x


class Taps:
    """The tensors ``keys`` of one forward of ``model``: :meth:`arm` before it, :meth:`take` after.

    The hooks are registered once per module (a module tapped again, by another :class:`Taps`, keeps
    its hooks) and do nothing while the module is not armed: another forward (MLKD's second view, an
    evaluation, an EMA copy) keeps nothing. ``arm`` and ``take`` are given the model the forward runs,
    a DataParallel replica's own where one runs it."""

    def __init__(self, model: nn.Module, keys: Sequence[str]):
        self.keys = list(keys)
        self.wanted = wanted_calls(self.keys)
        self.install(model)

    def install(self, model: nn.Module) -> None:
        """The hooks on ``model``'s tapped modules, where they have none yet (after a conversion
        that replaced a module: SyncBatchNorm)."""
        for name in self.wanted:
            module = model.get_submodule(name)
            if SLOT not in module.__dict__:
                setattr(module, SLOT, None)
            # DataParallel's replicas share their module's hook dicts: one pair of hooks serves them all
            if _keep_input not in module._forward_pre_hooks.values():
                module.register_forward_pre_hook(_keep_input)
                module.register_forward_hook(_keep_output)

    def arm(self, model: nn.Module) -> None:
        for name, calls in self.wanted.items():
            setattr(model.get_submodule(name), SLOT, {"calls": 0, "want": calls})

    def take(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        """What the forward since :meth:`arm` kept, in ``keys`` order; the modules disarmed. KeyError
        naming a key the forward never reached."""
        kept = {name: getattr(model.get_submodule(name), SLOT) or {} for name in self.wanted}
        self.disarm(model)
        out = {}
        for key in self.keys:
            name, call = split_key(key)
            if call not in kept[name]:
                raise KeyError(f"the forward never reached tap {key!r}")
            out[key] = kept[name][call]
        return out

    def disarm(self, model: nn.Module) -> None:
        for name in self.wanted:
            setattr(model.get_submodule(name), SLOT, None)


@contextlib.contextmanager
def tap(model: nn.Module, keys: List[str], store: Dict[str, torch.Tensor]):
    """Within the block, one forward of ``model``; at its end the tensors ``keys`` land in ``store``
    (a probe's forward; a training step arms its side's :class:`Taps` itself)."""
    if not keys:
        yield store
        return
    taps = Taps(model, keys)
    taps.arm(model)
    try:
        yield store
    except BaseException:
        taps.disarm(model)
        raise
    store.update(taps.take(model))


def _inside(name: str, stage: str) -> bool:
    return name == stage or name.startswith(stage + ".")


def _call_log(model: nn.Module, stages: Sequence[str], probe: torch.Tensor):
    """Every module call inside ``stages`` in one eval forward of ``probe``: (order, name, k-th call,
    module, output), entered order; and each stage's output."""
    modules = [(n, m) for n, m in model.named_modules() if any(_inside(n, stage) for stage in stages)]
    log: List[list] = []
    counts: Dict[str, int] = {}
    handles = []
    for name, module in modules:

        def pre(module, _inputs, name=name):
            counts[name] = counts.get(name, 0) + 1
            log.append([len(log), name, counts[name], module, None])

        def post(module, _inputs, output, name=name):
            for entry in reversed(log):
                if entry[1] == name and entry[4] is None:
                    entry[4] = output
                    break

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(probe)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return log, {stage: next(entry[4] for entry in log if entry[1] == stage) for stage in stages}


def pre_relu_keys(
    model: nn.Module, stages: Sequence[str], probe: torch.Tensor, method: str, role: str
) -> List[Tuple[str, Optional[str]]]:
    """For each of ``stages``, (the tap key of its output before its final ReLU, the BatchNorm that
    feeds that sum), from one forward.

    The last activation module called inside a stage whose output is the stage's output gives the key
    ``name<K`` (its input at that call); a stage that ends without an activation (a linear
    bottleneck) is pre-activation already and gives the stage's name. The BatchNorm is the stage's
    last one entered before that activation (None where there is none). KDError where a stage's output
    is all >= 0 but made by no activation module kd can hook (a functional ReLU)."""
    log, outputs = _call_log(model, stages, probe)
    found: List[Tuple[str, Optional[str]]] = []
    for stage in stages:
        out = outputs[stage]
        mine = [entry for entry in log if _inside(entry[1], stage)]
        final = None
        for entry in mine:
            if isinstance(entry[3], ACTIVATIONS) and entry[4] is out:
                final = entry
        if final is None:
            if bool((out >= 0).all()):
                raise KDError(
                    f"KD loss {method!r} distils pre-ReLU features, but {role}'s {stage!r} applies its last "
                    "ReLU where kd cannot tap it (not an nn.ReLU module); choose other stages with --feature-layers"
                )
            found.append((stage, None))
            continue
        norms = [e for e in mine if e[0] < final[0] and isinstance(e[3], nn.modules.batchnorm._BatchNorm)]
        found.append((f"{final[1]}<{final[2]}", norms[-1][1] if norms else None))
    return found


def classifier(model: nn.Module) -> Optional[Tuple[str, nn.Module]]:
    """(name, module) of the classifier: timm's ``get_classifier()``, torchvision's ``fc``,
    ``classifier`` or ``heads`` (or a ``head``); None where the model has none of these."""
    names = {id(m): n for n, m in model.named_modules() if n}
    getter = getattr(model, "get_classifier", None)
    head = getter() if callable(getter) else None
    if head is None or id(head) not in names:
        head = next((getattr(model, n) for n in ("fc", "classifier", "heads", "head") if hasattr(model, n)), None)
    if not isinstance(head, nn.Module) or id(head) not in names:
        return None
    return names[id(head)], head


def pooled_key(model: nn.Module, method: str, role: str) -> str:
    """The tap key of the pooled feature: the input of the classifier (:func:`classifier`)."""
    found = classifier(model)
    if found is None:
        raise KDError(f"KD loss {method!r} needs the pooled feature, but {role} has no classifier module kd knows")
    return f"{found[0]}<1"


#: modules that may stand beside the one linear layer of a classifier (torchvision's ``Dropout, Linear``)
_BESIDE_LINEAR = (nn.Dropout, nn.Identity, nn.Flatten)
#: the global pooling module before the classifier: timm's, torchvision's
_POOLS = ("global_pool", "avgpool")


def final_map(model: nn.Module, probe: torch.Tensor, method: str, role: str) -> Tuple[str, str]:
    """(the tap key of the final feature map, the name of the linear classifier that reads its global
    average), from one forward of ``probe``: the input of the global pooling module (timm's
    ``global_pool``, torchvision's ``avgpool``) and the linear layer of the classifier. KDError in one
    line where the model has none, or where the classifier does not read that map's average (a head
    conv or a norm between them, another pooling)."""
    refusal = (
        f"KD loss {method!r} needs {role}'s final feature map and a linear classifier on its global average pool; "
    )
    modules = dict(model.named_modules())
    found = classifier(model)
    head = found[1] if found else None
    parts = [head] if isinstance(head, nn.Linear) else list(head.children()) if head is not None else []
    linears = [m for m in parts if isinstance(m, nn.Linear)]
    if len(linears) != 1 or not all(isinstance(m, (nn.Linear, *_BESIDE_LINEAR)) for m in parts):
        raise KDError(refusal + "its classifier is not one linear layer")
    linear = next(n for n, m in modules.items() if m is linears[0])
    pool = next((n for n in _POOLS if n in modules), None)
    if pool is None:
        raise KDError(refusal + f"it has no global pooling module ({', '.join(_POOLS)})")
    keys = [f"{pool}<1", f"{linear}<1"]
    feats: Dict[str, torch.Tensor] = {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), tap(model, keys, feats):
            model(probe)
    finally:
        model.train(was_training)
    fmap, pooled = feats.get(keys[0]), feats.get(keys[1])
    if fmap is None or pooled is None or fmap.dim() != 4 or pooled.shape != fmap.shape[:2]:
        raise KDError(refusal + f"its {pool!r} does not pool a (N, C, H, W) map into {linear!r}")
    if not torch.allclose(fmap.float().mean((2, 3)), pooled.float(), rtol=1e-4, atol=1e-5):
        raise KDError(refusal + f"its {linear!r} does not read the average of {pool!r}'s input")
    return keys[0], linear
