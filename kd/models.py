"""Models by name (torchvision, or ``timm:NAME``): their names, building, and weights published by name.

Building covers stochastic depth (``--drop-path``) and a timm model fed another size than its own;
weights from files are read by :mod:`kd.utils.weight_files`, and each model's data config (how it
wants its images) is in :mod:`kd.data.data_config` and :mod:`kd.data.model_data`."""

from __future__ import annotations

import functools
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from kd.errors import KDError, suggest
from kd.utils import archs, checkpoint_io, model_names
from kd.utils.model_names import TIMM_PREFIX
from kd.utils.weight_files import classifier_outputs, extract_state, kd_checkpoint, load_into, load_state_file
from kd.utils.weights import NamedWeights, timm_weights
from kd.utils.weights import torchvision_weights as tv_weights


@functools.lru_cache(maxsize=1)
def torchvision_names() -> List[str]:
    import torchvision.models as tvm

    names = sorted(tvm.list_models(module=tvm))
    model_names.keep("torchvision", {"models": names})
    return names


@functools.lru_cache(maxsize=1)
def _timm_lists() -> Dict[str, List[str]]:
    import timm

    archs.register()
    lists = {"models": timm.list_models(), "pretrained": timm.list_pretrained()}
    model_names.keep("timm", lists)
    return lists


def timm_names() -> List[str]:
    return _timm_lists()["models"]


def _library_list(library: str, key: str) -> List[str]:
    return torchvision_names() if library == "torchvision" else _timm_lists()[key]


def _kept_unless_loaded(library: str, key: str) -> Optional[List[str]]:
    """``library``'s list as kept on disk, or None where the library is loaded in this process."""
    return None if library in sys.modules else model_names.kept(library, key)


def check_name(name: str) -> None:
    """Raise a KDError with close matches if ``name`` is no known model (:mod:`kd.utils.model_names`).

    A name that the lists kept for the installed libraries accept is accepted without importing
    them (a launcher that starts processes need not load timm and torchvision itself); only the
    libraries themselves refuse one (a model registered in this process is theirs to know)."""
    try:
        if model_names.refusal(name, _kept_unless_loaded) is None:
            return
    except model_names.NotAtHand:
        pass
    line = model_names.refusal(name, _library_list)
    if line:
        raise KDError(line)


TORCHVISION_WEIGHTS = "torchvision:"


def is_named(weights: Optional[str]) -> bool:
    """``pretrained``, ``torchvision:TAG`` or ``timm:TAG``: weights a library publishes by name."""
    return bool(weights) and (weights == "pretrained" or str(weights).startswith((TORCHVISION_WEIGHTS, TIMM_PREFIX)))


def torchvision_weights(name: str, weights: str):
    """The torchvision ``Weights`` enum member that ``weights`` names for model ``name``:
    ``pretrained`` is the library's default (IMAGENET1K_V2 for resnet50, not the papers' V1),
    ``torchvision:IMAGENET1K_V1`` (or ``torchvision:ResNet50_Weights.IMAGENET1K_V1``) a given one."""
    import torchvision.models as tvm

    if name.startswith(TIMM_PREFIX):
        raise KDError(f"--weights {weights}: {name} is a timm model; name timm weights as timm:TAG (e.g. timm:a1_in1k)")
    try:
        enum = tvm.get_model_weights(name)
    except ValueError:
        raise KDError(f"torchvision publishes no weights for {name}") from None
    if weights == "pretrained":
        return enum.DEFAULT
    tag = weights[len(TORCHVISION_WEIGHTS) :].split(".")[-1]
    if tag == "DEFAULT":
        return enum.DEFAULT
    members = [w.name for w in enum]
    if tag not in members:
        raise KDError(
            f"{name} has no torchvision weights {tag!r}{suggest(tag, members)}; choose from: {', '.join(members)}"
        )
    return enum[tag]


#: the ImageNet weights every KD paper's torchvision teacher has (ResNet-50's 76.13, not V2's 80.86)
PAPERS_WEIGHTS = "IMAGENET1K_V1"


