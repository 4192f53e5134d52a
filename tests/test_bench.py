"""kd bench on the CPU: every combination in its own process set, one table, rows that explain failures."""
from __future__ import annotations

import csv
import json

from conftest import run_kd


def test_bench_table_csv_json_on_cpu(tmp_path):
    out = tmp_path / "bench"
    r = run_kd("bench", "--teacher", "resnet18", "--student", "resnet18", "--device", "cpu", "--nproc", "2",
               "--backends", "single,torch_ddp,dp", "--opt", "O0,O1", "-b", "4", "--image-size", "32",
               "--iters", "3", "--warmup", "1", "--out", out)
    assert r.returncode == 0, r.stderr
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert [(x["backend"], x["opt"]) for x in rows] == [(b, o) for b in ("single", "torch_ddp", "dp") for o in ("O0", "O1")]
    ran = [x for x in rows if x["backend"] != "dp"]
    for x in ran:
        assert x["img_per_s"] > 0 and x["s_per_20_iters"] > 0, x
    assert "2 process(es)" in ran[2]["impl"] and "bfloat16" in ran[3]["impl"]
    for x in rows[4:]:
        assert x["img_per_s"] == "-" and "CUDA" in x["note"] or "--nproc" in x["note"], x
    assert ran[0]["speedup"] == 1.0
    with open(out / "bench.csv") as fh:
        assert len(list(csv.DictReader(fh))) == 6
    assert "| torch_ddp | O1 |" in r.stdout
