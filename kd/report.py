"""``kd report OUT...``: several runs' metrics.jsonl as one table (markdown and CSV)."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Dict, List, Sequence

import yaml

from kd.errors import KDError

COLUMNS = ["run", "method", "teacher", "student", "epochs", "best_top1", "best_top5", "last_top1", "last_top5",
           "reference_top1", "diff", "wall_h"]


def collect(run: Path) -> Dict[str, object]:
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise KDError(f"{run} has no metrics.jsonl (is it a kd run folder?)")
    try:
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError:
        raise KDError(f"{metrics} is not valid JSON lines") from None
    evals = [r for r in records if "val_top1" in r]
    if not evals:
        raise KDError(f"{run} has no evaluated epoch yet")
    cfg = {}
    if (run / "config.yaml").is_file():
        cfg = yaml.safe_load((run / "config.yaml").read_text()) or {}
    best = max(evals, key=lambda r: r["val_top1"])
    last = evals[-1]
    ref = (cfg.get("reference") or {}).get("top1")
    return {
        "run": str(run), "method": "baseline" if cfg.get("no_teacher") else cfg.get("kd_loss", "?"),
        "teacher": "-" if cfg.get("no_teacher") else cfg.get("teacher", "?"), "student": cfg.get("student", "?"),
        "epochs": f"{records[-1]['epoch']}/{cfg.get('epochs', '?')}",
        "best_top1": round(best["val_top1"], 2), "best_top5": round(best["val_top5"], 2),
        "last_top1": round(last["val_top1"], 2), "last_top5": round(last["val_top5"], 2),
        "reference_top1": ref if ref is not None else "-",
        "diff": round(best["val_top1"] - ref, 2) if ref is not None else "-",
        "wall_h": round(sum(r.get("seconds", 0.0) for r in records) / 3600, 2),
    }


def report(runs: Sequence[Path]) -> List[Dict[str, object]]:
    return [collect(Path(r)) for r in runs]


def markdown(rows: List[Dict[str, object]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def to_csv(rows: List[Dict[str, object]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()
