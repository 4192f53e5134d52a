"""The 2024 rows (ttm, wttm, luminet, crld, sdkd / sddkd / sdnkd) as students of one run, on one teacher
forward per view: each bit for bit its separate run on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from conftest import last_checkpoint, make_image_folder
from tiny import DROP_RUN

import kd
from kd import config as kd_config
from kd.run import students as multi
from kd.run.jobs import TrainJob
from kd.run.launch import train as launch


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(
        tmp_path_factory.mktemp("rows"), classes=3, train_per_class=4, val_per_class=2, size=(20, 16)
    )


#: each method's hyper-parameters beyond its defaults: CRLD's thresholds where a random teacher on three
#: classes is confident on some samples and not on others, so that both of its terms and both masks count
ARGS = {"crld": {"weak_threshold": 0.36, "strong_threshold": 0.4}}


def recipe(folder: Path, method: str) -> str:
    """A student's recipe: its method and :data:`ARGS`."""
    path = folder / f"{method}.yaml"
    path.write_text(yaml.safe_dump({"kd_loss": method, "loss_args": ARGS.get(method, {})}))
    return str(path)


@pytest.fixture(scope="module")
def alone(data, tmp_path_factory):
    """The separate run of a method, trained once for every group that holds it."""
    root = tmp_path_factory.mktemp("alone")
    done: dict = {}

    def run(method: str) -> dict:
        if method not in done:
            out = root / method
            options = {**DROP_RUN, "data": str(data), "out": str(out)}
            kd.train(kd_config.resolve(recipe=recipe(root, method), options=options))
            done[method] = last_checkpoint(out)
        return done[method]

    return run


@pytest.mark.parametrize(
    "methods",
    [
        "kd,ttm,wttm,luminet",  # logit methods on the first view's logits
        "kd,crld",  # a one-view student in a run whose loaders make the strong view and whose teacher forwards it
        "kd,sdkd,sddkd,sdnkd",  # the final map and classifier of each side, tapped for each SDD student
    ],
)
def test_the_new_rows_together_equal_their_separate_runs_bit_for_bit(data, alone, tmp_path, methods):
    names = methods.split(",")
    recipes = [recipe(tmp_path, method) for method in names]
    launch(TrainJob(multi.plan(recipes, {**DROP_RUN, "data": str(data), "out": str(tmp_path / "table")}, [])))
    for method in names:
        together, separate = last_checkpoint(tmp_path / "table" / method), alone(method)
        assert together["global_step"] == separate["global_step"] == 3, method
        for part in ("student", "loss"):
            assert together[part].keys() == separate[part].keys(), (method, part)
            for key, value in separate[part].items():
                assert torch.equal(together[part][key], value), (method, part, key)
        assert torch.equal(together["rng"]["0"]["torch"], separate["rng"]["0"]["torch"]), method  # its own masks
