"""A run's config from its sources: defaults < recipe < command-line options < ``--set key=value``
(:func:`resolve`), each source applied in turn (:func:`apply`, :func:`parse_set`), checked against
kd's methods (:func:`validate`), saved as ``config.yaml`` and read back (:func:`save`, :func:`load`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import yaml

from kd.config.recipes import find_recipe, load_yaml
from kd.config.rules import check
from kd.config.schema import FIELDS, FORMER_ALPHA, LOSS_OPTIONS, RunConfig, coerce
from kd.errors import KDError, suggest
from kd.losses import LOSSES, check_method


def parse_set(items: List[str]) -> Dict[str, Any]:
    """``["epochs=5", "loss_args.beta=8"]`` -> ``{"epochs": "5", "loss_args": {"beta": 8}}``."""
    out: Dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise KDError(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        key = key.strip().replace("-", "_")
        if key.startswith("loss_args."):
            out.setdefault("loss_args", {})[key.split(".", 1)[1]] = yaml.safe_load(value)
        else:
            out[key] = value
    return out


def apply(cfg: RunConfig, values: Dict[str, Any], source: str) -> RunConfig:
    """A copy of ``cfg`` with ``values`` applied; ``source`` names where they came from in errors."""
    values = dict(values)
    alpha = values.pop(FORMER_ALPHA, None)
    changes = {}
    for key, value in values.items():
        if key not in FIELDS:
            raise KDError(f"unknown option {key!r} in {source}{suggest(key, FIELDS)}")
        try:
            changes[key] = coerce(key, value)
        except KDError as exc:
            raise KDError(f"{exc} in {source}") from None
    if alpha is not None or "loss_args" in changes or any(changes.get(k) is not None for k in LOSS_OPTIONS):
        changes.update(_loss_changes(cfg, changes, alpha, source))
    return dataclasses.replace(cfg, **changes)


def _loss_changes(cfg: RunConfig, changes: Dict[str, Any], alpha: Any, source: str) -> Dict[str, Any]:
    """``loss_args`` (and LOSS_OPTIONS) after one source's ``changes``.

    The source's former hyper-parameter names become the current ones (one deprecation line
    each; a former and its current name together are an error), its ``alpha`` too where the
    method is kd. A LOSS_OPTIONS value replaces the same key of earlier ``loss_args`` and
    the other way round, so ``--temperature`` overrides a recipe's ``loss_args.temperature``.
    """
    method = changes.get("kd_loss", cfg.kd_loss)
    own = dict(changes.get("loss_args", {}))
    if alpha is not None:
        if method != "kd":
            extra = "; it set DKD's TCKD weight, now --loss-arg tckd_weight=X" if method == "dkd" else ""
            raise KDError(
                f"option 'alpha' ({source}) is gone: it was the label weight of --kd-loss kd; "
                f"use --ce-weight for {method}'s label term{extra}"
            )
        if changes.get("ce_weight") is not None or FORMER_ALPHA in own:
            raise KDError(
                f"{source} gives 'alpha', the former name of ce_weight (and 1 - kd_weight), and ce_weight "
                "or loss_args alpha: give ce_weight and kd_weight, not both"
            )
        own[FORMER_ALPHA] = alpha
    if own:
        own = LOSSES.get(method).upgrade_args(own)
    for name in LOSS_OPTIONS:
        if changes.get(name) is not None and name in own:
            raise KDError(f"{source} gives {name} twice, as an option and in loss_args")
    out: Dict[str, Any] = {"loss_args": {**cfg.loss_args, **own}}
    for name in LOSS_OPTIONS:
        if changes.get(name) is not None:
            out["loss_args"].pop(name, None)
        elif name in own:
            out[name] = None
    return out


def resolve(
    recipe: Optional[str] = None,
    options: Optional[Dict[str, Any]] = None,
    sets: Optional[List[str]] = None,
    base: Optional[RunConfig] = None,
    teaching: bool = False,
) -> RunConfig:
    """Defaults (or ``base``) < recipe < ``options`` < ``--set`` items, then validated (for ``kd
    teach``'s store where ``teaching``)."""
    cfg = base or RunConfig()
    if recipe:
        path = find_recipe(recipe)
        values = load_yaml(path)
        cfg = apply(cfg, values, f"recipe {path}")
        paired = "lr" in values and "batch_size" in values
        cfg = dataclasses.replace(cfg, recipe=str(recipe), lr_for_batch=cfg.batch_size if paired else None)
    planned = cfg
    overrides: Dict[str, Any] = {}
    if options:
        cfg = apply(cfg, options, "the command line")
        overrides.update(options)
    if sets:
        parsed = parse_set(sets)
        cfg = apply(cfg, parsed, "--set")
        overrides.update(parsed)
    if overrides.get("lr") is not None:  # the user's lr: no recipe's batch to measure it against
        cfg = dataclasses.replace(cfg, lr_for_batch=None)
    if base is None and "epochs" in overrides:
        cfg = scale_schedule(cfg, planned.epochs, overrides)
    if base is None and "image_size" in overrides and "val_resize" not in overrides and planned.val_resize:
        # a recipe's val resize is for its own crop: kept in ratio, floored (timm's floor(size / crop_pct) where
        # the recipe's resize is exact, as DeiT's 256 for 224; a pixel under it where it was floored itself)
        cfg = dataclasses.replace(cfg, val_resize=cfg.image_size * planned.val_resize // planned.image_size)
    if cfg.teacher is None and not cfg.no_teacher and not cfg.soft_labels and cfg.teacher_weights:
        check_method(cfg.kd_loss)  # a mistyped name is answered before the checkpoint is read (with torch)
        from kd.utils.weight_files import named_teacher

        cfg = dataclasses.replace(cfg, teacher=named_teacher(cfg.teacher_weights))  # a kd checkpoint names its model
    return validate(cfg, teaching)


#: options that --no-teacher would leave unused, were they typed beside it
TEACHER_OPTIONS = ("teacher", "teacher_weights", "teacher_precision")


def refuse_unused(given: Dict[str, Any]) -> None:
    """Options typed together where one would make the other do nothing: refused rather than
    ignored (a recipe's teacher under --no-teacher is fine: that is its baseline)."""
    if given.get("no_teacher"):
        unused = [name for name in TEACHER_OPTIONS if given.get(name) is not None]
        if unused:
            shown = " ".join(f"--{n.replace('_', '-')} {given[n]}" for n in unused)
            raise KDError(f"--no-teacher trains the student alone: it conflicts with {shown} (unused); give one")


def scale_schedule(cfg: RunConfig, planned_epochs: int, overrides: Dict[str, Any]) -> RunConfig:
    """A shorter (or longer) run keeps the shape of the planned LR schedule.

    When ``epochs`` is overridden (``--epochs 30`` on a 100-epoch recipe, say) and the
    milestones / warm-up are not, they are scaled by the same factor: 30/60/90 becomes 9/18/27.
    """
    if cfg.epochs == planned_epochs or planned_epochs <= 0:
        return cfg
    factor = cfg.epochs / planned_epochs
    changes: Dict[str, Any] = {}
    said = []
    if "lr_milestones" not in overrides:
        changes["lr_milestones"] = sorted({max(1, int(round(m * factor))) for m in cfg.lr_milestones})
        if changes["lr_milestones"] != cfg.lr_milestones and cfg.lr_schedule == "step":  # the others read none
            said.append(f"milestones {_epochs(cfg.lr_milestones)} -> {_epochs(changes['lr_milestones'])}")
    if "warmup_epochs" not in overrides and cfg.warmup_epochs:
        changes["warmup_epochs"] = cfg.warmup_epochs * factor
        said.append(f"warm-up {cfg.warmup_epochs:g} -> {changes['warmup_epochs']:g} epochs")
    if said:
        changes["schedule_note"] = (
            f"the lr schedule is scaled from {planned_epochs} to {cfg.epochs} epochs: {'; '.join(said)} "
            "(--lr-milestones and --warmup-epochs set them)"
        )
    return dataclasses.replace(cfg, **changes)


def _epochs(values: Sequence[int]) -> str:
    return "/".join(str(v) for v in values)


def validate(cfg: RunConfig, teaching: bool = False) -> RunConfig:
    """Checks that need no data, models or devices (of a ``kd teach`` store where ``teaching``), with
    kd's methods (:func:`kd.config.rules.check`); returns ``cfg`` unchanged."""
    return check(cfg, teaching, LOSSES)


def save(cfg: RunConfig, path: Union[str, Path], notes: Sequence[str] = ()) -> None:
    """``cfg`` as YAML; ``notes`` (what kd chose, and why) follow as comments."""
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(cfg.to_dict(), fh, sort_keys=False)
        for note in notes:
            fh.write(f"# {note}\n")


#: keys of configs saved by earlier versions that no run reads now (the command chooses what runs)
RETIRED = ("teach", "timing_warmup")


def load(path: Union[str, Path]) -> RunConfig:
    """A saved ``config.yaml`` (as written by :func:`save`; earlier versions' retired keys dropped)."""
    values = {k: v for k, v in load_yaml(path, "saved config").items() if k not in RETIRED}
    return apply(RunConfig(), values, str(path))
