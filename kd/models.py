"""Models by name (torchvision, or ``timm:NAME``) and weight loading from local files."""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from kd.errors import KDError, suggest
from kd.utils import archs, checkpoint_io, model_names
from kd.utils.model_names import TIMM_PREFIX
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
        obj = _kd_checkpoint(str(weights)) if weights else None
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


def classifier_outputs(state: Dict[str, torch.Tensor]) -> Optional[int]:
    """Number of classes of the last 2-D weight in a state dict (the classifier head)."""
    last = None
    for key, value in state.items():
        if key.endswith("weight") and getattr(value, "ndim", 0) == 2:
            last = value
    return None if last is None else int(last.shape[0])


def load_state_file(path: str) -> Dict[str, torch.Tensor]:
    """A state dict from a file: plain, wrapped (``state_dict``/``model``/...), or a kd checkpoint.

    Loaded with ``weights_only=True``: a file that needs arbitrary code to unpickle is refused; a
    file kd wrote is checked against the SHA-256 beside it first (:func:`kd.utils.checkpoint_io.verify`).
    """
    p = Path(path)
    if not p.is_file():
        raise KDError(f"weights file {path} does not exist (expected pretrained, none or a file path)")
    checkpoint_io.verify(p)  # a file kd wrote: against the sum beside it
    return extract_state(checkpoint_io.read(p, "cannot read weights file"), path)


def extract_state(obj: Any, path: str) -> Dict[str, torch.Tensor]:
    if isinstance(obj, dict) and "kd_version" in obj and isinstance(obj.get("student"), dict):
        obj = obj["student"]
    for key in ("state_dict_ema", "state_dict", "model_ema", "model", "student", "net"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict) and _is_state(obj[key]):
            obj = obj[key]
            break
    if not (isinstance(obj, dict) and _is_state(obj)):
        raise KDError(f"{path} holds no state dict (a mapping of parameter names to tensors)")
    prefixes = ("module.", "_orig_mod.", "model.")
    out = {}
    for key, value in obj.items():
        for prefix in prefixes:
            while key.startswith(prefix):
                key = key[len(prefix) :]
        out[key] = value
    return out


def _is_state(d: dict) -> bool:
    return bool(d) and all(isinstance(k, str) for k in d) and any(isinstance(v, torch.Tensor) for v in d.values())


