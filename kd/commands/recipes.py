"""``kd recipes list|show``: the YAML recipes shipped in ``recipes/``."""

from __future__ import annotations

from typing import Dict, List

from kd.commands.table import markdown
from kd.config import RECIPE_DIR, find_recipe, load_yaml


def names() -> List[str]:
    return sorted(str(p.relative_to(RECIPE_DIR).with_suffix("")) for p in RECIPE_DIR.rglob("*.yaml"))


def summary(name: str) -> Dict[str, object]:
    data = load_yaml(find_recipe(name))
    ref = data.get("reference") or {}
    method = "ce" if data.get("no_teacher") else data.get("kd_loss", "kd")
    return {
        "recipe": name,
        "teacher": data.get("teacher", "-") if method != "ce" else "-",
        "student": data.get("student", "-"),
        "method": method,
        "epochs": data.get("epochs", "-"),
        "batch": data.get("batch_size", "-"),
        "lr": data.get("lr", "-"),
        "paper_setup": paper_setup(ref, data.get("batch_size")),
        "reference_top1": top1(ref.get("top1")),
        "source": ref.get("source", "-"),
    }


def paper_setup(ref: Dict[str, object], batch: object) -> str:
    """How the source ran it: 'GPUs x batch per GPU', or the total batch where the GPUs are not stated."""
    if not ref:
        return "-"
    if ref.get("gpus") and ref.get("per_gpu_batch"):
        return f"{ref['gpus']} GPUs x {ref['per_gpu_batch']}"
    return f"batch {batch}, GPUs not stated"


def top1(value: object) -> str:
    """A paper's top-1 as it prints it, with two decimals (YAML reads 71.70 as 71.7); '-' where none."""
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, (int, float)) else str(value)


def table() -> str:
    """Every recipe as a markdown table."""
    rows = [summary(n) for n in names()]
    cols = ["recipe", "teacher", "student", "method", "epochs", "batch", "lr", "paper_setup", "reference_top1"]
    return markdown(rows, cols)


def show(name: str) -> str:
    return find_recipe(name).read_text(encoding="utf-8")
