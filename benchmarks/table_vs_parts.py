"""A several-students run against the sum of its parts, from a ``kd bench --methods`` table.

    python benchmarks/table_vs_parts.py /tmp/kdb/six/bench.json --teacher-ms 4.9 [--images 1281167 --epochs 100]

The together row's batch takes B / (its img/s) seconds (each student sees every image). Its parts: the
teacher's forward once (``--teacher-ms``, as benchmarks/profile_step.py times it alone) and each student's
own step, which is its alone row's batch time less that forward. Prints each row's batch time, the
parts' sum, the together run's time as a multiple of it, and the hours of ``--epochs`` over ``--images``
images at the together run's rate (one GPU: the rows' setting).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_json", type=Path)
    ap.add_argument("--teacher-ms", type=float, required=True, help="the teacher's forward of one batch, ms")
    ap.add_argument("--images", type=int, default=1_281_167, help="images an epoch (ImageNet-1k's train split)")
    ap.add_argument("--epochs", type=int, default=100)
    args = ap.parse_args()

    saved = json.loads(args.bench_json.read_text())
    batch = int(re.search(r"batch (\d+)", saved.get("setting", "")).group(1))  # type: ignore[union-attr]
    rows = [r for r in saved["rows"] if isinstance(r.get("img_per_s"), (int, float))]
    together = next(r for r in rows if "," in str(r["methods"]))
    alone = [r for r in rows if "," not in str(r["methods"])]
    ms = {str(r["methods"]): 1000 * batch / r["img_per_s"] for r in alone}
    own = {m: t - args.teacher_ms for m, t in ms.items()}
    parts = args.teacher_ms + sum(own.values())
    whole = 1000 * batch / together["img_per_s"]
    print("| run | ms a batch | its own step (less the teacher's forward) |\n|---|---|---|")
    for m, t in ms.items():
        print(f"| {m} alone | {t:.2f} | {own[m]:.2f} |")
    print(f"| teacher forward (profiled) | {args.teacher_ms:.2f} | |")
    print(f"| the parts' sum | {parts:.2f} | |")
    print(f"| {together['methods']} together | {whole:.2f} | {whole / parts:.3f}x the parts |")
    hours = args.epochs * args.images / together["img_per_s"] / 3600
    print(f"\n{args.epochs} epochs of {args.images:,} images at {together['img_per_s']:,.0f} img/s: {hours:.1f} h")


if __name__ == "__main__":
    main()