def pretrained_note(name: str, weights: Optional[str], option: str) -> Optional[str]:
    """Where ``pretrained`` names torchvision weights of ``name`` other than the papers' IMAGENET1K_V1
    that it also has (resnet50's default is V2): the words that say so and give ``option`` for V1."""
    if weights != "pretrained" or name.startswith(TIMM_PREFIX):
        return None
    try:
        member = torchvision_weights(name, weights)
    except KDError:
        return None
    if member.name == PAPERS_WEIGHTS or PAPERS_WEIGHTS not in type(member).__members__:
        return None
    return (
        f"pretrained is torchvision's default {member.name}, not the papers' {PAPERS_WEIGHTS}: "
        f"{option} {TORCHVISION_WEIGHTS}{PAPERS_WEIGHTS}"
    )


def timm_arch(name: str, weights: str) -> str:
    """``arch`` or ``arch.tag`` for timm: ``pretrained`` is the name's own tag (``timm:arch.tag``)
    or timm's default tag, ``timm:TAG`` that one (which a tag in the name must not contradict)."""
    line = model_names.tag_disagreement(name, weights)
    if line:
        raise KDError(line)
    arch, tag = model_names.timm_parts(name)
    if weights.startswith(TIMM_PREFIX):
        tag = weights[len(TIMM_PREFIX) :]
    return f"{arch}.{tag}" if tag else arch


def _pretrained_state(name: str, weights: str = "pretrained") -> Dict[str, torch.Tensor]:
    """The weights a library publishes by name (``pretrained``, ``torchvision:TAG``, ``timm:TAG``),
    from the local cache or downloaded; offline and not cached, one line naming the file to place."""
    if name.startswith(TIMM_PREFIX):
        if weights.startswith(TORCHVISION_WEIGHTS):
            raise KDError(f"--weights {weights}: {name} is a timm model; name timm weights as timm:TAG")
        arch = timm_arch(name, weights)
        found = named_weights(name, weights)
        found.ensure_fetchable()  # offline and not cached: one line now, not the hub's retries
        # a cached file is read as it is, without asking the hub whether a newer one exists
        overlay = {"file": str(found.cached)} if found.cached else None
        try:
            import timm

            return timm.create_model(arch, pretrained=True, pretrained_cfg_overlay=overlay).state_dict()
        except Exception as exc:  # a hub error, an unknown tag, no network
            raise KDError(
                f"cannot get timm weights {arch} ({type(exc).__name__}: {first_line(exc)}); fetch them once where "
                f"there is a network (python -c \"import timm; timm.create_model('{arch}', pretrained=True)\") "
                f"into the Hugging Face cache, or pass a local file with --teacher-weights PATH"
            ) from None
    member = torchvision_weights(name, weights)
    found = named_weights(name, weights)
    cached = found.where
    if found.cached:
        return extract_state(checkpoint_io.read(cached, "cannot read weights file"), str(cached))
    found.ensure_fetchable()  # offline: one line now, not torch hub's "Downloading:" and a failure
    try:
        return member.get_state_dict(progress=False)
    except Exception as exc:  # no network (URLError and friends), a broken download
        raise KDError(
            f"cannot get torchvision:{member.name} for {name} ({type(exc).__name__}: {first_line(exc)}); "
            f"offline, place {cached.name} (from {member.url}) in {cached.parent}"
        ) from None


def named_weights(name: str, weights: str) -> NamedWeights:
    """Where the weights ``weights`` (``pretrained``, ``torchvision:TAG``, ``timm:TAG``) of model
    ``name`` are kept on this machine, and whether they are there (:mod:`kd.utils.weights`)."""
    if name.startswith(TIMM_PREFIX):
        return timm_weights(timm_arch(name, weights))
    return tv_weights(torchvision_weights(name, weights))


def first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:120] if str(exc).strip() else "no detail"


def build(
    name: str,
    num_classes: int,
    weights: str = "none",
    image_size: Optional[int] = None,
    drop_path: Optional[float] = None,
) -> nn.Module:
    """Model ``name`` with ``num_classes`` outputs and ``weights`` = none | pretrained |
    torchvision:TAG | timm:TAG | PATH, for images of ``image_size`` pixels where given
    (:func:`other_size`); ``drop_path``: its stochastic depth (:func:`construct`)."""
    check_name(name)
    state = None
    if is_named(weights):
        state = _pretrained_state(name, weights)
        head = classifier_outputs(state)
        if head is not None and head != num_classes:
            raise KDError(
                f"{weights} {name} has {head} classes but the data has {num_classes}; "
                f"train or fine-tune a teacher for this data and pass it with --teacher-weights PATH"
            )
    elif weights not in ("none", None):
        state = load_state_file(weights)
    model = construct(name, num_classes, weights, image_size, drop_path)
    if state is not None:
        load_into(model, without_aux_heads(model, state), name, weights)
    return model


