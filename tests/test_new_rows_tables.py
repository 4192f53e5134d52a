"""The 2024 rows in kd bench --methods and in kd report's paper tables: the methods named before any run
starts, the rows in the papers' order with their references."""

from __future__ import annotations

import dataclasses

from conftest import kd_main, one_error_line
from test_report import _table_run

from kd import config as kd_config
from kd.run.students import plan

NEW_ROWS = ["ttm", "wttm", "luminet", "crld", "sdkd", "sddkd", "sdnkd"]
#: tiny combinations, should a refusal be missed
MODELS = ["--teacher", "timm:test_resnet", "--student", "timm:test_resnet", "--device", "cpu", "--backends", "single"]
MODELS += ["--opt", "O0", "-b", "4", "--image-size", "32", "--iters", "1", "--warmup", "1"]


def test_bench_methods_takes_the_new_rows_and_refuses_an_unknown_one_before_any_run(tmp_path):
    """A misspelt method among them: one line naming it (and the methods, the new rows among them),
    no run started, nothing written."""
    out = tmp_path / "bench"
    line = one_error_line(kd_main("bench", *MODELS, "--methods", ",".join(["kd", *NEW_ROWS, "wtm"]), "--out", out))
    assert line.startswith("kd: error: unknown KD loss 'wtm'"), line
    assert all(f" {name}," in line or line.endswith(f" {name}") for name in NEW_ROWS), line
    assert not out.exists()
    line = one_error_line(kd_main("bench", *MODELS, "--methods", "kd,wttm,kd", "--out", out))
    assert line == "kd: error: --methods names kd twice; each student needs its own method", line
    assert not out.exists()


def test_the_r50_mv1_table_puts_the_new_rows_after_the_earlier_methods_with_their_references(tmp_path):
    """ResNet-50 -> MobileNet-V1: the earlier rows, then LumiNet, CRLD and the scale-decoupled rows, each
    with its paper's top-1 (CRLD's has none; WTTM, without a recipe, none either)."""
    for recipe, top1 in (("r50_mv1_sdnkd", 73.0), ("r50_mv1_crld", 72.9), ("r50_mv1_sdkd", 72.2),
                         ("r50_mv1_luminet", 72.5), ("r50_mv1_sddkd", 73.1), ("r50_mv1_dkd", 72.0),
                         ("r50_mv1_kd", 70.6)):  # fmt: skip
        _table_run(tmp_path, f"imagenet/{recipe}", top1)
    # WTTM as a student of `kd train --recipe imagenet/r50_mv1_kd --kd-loss kd,wttm`: its setting, WTTM's defaults
    students = plan(["imagenet/r50_mv1_kd"], {"kd_loss": "kd,wttm"}, [])
    wttm = students.cfgs[students.names.index("wttm")]
    assert wttm.loss_kwargs() == {}  # WTTM's defaults, not the KD recipe's temperature and weights
    run = _table_run(tmp_path / "wttm", "imagenet/r50_mv1_kd", 73.0)
    kd_config.save(dataclasses.replace(wttm, out=str(run)), run / "config.yaml")
    r = kd_main("report", tmp_path, "--format", "latex", "--epoch", "best")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.endswith(r"\\") and "multicolumn" not in line][1:]
    assert [row.split(" & ")[0] for row in rows] == ["KD", "DKD", "WTTM [1]", "LumiNet", "CRLD", "SD-KD", "SD-DKD",
                                                      "SD-NKD"], r.stdout  # fmt: skip
    assert r"SD-KD & 72.20 & 91.70 & 72.24 & -0.04 \\" in rows, r.stdout
    assert r"SD-DKD & 73.10 & 92.60 & 73.08 & +0.02 \\" in rows, r.stdout
    assert r"SD-NKD & 73.00 & 92.50 & 73.12 & -0.12 \\" in rows, r.stdout
    assert r"LumiNet & 72.50 & 92.00 & 72.55 & -0.05 \\" in rows, r.stdout
    assert r"CRLD & 72.90 & 92.40 & - & - \\" in rows and r"WTTM [1] & 73.00 & 92.50 & - & - \\" in rows, r.stdout