def load_into(model: nn.Module, state: Dict[str, torch.Tensor], name: str, source: str) -> None:
    """Load ``state`` strictly into ``model``; a mismatch is one clear KDError."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shape = [k for k in own if k in state and tuple(own[k].shape) != tuple(state[k].shape)]
    if missing or unexpected or shape:
        parts = []
        if shape:
            k = shape[0]
            parts.append(
                f"{len(shape)} shape mismatches (e.g. {k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)})"
            )
        if missing:
            parts.append(f"{len(missing)} missing keys (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys (e.g. {unexpected[0]})")
        raise KDError(f"weights {source} do not fit {name}: {'; '.join(parts)}")
    model.load_state_dict(state, strict=True)


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


# ----------------------------------------------------------------------------- each model's data config
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
INTERPOLATIONS = ("bilinear", "bicubic")


@dataclass(frozen=True)
class DataConfig:
    """How a model wants its images (timm's ``resolve_data_config``, torchvision's weight transforms):
    the normalisation (0-1 scale), and its evaluation transform, the short side resized to
    ``val_resize(image_size)`` with ``interpolation``, then the centre crop."""

    mean: Tuple[float, float, float] = IMAGENET_MEAN
    std: Tuple[float, float, float] = IMAGENET_STD
    interpolation: str = "bilinear"
    #: the short side before the crop, as a multiple of the crop (256/224 for torchvision's ImageNet)
    resize_ratio: float = 256 / 224
    #: timm floors ``image_size / crop_pct``; torchvision's resize sizes are published numbers, kd rounds
    floor: bool = False
    source: str = "torchvision's ImageNet defaults"
    #: the resolution its weights were trained at (timm's ``input_size``, torchvision's crop size, a kd
    #: run's ``--image-size``); None: no weights of a known size, it takes the run's crop as it is
    size: Optional[int] = None
    #: its weights' published evaluation crop (timm's ``test_input_size`` where given), and the short
    #: side as a multiple of it there (timm's ``1 / test_crop_pct``; None: ``resize_ratio``)
    eval_size: Optional[int] = None
    eval_ratio: Optional[float] = None
    #: timm's ``crop_mode`` (center, squash, border); kd's evaluation crops from the centre
    crop_mode: str = "center"

    def val_resize(self, image_size: int, ratio: Optional[float] = None) -> int:
        value = image_size * (ratio or self.resize_ratio)
        return int(math.floor(value + 1e-6)) if self.floor else int(round(value))

    def train_size(self, crop: int) -> int:
        """The side this model is fed during training when the run's crops are ``crop`` pixels."""
        return self.size or crop

    def evaluation(self, crop: int) -> Tuple[int, int]:
        """Its evaluation crop and short-side resize: its weights' published ones, else at ``crop``."""
        if not self.eval_size:
            return crop, self.val_resize(crop)
        return self.eval_size, self.val_resize(self.eval_size, self.eval_ratio)

    def training_line(self, crop: int) -> str:
        """What the model sees in training: ``train 224`` or ``train 224->299 (resized on the device)``."""
        size = self.train_size(crop)
        return f"train {crop}" if size == crop else f"train {crop}->{size} (resized on the device)"

    def describe(
        self, image_size: int, resize: Optional[int] = None, interpolation: Optional[str] = None, own: bool = False
    ) -> str:
        """One line: the normalisation and the evaluation transform; ``resize`` and ``interpolation``
        where the run's options (``--val-resize``, ``val_interpolation``) replace the model's; ``own``:
        evaluated at its weights' own size where they have one (:meth:`evaluation`), not ``image_size``."""
        mean = ", ".join(f"{m:g}" for m in self.mean)
        std = ", ".join(f"{s:g}" for s in self.std)
        if own:
            image_size, resize = self.evaluation(image_size)
        size = resize or self.val_resize(image_size)
        option = " (--val-resize)" if resize and not own else ""
        how = f"{interpolation} (val_interpolation)" if interpolation else self.interpolation
        line = f"mean ({mean}) std ({std}); eval: {how} resize {size}{option}, centre crop {image_size} ({self.source})"
        if self.crop_mode != "center":
            line += f"; timm crops these weights by {self.crop_mode!r}, kd from the centre"
        if size < image_size:  # torchvision's CenterCrop pads; kd's crop is the same, bit for bit
            line += f"; resize {size} is smaller than the crop: its border is padded with black, as torchvision does"
        return line

    def to_dict(self) -> Dict[str, Any]:
        return {
            "mean": list(self.mean),
            "std": list(self.std),
            "interpolation": self.interpolation,
            "resize_ratio": self.resize_ratio,
            "floor": self.floor,
            "source": self.source,
            "size": self.size,
            "eval_size": self.eval_size,
            "eval_ratio": self.eval_ratio,
            "crop_mode": self.crop_mode,
        }

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> DataConfig:
        if d.get("interpolation", "bilinear") not in INTERPOLATIONS:
            raise KDError(f"interpolation {d.get('interpolation')!r}: kd resizes with {' or '.join(INTERPOLATIONS)}")
        return cls(
            tuple(float(x) for x in d.get("mean", IMAGENET_MEAN)),  # type: ignore[arg-type]
            tuple(float(x) for x in d.get("std", IMAGENET_STD)),  # type: ignore[arg-type]
            str(d.get("interpolation", "bilinear")),
            float(d.get("resize_ratio", 256 / 224)),
            bool(d.get("floor", False)),
            str(d.get("source", "given")),
            _size(d.get("size")),
            _size(d.get("eval_size")),
            float(d["eval_ratio"]) if d.get("eval_ratio") else None,
            str(d.get("crop_mode") or "center"),
        )


def _size(value: Any) -> Optional[int]:
    return int(value) if value else None


