"""Each model's data config found from its name and weights, and a run's config completed with them.

A :class:`kd.data.data_config.DataConfig` from timm's pretrained config, torchvision's weight
transforms or a kd run's own checkpoint; the note of a kd-trained teacher validated at other sizes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, Optional

from kd.data.data_config import IMAGENET_MEAN, IMAGENET_STD, INTERPOLATIONS, DataConfig
from kd.errors import KDError
from kd.models import is_named, timm_arch, torchvision_weights
from kd.utils.model_names import TIMM_PREFIX
from kd.utils.weight_files import kd_run_data, kd_run_sizes, run_settings


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


def teacher_preprocessing_note(cfg) -> Optional[str]:
    """Where a kd-trained teacher was validated at other sizes than this run: why its top-1 differs."""
    trained = run_settings(cfg.teacher_weights).get("config") or {}
    if not trained.get("image_size"):
        return None
    own = DataConfig.from_dict(trained.get("student_data") or {})  # its run validated as its student's config says
    theirs = (trained["image_size"], trained.get("val_resize") or own.val_resize(trained["image_size"]))
    ours = DataConfig.from_dict(cfg.teacher_data or {}).evaluation(cfg.image_size)
    if theirs == ours:
        return None
    return (
        f"teacher {cfg.teacher}: trained and validated at image size {theirs[0]}, val resize {theirs[1]}; this run "
        f"validates at {ours[0]}, {ours[1]}, so its top-1 here differs from its own run's"
    )