def construct(
    name: str,
    num_classes: int,
    weights: Optional[str] = "none",
    image_size: Optional[int] = None,
    drop_path: Optional[float] = None,
) -> nn.Module:
    """Model ``name`` as its library builds it for ``weights``, not loaded (:func:`build` loads them); a timm
    model of one input size fed ``image_size`` pixels with timm's ``dynamic_img_size`` (:func:`other_size`).

    ``drop_path``: its stochastic depth, as timm's ``drop_path_rate`` or torchvision's
    ``stochastic_depth_prob`` (the probability of the last block; the blocks before it get less, by
    the model's own rule); None leaves the model's default (torchvision's convnext, efficientnet,
    swin and maxvit have one). A model without stochastic depth is a KDError. swin's and maxvit's
    builders fix the probability: their modules are rescaled to it."""
    timm_model = name.startswith(TIMM_PREFIX)
    if drop_path is None:
        return _library_model(name, num_classes, weights, image_size)
    key = "drop_path_rate" if timm_model else "stochastic_depth_prob"
    try:
        model = _library_model(name, num_classes, weights, image_size, **{key: drop_path})
    except TypeError as exc:  # the model's class takes no such argument, or its builder sets it
        if key not in str(exc):
            raise
        if "multiple values" not in str(exc):
            raise KDError(no_drop_path(name)) from None
        model = rescale_stochastic_depth(_library_model(name, num_classes, weights, image_size), drop_path)
    if drop_path > 0 and not drop_path_rates(model):  # a builder that swallows arguments it does not use
        raise KDError(no_drop_path(name))
    return model


def _library_model(
    name: str, num_classes: int, weights: Optional[str], image_size: Optional[int] = None, **extra: Any
) -> nn.Module:
    if name.startswith(TIMM_PREFIX):
        import timm

        archs.register()
        arch = name[len(TIMM_PREFIX) :]
        if other_size(name, image_size) is not None:
            try:
                return timm.create_model(
                    arch, pretrained=False, num_classes=num_classes, dynamic_img_size=True, **extra
                )
            except TypeError as exc:  # a model without the option (CaiT, XCiT, ...): as timm builds it
                if "dynamic_img_size" not in str(exc):
                    raise
        return timm.create_model(arch, pretrained=False, num_classes=num_classes, **extra)
    import torchvision.models as tvm

    kwargs = torchvision_kwargs(name, num_classes, origin_member(name, weights))
    return tvm.get_model(name, weights=None, **kwargs, **extra)


def no_drop_path(name: str) -> str:
    return (
        f"--drop-path: {name} has no stochastic depth; it applies to timm models that take drop_path_rate "
        f"and to torchvision's convnext, efficientnet, swin and maxvit"
    )


def rescale_stochastic_depth(model: nn.Module, rate: float) -> nn.Module:
    """``model`` (torchvision's) with the probabilities of its StochasticDepth modules scaled so that
    the largest is ``rate``: its builder's rule with ``rate`` in place of the probability it fixed."""
    from torchvision.ops import StochasticDepth

    found = [m for m in model.modules() if isinstance(m, StochasticDepth)]
    top = max((m.p for m in found), default=0.0)
    for module in found:
        module.p = rate * (module.p / top) if top else rate
    return model


def stochastic_depth_modules(model: nn.Module) -> List[nn.Module]:
    """``model``'s stochastic-depth modules: timm's DropPath (``drop_prob``), torchvision's StochasticDepth (``p``)."""
    from torchvision.ops import StochasticDepth

    kinds: Tuple[type, ...] = (StochasticDepth,)
    if "timm" in sys.modules:  # a timm model has imported it
        from timm.layers import DropPath

        kinds += (DropPath,)
    return [m for m in model.modules() if isinstance(m, kinds)]


def drop_path_rates(model: nn.Module) -> List[float]:
    """The drop probability of each of ``model``'s stochastic-depth modules."""
    return [float(getattr(m, "drop_prob", getattr(m, "p", 0.0))) for m in stochastic_depth_modules(model)]


