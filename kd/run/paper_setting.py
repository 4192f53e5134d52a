"""The paper setting a run resembles, and where it departs from it in what kd's defaults choose
otherwise: the teacher's weights, the weight decay, the temperature, stochastic depth.

The setting is a recipe's (``recipes/``, the official configs): the run's own, or else the recipe
of the same teacher and student (a student of the same family: ``timm:mobilenetv1_100`` and
``mobilenet_v2`` are both MobileNets), of the same method where there is one; a run without a
teacher resembles the recipe of its student alone."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import yaml

from kd import models
from kd.errors import KDError

#: the recipes shipped with kd (kd.config's RECIPE_DIR; read here with yaml alone)
RECIPE_DIR = Path(__file__).resolve().parents[2] / "recipes"
#: a KD method's default hyper-parameters, by its name (``kd.losses.LOSSES.get(name).defaults``)
MethodDefaults = Callable[[str], Dict[str, Any]]


@dataclass(frozen=True)
class Departure:
    """One setting of a run unlike its paper's: ``short`` for a table's cell, ``words`` for a sentence."""

    key: str
    short: str
    words: str


def _family(model: str) -> str:
    """A model's family: its name's first letters, a version's ``v`` dropped (``mobilenetv1_100``: mobilenet)."""
    letters = re.match(r"[a-z]*", model.split(":")[-1].lower()).group()  # type: ignore[union-attr]
    return letters[:-1] if len(letters) > 4 and letters.endswith("v") else letters


def _read(path: Path) -> Dict[str, Any]:
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return values if isinstance(values, dict) else {}


@functools.lru_cache(maxsize=1)
def _recipes() -> Tuple[Tuple[str, Dict[str, Any]], ...]:
    """Every shipped recipe that has a paper's reference, by name (read once per process)."""
    found = []
    for path in sorted(RECIPE_DIR.rglob("*.yaml")):
        values = _read(path)
        if values.get("reference"):
            found.append((str(path.relative_to(RECIPE_DIR).with_suffix("")), values))
    return tuple(found)


def _recipe(name: str) -> Dict[str, Any]:
    """The recipe a run names (by name under ``recipes/``, or a path); empty where it is not found."""
    for path in (RECIPE_DIR / f"{name}.yaml", RECIPE_DIR / name, Path(name)):
        if path.suffix in (".yaml", ".yml") and path.is_file():
            return _read(path)
    return {}


#: the classes of ImageNet-1k, every paper recipe's data
IMAGENET_CLASSES = 1000


def standardised(values: Dict[str, Any]) -> bool:
    """Whether a config or recipe (as a dict) z-scores the logits: ``standardise`` or ``loss_args.standardise``."""
    return bool(values.get("standardise") or (values.get("loss_args") or {}).get("standardise"))


def resembled(cfg: Dict[str, Any]) -> Optional[Tuple[str, Dict[str, Any]]]:
    """(name, values) of the recipe whose setting the run of ``cfg`` (a config as a dict) resembles, or None."""
    if cfg.get("recipe"):
        recipe = _recipe(str(cfg["recipe"]))  # not found: a recipe of another machine, nothing to compare with
        return (str(cfg["recipe"]), recipe) if recipe else None
    if cfg.get("num_classes") not in (None, IMAGENET_CLASSES):
        return None  # the recipes are ImageNet-1k's: a run on other classes resembles none of them
    student = str(cfg.get("student") or "")
    alone = bool(cfg.get("no_teacher"))
    ranked = []
    for name, recipe in _recipes():
        if bool(recipe.get("no_teacher")) != alone or (not alone and recipe.get("teacher") != cfg.get("teacher")):
            continue
        if _family(str(recipe.get("student", ""))) != _family(student):
            continue
        same_method = alone or recipe.get("kd_loss", "kd") == cfg.get("kd_loss", "kd")
        same_trainer = bool(recipe.get("dot")) == bool(cfg.get("dot"))  # DOT's recipes for a --dot run
        same_logits = standardised(recipe) == standardised(cfg)  # the + LS recipes for a standardised run
        ranked.append(
            (not same_method, not same_trainer, not same_logits, recipe.get("student") != student, name, recipe)
        )
    if not ranked:
        return None
    *_, name, recipe = min(ranked, key=lambda r: r[:5])
    return name, recipe


def _temperature(cfg: Dict[str, Any], method_defaults: MethodDefaults) -> Optional[float]:
    """The temperature a config's method trains at: ``--temperature``, ``loss_args``, the method's default."""
    defaults = method_defaults(str(cfg.get("kd_loss", "kd")))
    for value in (cfg.get("temperature"), (cfg.get("loss_args") or {}).get("temperature"), defaults.get("temperature")):
        if value is not None:
            return float(value)
    return None


def _teacher_weights(model: str, weights: Optional[str]) -> Optional[str]:
    """The torchvision enum member named by ``weights`` (``pretrained``: the library's default), or
    ``weights`` itself where it names none (none, timm's, a file)."""
    if not (models.is_named(weights) and not model.startswith(models.TIMM_PREFIX)):
        return weights
    try:
        return models.torchvision_weights(model, str(weights)).name
    except KDError:
        return weights