def data_config(name: str, weights: Optional[str] = "none") -> DataConfig:
    """Model ``name``'s data config, from its name and ``weights`` alone (no model is built):
    a timm model's pretrained config (its default tag's, or ``timm:TAG``'s); a torchvision model's
    named weights' transforms (``pretrained`` is the library's default weights); otherwise
    torchvision's ImageNet defaults. Weights from a file keep the model's own config (timm) or
    the defaults (torchvision). Named weights and a kd checkpoint carry their size (training and
    evaluation); random weights and other files take the run's."""
    weights = weights or "none"
    stored = kd_run_data(weights)
    if stored:  # a kd checkpoint: the data config its run trained and validated with, at its run's size
        size, resize = kd_run_sizes(weights)
        at_size = {"size": size, "eval_size": size, "eval_ratio": resize / size if size and resize else None}
        return DataConfig.from_dict({**stored, "source": f"its kd run, {Path(weights).name}", **at_size})
    if name.startswith(TIMM_PREFIX):
        from timm.models import get_pretrained_cfg

        arch = timm_arch(name, weights) if is_named(weights) else name[len(TIMM_PREFIX) :]
        cfg = get_pretrained_cfg(arch)
        if cfg is None:
            return DataConfig(source=f"timm has no pretrained config for {arch}: torchvision's ImageNet defaults")
        interpolation = cfg.interpolation if cfg.interpolation in INTERPOLATIONS else "bicubic"
        sizes: Dict[str, Any] = {}
        if is_named(weights):  # the sizes of these weights (timm's resolve_data_config, use_test_size at eval)
            test = cfg.test_input_size or cfg.input_size
            test_pct = cfg.test_crop_pct or cfg.crop_pct
            sizes = {"size": cfg.input_size[-1], "eval_size": test[-1], "eval_ratio": 1.0 / test_pct}
            sizes["crop_mode"] = cfg.crop_mode or "center"
        mean, std = tuple(cfg.mean), tuple(cfg.std)
        return DataConfig(mean, std, interpolation, 1.0 / cfg.crop_pct, True, f"timm {arch}", **sizes)  # type: ignore[arg-type]
    if not is_named(weights):
        return DataConfig()
    member = torchvision_weights(name, weights)
    keys = getattr(member.transforms, "keywords", {})
    crop, resize = keys.get("crop_size", 224), keys.get("resize_size", 256)
    mode = str(getattr(keys.get("interpolation"), "value", "bilinear"))
    return DataConfig(
        tuple(keys.get("mean", IMAGENET_MEAN)),  # type: ignore[arg-type]
        tuple(keys.get("std", IMAGENET_STD)),  # type: ignore[arg-type]
        mode if mode in INTERPOLATIONS else "bilinear",
        resize / crop,
        False,
        f"torchvision {type(member).__name__}.{member.name}",
        size=crop,
        eval_size=crop,
    )


def _kd_checkpoint(weights: str) -> Optional[Dict[str, Any]]:
    """A kd checkpoint's contents (memory-mapped), or None for named weights and other files."""
    if not weights or is_named(weights) or weights == "none" or not Path(weights).is_file():
        return None
    checkpoint_io.verify(weights)  # damaged: said here, not taken for a file of another kind
    try:
        obj = checkpoint_io.read(weights, "cannot read weights file", mmap=True)
    except KDError:  # not a file kd can read: building the model says why
        return None
    return obj if isinstance(obj, dict) and "kd_version" in obj else None


def kd_run_model(weights: str) -> Optional[str]:
    """The model a kd checkpoint holds (its run's student), or None for any other weights."""
    obj = _kd_checkpoint(weights)
    return obj.get("student_name") if obj else None


def kd_run_sizes(weights: str) -> Tuple[Optional[int], Optional[int]]:
    """The ``--image-size`` a kd checkpoint's run trained at and its ``--val-resize`` where given;
    None for any other weights."""
    obj = _kd_checkpoint(weights)
    config = obj.get("config") if obj else None
    if not isinstance(config, dict):
        return None, None
    return _size(config.get("image_size")), _size(config.get("val_resize"))


def kd_run_data(weights: str) -> Optional[Dict[str, Any]]:
    """The student's data config saved in a kd checkpoint's config, or None for any other weights."""
    obj = _kd_checkpoint(weights)
    config = obj.get("config") if obj else None
    data = config.get("student_data") if isinstance(config, dict) else None
    return data if isinstance(data, dict) else None


def with_data_configs(cfg):
    """``cfg`` with its student's and its teacher's data configs (``student_data``, ``teacher_data``)
    resolved from their names and weights where not given (a saved config keeps its own)."""
    changes: Dict[str, Any] = {}
    if cfg.student_data is None and cfg.student is not None:
        student = data_config(cfg.student, cfg.student_weights)
        if cfg.student.startswith("vit_") and student.size and student.size != cfg.image_size:
            raise KDError(
                f"student {cfg.student} with {cfg.student_weights} is built for {student.size} px images only "
                f"(torchvision's ViTs take one size): pass --image-size {student.size}"
            )
        changes["student_data"] = student.to_dict()
    if cfg.teacher_data is None and not cfg.no_teacher and cfg.teacher:
        changes["teacher_data"] = data_config(cfg.teacher, cfg.teacher_weights).to_dict()
    return dataclasses.replace(cfg, **changes) if changes else cfg