def check_drop_path(name: str, rate: float) -> None:
    """A KDError where model ``name`` has no stochastic depth for --drop-path ``rate``, before any
    work: the model built on the meta device (no memory, no weights), at 0.1 where ``rate`` is 0 so
    that its modules are made. A model that cannot be built there is left to :func:`construct`."""
    try:
        with torch.device("meta"):
            construct(name, 1000, "none", drop_path=rate or 0.1)
    except (RuntimeError, TypeError, ValueError):  # a builder that reads tensors it makes (regnet's)
        return


def other_size(name: str, image_size: Optional[int]) -> Optional[int]:
    """The one input size of timm model ``name`` (a ViT, a DeiT: its pretrained config's
    ``fixed_input_size``) where it is fed ``image_size`` pixels, another size; None otherwise. Such a
    model is built with timm's ``dynamic_img_size``: its position embeddings are resampled to the
    images' size in each forward, so that its parameters keep their shapes and published weights,
    kd checkpoints and exports load as they are."""
    if image_size is None or not name.startswith(TIMM_PREFIX):
        return None
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(name[len(TIMM_PREFIX) :])
    own = int(cfg.input_size[-1]) if cfg is not None and cfg.fixed_input_size else None
    return own if own is not None and own != image_size else None


def other_size_line(role: str, name: str, model: nn.Module, image_size: Optional[int]) -> Optional[str]:
    """The log line of ``model`` (``name``) where :func:`construct` built it for ``image_size`` pixels,
    another size than its own, with timm's ``dynamic_img_size``; None for any other."""
    own = other_size(name, image_size)
    if own is None or not getattr(model, "dynamic_img_size", False):
        return None
    return (
        f"{role} {name} is a {own} px model: built with timm's dynamic_img_size, its position embeddings "
        f"resampled to {image_size} px in each forward (its weights keep their {own} px shapes)"
    )


def origin_member(name: str, weights: Optional[str]) -> Any:
    """The torchvision weights (enum member) that model ``name``'s ``weights`` are or were trained from:
    named weights themselves, or, for a kd checkpoint of ``name``, those its run started from (followed
    back through kd checkpoints, as far as they are on this machine); None for other weights. A model
    is built for them (:func:`torchvision_kwargs`): what the state dict does not hold (inception's
    ``transform_input``, a SWAG ViT's size) is as its run had it."""
    for _ in range(8):
        if is_named(weights):
            return torchvision_weights(name, str(weights))
        obj = kd_checkpoint(str(weights)) if weights else None
        if not obj or obj.get("student_name") != name or not isinstance(obj.get("config"), dict):
            return None
        weights = obj["config"].get("student_weights")
    return None


#: the auxiliary classifiers of torchvision's inception_v3 and googlenet: their published weights hold
#: them, and torchvision's builders load them and then drop the heads (kd builds without them)
AUX_HEADS = ("AuxLogits.", "aux1.", "aux2.")


def torchvision_kwargs(name: str, num_classes: int, member: Any = None) -> Dict[str, Any]:
    """The arguments torchvision's builder of ``name`` gives the model for weights ``member`` (None:
    none by name): inception_v3 and googlenet rescale their input as Google's models did
    (``transform_input``) and leave their auxiliary heads out; a ViT of SWAG weights is built at
    their size (384 or 518 px)."""
    kwargs: Dict[str, Any] = {"num_classes": num_classes}
    if name.startswith(("inception", "googlenet")):
        kwargs.update(aux_logits=False, init_weights=False)
        if member is not None:
            kwargs["transform_input"] = True
    if member is not None and name.startswith("vit_"):
        kwargs["image_size"] = member.meta["min_size"][0]
    return kwargs


def without_aux_heads(model: nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``state`` less the keys of auxiliary heads (:data:`AUX_HEADS`) that ``model`` was built without:
    torchvision loads its inception_v3 and googlenet weights with them, then drops the heads."""
    own = model.state_dict()
    return {k: v for k, v in state.items() if k in own or not k.startswith(AUX_HEADS)}


def train_both_heads(model: nn.Module, name: str, method: str) -> None:
    """A student with a distillation token (timm's distilled DeiT) made to return (class head's,
    distillation head's) logits in train mode; in eval mode it returns their average as before.
    KDError naming ``method`` and the model where it has no distillation token."""
    switch = getattr(model, "set_distilled_training", None)
    if switch is None:
        raise KDError(
            f"KD loss {method!r} needs a student with a distillation token (timm:deit_*_distilled_*); {name} has none"
        )
    switch(True)


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode and no gradients: the teacher is never trained."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