def departures(cfg: Dict[str, Any], method_defaults: MethodDefaults) -> Tuple[Optional[str], List[Departure]]:
    """(the recipe the run of ``cfg`` resembles, or None; where it departs from it in teacher weights,
    weight decay and temperature). What ``cfg`` leaves out (a config of an older kd) is not compared,
    nor a teacher from a file: its weights are not known here."""
    found = resembled(cfg)
    if found is None:
        return None, []
    name, recipe = found
    out: List[Departure] = []
    if not cfg.get("no_teacher") and cfg.get("teacher") == recipe.get("teacher") and "teacher_weights" in cfg:
        given = cfg.get("teacher_weights")
        ours = _teacher_weights(str(cfg.get("teacher")), given)
        theirs = _teacher_weights(str(recipe.get("teacher")), recipe.get("teacher_weights"))
        if ours != theirs and (models.is_named(given) or given in (None, "none")):
            said = f"{given} = {ours}" if ours != given else str(given)
            option = recipe.get("teacher_weights")
            hint = f", --teacher-weights {option}" if models.is_named(option) and option != "pretrained" else ""
            words = f"teacher weights {said} (the paper's: {theirs}{hint})"
            out.append(Departure("teacher_weights", f"teacher {ours}", words))
    if "weight_decay" in cfg and cfg["weight_decay"] != recipe.get("weight_decay", cfg["weight_decay"]):
        wd, paper_wd = cfg.get("weight_decay"), recipe.get("weight_decay")
        out.append(Departure("weight_decay", f"wd {wd:g}", f"weight decay {wd:g} (the paper's: {paper_wd:g})"))
    if "wd_bn_bias" in cfg and bool(cfg["wd_bn_bias"]) != bool(recipe.get("wd_bn_bias")):
        if recipe.get("wd_bn_bias"):
            words = "BatchNorm and biases not decayed (the paper decays every parameter: --wd-bn-bias)"
        else:
            words = "BatchNorm and biases decayed (the paper does not decay them: --no-wd-bn-bias)"
        short = "no wd on BN/bias" if recipe.get("wd_bn_bias") else "wd on BN/bias"
        out.append(Departure("wd_bn_bias", short, words))
    if "dot" in cfg and bool(cfg["dot"]) != bool(recipe.get("dot")):
        short = "DOT" if cfg["dot"] else "no DOT"
        words = "DOT (the paper trains without it)" if cfg["dot"] else "no DOT (the paper trains with --dot)"
        out.append(Departure("dot", short, words))
    if cfg.get("drop_path") is not None and cfg["drop_path"] != recipe.get("drop_path"):
        rate, theirs = cfg["drop_path"], recipe.get("drop_path")
        paper = "the paper trains without it" if theirs is None else f"the paper's: {theirs:g}"
        out.append(Departure("drop_path", f"drop path {rate:g}", f"drop path {rate:g} ({paper})"))
    told = "temperature" in cfg or "loss_args" in cfg
    if told and not cfg.get("no_teacher") and cfg.get("kd_loss", "kd") == recipe.get("kd_loss", "kd"):
        ours_t, theirs_t = _temperature(cfg, method_defaults), _temperature(recipe, method_defaults)
        if ours_t != theirs_t and theirs_t is not None and ours_t is not None:
            out.append(Departure("temperature", f"T {ours_t:g}", f"T {ours_t:g} (the paper's: {theirs_t:g})"))
    return name, out


def start_line(cfg: Dict[str, Any], method_defaults: MethodDefaults) -> Optional[str]:
    """The line a run starts with where it departs from the paper setting it resembles; None where
    it does not (or resembles none)."""
    name, found = departures(cfg, method_defaults)
    if not found:
        return None
    return (
        f"paper setting: unlike recipe {name}, this run has {'; '.join(d.words for d in found)} "
        f"(kd train --recipe {name} for the paper's)"
    )


#: the settings :func:`departures` compares as their meaning (``pretrained`` is the papers' V1 for resnet34)
COMPARED = {"teacher_weights", "weight_decay", "wd_bn_bias", "dot", "temperature"}
#: the departures a paper_setting cell names; more are ``...``
CELL_DEPARTURES = 3


def cell(
    cfg: Dict[str, Any],
    method_defaults: MethodDefaults,
    gaps: Optional[Callable[[Dict[str, Any]], List[Departure]]] = None,
) -> str:
    """``kd report``'s paper_setting: ``-`` (no recipe resembles the run), ``as NAME``, or
    ``unlike NAME: teacher IMAGENET1K_V2, T 4``. ``gaps(recipe)`` names what else departs from the
    resembled recipe's values (the data, the batch, the epochs: kd.commands.report.setting_gaps);
    a run is ``as NAME`` only where neither finds a difference."""
    name, found = departures(cfg, method_defaults)
    if name is None:
        return "-"
    if gaps is not None:
        recipe = _recipe(name) if cfg.get("recipe") else dict(_recipes()).get(name, {})
        others = [gap for gap in gaps(recipe) if gap.key not in COMPARED]
        # the data first (it alone decides), then the part of it trained an epoch
        data = [gap for gap in others if gap.key in ("train_images", "limit_train_batches")]
        found = data + found + [gap for gap in others if gap not in data]
    if not found:
        return f"as {name}"
    more = " ..." if len(found) > CELL_DEPARTURES else ""
    return f"unlike {name}: {', '.join(d.short for d in found[:CELL_DEPARTURES])}{more}"