MeanStd = Tuple[Sequence[float], Sequence[float]]


class Renormalise:
    """Images normalised with one mean and std (the loaders') as another model wants them:
    ``x * std_a / std_b + (mean_a - mean_b) / std_b`` per channel, one kernel on the device."""

    def __init__(
        self, source: Tuple[Sequence[float], Sequence[float]], target: Tuple[Sequence[float], Sequence[float]]
    ):
        (mean_a, std_a), (mean_b, std_b) = source, target
        self.scale = [sa / sb for sa, sb in zip(std_a, std_b)]
        self.shift = [(ma - mb) / sb for ma, mb, sb in zip(mean_a, mean_b, std_b)]
        self._on: Dict[Any, Tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        key = images.device
        if key not in self._on:
            self._on[key] = (
                torch.tensor(self.scale, device=key).view(1, 3, 1, 1),
                torch.tensor(self.shift, device=key).view(1, 3, 1, 1),
            )
        scale, shift = self._on[key]
        return torch.addcmul(shift, images, scale)


def renormaliser(loader_norm: Optional[MeanStd], data: Optional[Dict[str, Any]]) -> Optional[Renormalise]:
    """A :class:`Renormalise` from the loaders' normalisation (0-255 scale, as the loaders keep it)
    to a model's data config, or None where they agree (or either is unknown: synthetic data)."""
    if loader_norm is None or not data:
        return None
    source = ([m / 255 for m in loader_norm[0]], [s / 255 for s in loader_norm[1]])
    target = (list(data["mean"]), list(data["std"]))
    if all(abs(a - b) < 1e-9 for a, b in zip([*source[0], *source[1]], [*target[0], *target[1]])):
        return None
    return Renormalise(source, target)


def run_settings(weights: str) -> Dict[str, Any]:
    """``model``, ``num_classes`` and ``config`` (the run's RunConfig as a dict) of a kd checkpoint;
    an empty dict for any other weights. Reading problems are left to :func:`kd.models.build`."""
    obj = _kd_checkpoint(weights)
    if obj is None or not isinstance(obj.get("student"), dict):
        return {}
    stored = obj.get("config")
    config: Dict[str, Any] = stored if isinstance(stored, dict) else {}
    return {
        "model": obj.get("student_name") or config.get("student"),
        "num_classes": obj.get("num_classes") or config.get("num_classes"),
        "config": config,
    }


def run_classes(weights: Optional[str]) -> Optional[List[str]]:
    """The class names a kd checkpoint's run trained on (its folders' names, in label order), or
    None for any other weights."""
    obj = _kd_checkpoint(weights) if weights else None
    classes = obj.get("classes") if obj else None
    return [str(c) for c in classes] if isinstance(classes, (list, tuple)) and classes else None


def check_classes(kept: Optional[Sequence[str]], found: Sequence[str], what: str, data: Any) -> None:
    """The class names ``found`` in ``data`` must be those ``what`` (a kd checkpoint) was trained on,
    in the same order: other classes would score every label against another class's output."""
    if not kept or list(kept) == list(found):
        return
    missing = [c for c in kept if c not in set(found)]
    extra = [c for c in found if c not in set(kept)]
    parts = [f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''} {how}" for names, how in
             ((missing, "missing"), (extra, "not trained on")) if names]  # fmt: skip
    differ = "; ".join(parts) or "the same names in another order"
    raise KDError(
        f"{data} has other classes than {what} was trained on: {differ} ({len(kept)} trained, {len(found)} here); "
        "give the data it was trained on"
    )


def teacher_preprocessing_note(cfg) -> Optional[str]:
    """Where a kd-trained teacher was validated at other sizes than this run: why its top-1 differs."""
    trained = run_settings(cfg.teacher_weights).get("config") or {}
    if not trained.get("image_size"):
        return None
    theirs = (trained["image_size"], trained.get("val_resize") or DataConfig().val_resize(trained["image_size"]))
    ours = DataConfig.from_dict(cfg.teacher_data or {}).evaluation(cfg.image_size)
    if theirs == ours:
        return None
    return (
        f"teacher {cfg.teacher}: trained and validated at image size {theirs[0]}, val resize {theirs[1]}; this run "
        f"validates at {ours[0]}, {ours[1]}, so its top-1 here differs from its own run's"
    )
