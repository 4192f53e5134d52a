"""Recipes: YAML files of options under ``recipes/``, found by name (:func:`find_recipe`) and read
with ``yaml.safe_load`` alone (:func:`load_yaml`, which also reads a run's saved ``config.yaml``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Union

import yaml

from kd.errors import KDError, suggest

RECIPE_DIR = Path(__file__).resolve().parent.parent.parent / "recipes"


def find_recipe(name: str) -> Path:
    """A recipe by path, or by name under ``recipes/`` (``imagenet/r34_r18_kd``)."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    for candidate in (RECIPE_DIR / name, RECIPE_DIR / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    known = [str(p.relative_to(RECIPE_DIR).with_suffix("")) for p in RECIPE_DIR.rglob("*.yaml")]
    raise KDError(f"no recipe {name!r}{suggest(name, known)}; see 'kd recipes list'")


def load_yaml(path: Union[str, Path], what: str = "recipe") -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise KDError(f"cannot read {what} {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise KDError(f"{what} {path} is damaged: it is not UTF-8 text") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise KDError(f"{what} {path} is not valid YAML{where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise KDError(f"{what} {path} must be a mapping of option: value")
    return {str(k).replace("-", "_"): v for k, v in data.items()}
