"""Recipes resolve into valid configs and losses; recipes list/show and report work from the CLI."""
from __future__ import annotations

import json

import pytest

from kd import config as kd_config
from kd import recipes
from kd.losses import build_loss
from conftest import kd_main

NAMES = recipes.names()


def test_expected_recipes_exist():
    for method in ("kd", "dkd", "dist", "lskd", "at"):
        assert f"imagenet/r34_r18_{method}" in NAMES
    for name in ("imagenet/r50_mv1_kd", "imagenet/r50_mv1_dkd", "imagenet/r101_r18_kd", "imagenet/baseline_r18"):
        assert name in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_recipe_resolves_to_a_valid_run(name):
    cfg = kd_config.resolve(recipe=name)
    assert cfg.epochs == 100 and cfg.lr_milestones == [30, 60, 90]
    assert cfg.lr == pytest.approx(0.1 * cfg.batch_size / 256)  # the linear scaling rule
    assert cfg.reference and "gpus" in cfg.reference and "per_gpu_batch" in cfg.reference
    if not cfg.no_teacher:
        build_loss(cfg.kd_loss, 1000, cfg.loss_kwargs())


def test_short_schedule_scales_milestones():
    cfg = kd_config.resolve(recipe="imagenet/r34_r18_dkd", sets=["epochs=20"])
    assert cfg.epochs == 20 and cfg.lr_milestones == [6, 12, 18]


def test_recipes_cli_and_report(tmp_path):
    r = kd_main("recipes", "list")
    assert r.returncode == 0 and "imagenet/r34_r18_dkd" in r.stdout and "71.7" in r.stdout
    r = kd_main("recipes", "show", "imagenet/r34_r18_dist")
    assert r.returncode == 0 and "kd_loss: dist" in r.stdout
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("kd_loss: dkd\nteacher: resnet34\nstudent: resnet18\nepochs: 3\n"
                                     "reference: {top1: 71.7}\n")
    rows = [{"epoch": e, "val_top1": v, "val_top5": v + 20, "seconds": 1800} for e, v in ((1, 60.0), (2, 70.5), (3, 70.1))]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    r = kd_main("report", run, "--csv", tmp_path / "t.csv")
    assert r.returncode == 0, r.stderr
    assert "| dkd | resnet34 | resnet18 | 3/3 | 70.5 | 90.5 | 70.1 | 90.1 | 71.7 | -1.2 | 1.5h |" in r.stdout
    assert (tmp_path / "t.csv").read_text().startswith("run,method")
    r = kd_main("report", tmp_path / "nothing")
    assert r.returncode == 2 and "does not exist" in r.stderr
