"""The 2024 rows (ttm, wttm, luminet, crld, sdkd / sddkd / sdnkd) as students of one run, on one teacher
forward per view: each bit for bit its separate run on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from conftest import make_image_folder
from torch import nn

import kd
from kd import config as kd_config
from kd.run import students as multi
from kd.run.jobs import TrainJob
from kd.run.launch import train as launch


class PooledDropNet(nn.Module):
    """A BatchNorm, a global pool (SDD reads its input) and a dropout before the linear classifier:
    a student whose step draws random masks, as real ones do."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.global_pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Sequential(nn.Dropout(0.3), nn.Linear(8, num_classes))

    def get_classifier(self) -> nn.Module:
        return self.fc

    def forward(self, x):
        return self.fc(self.global_pool(self.body(x)))


def _register():
    import timm
    from timm.models import register_model

    if "kd_pooled_drop_net" not in timm.list_models():

        @register_model
        def kd_pooled_drop_net(pretrained=False, num_classes=10, **kwargs):
            return PooledDropNet(num_classes)


_register()

TINY = dict(
    image_size=16,
    batch_size=4,
    workers=0,
    lr=0.05,
    device="cpu",
    log_every=1,
    seed=5,
    epochs=1,
    limit_train_batches=3,
    limit_val_batches=1,
    progress_bar=False,
    teacher="timm:kd_pooled_drop_net",
    teacher_weights="none",
    student="timm:kd_pooled_drop_net",
)


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
            options = {**TINY, "data": str(data), "out": str(out)}
            kd.train(kd_config.resolve(recipe=recipe(root, method), options=options))
            done[method] = state(out)
        return done[method]

    return run


def state(out: Path) -> dict:
    return torch.load(out / "checkpoints" / "last.pt", weights_only=True)


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
    launch(TrainJob(multi.plan(recipes, {**TINY, "data": str(data), "out": str(tmp_path / "table")}, [])))
    for method in names:
        together, separate = state(tmp_path / "table" / method), alone(method)
        assert together["global_step"] == separate["global_step"] == 3, method
        for part in ("student", "loss"):
            assert together[part].keys() == separate[part].keys(), (method, part)
            for key, value in separate[part].items():
                assert torch.equal(together[part][key], value), (method, part, key)
        assert torch.equal(together["rng"]["0"]["torch"], separate["rng"]["0"]["torch"]), method  # its own masks
