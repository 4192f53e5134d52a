"""Each choice made by name has one list of names, which config validation and the command line
read: a loader registered in one place is accepted everywhere, and an unknown name gets the
registry's one line with the near names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HANG_GUARD, kd_main

from kd import config as kd_config
from kd.data.registry import LOADERS, check_loader, loader_choices
from kd.errors import KDError

ROOT = Path(__file__).resolve().parent.parent


def make_throwaway_loader(cfg, samples, train, shard, every_sample=False, views=1):
    raise AssertionError("never built: only its name is used")


@pytest.fixture
def throwaway_loader(monkeypatch):
    """A loader registered in this process for one test (the registry is as it was afterwards)."""
    monkeypatch.setattr(LOADERS, "_items", dict(LOADERS._items))
    LOADERS.register("throwaway")(make_throwaway_loader)
    return "throwaway"


def synthetic(**options):
    return kd_config.resolve(options=dict(data="synthetic", student="resnet18", no_teacher=True, **options))


def test_a_registered_loader_is_accepted_by_config_validation_and_the_cli(throwaway_loader):
    from cli import bench, bench_data_cmd

    assert synthetic(loader=throwaway_loader).loader == throwaway_loader
    assert loader_choices() == ["auto", "gpu", "pil", throwaway_loader]
    assert LOADERS.get(throwaway_loader) is make_throwaway_loader
    assert bench.make_context("bench", ["--loader", throwaway_loader]).params["loader"] == throwaway_loader
    ctx = bench_data_cmd.make_context("data", ["--data", "DIR", "--loader", throwaway_loader])
    assert ctx.params["loader"] == throwaway_loader
    help_text = bench_data_cmd.get_help(ctx)
    assert "[auto|gpu|pil|throwaway]" in help_text
    train_help = kd_main("train", "--help").stdout
    assert "Input pipeline: auto, gpu, pil, throwaway" in " ".join(train_help.split())


def test_an_unknown_loader_is_the_registrys_one_line_with_near_names(throwaway_loader):
    line = "unknown loader 'throwawy' (did you mean throwaway?); choose from: auto, gpu, pil, throwaway"
    with pytest.raises(KDError) as caught:
        synthetic(loader="throwawy")
    assert str(caught.value) == line
    for args in (["train", "--data", "synthetic", "--student", "resnet18", "--no-teacher"], ["bench"]):
        r = kd_main(*args, "--loader", "throwawy")
        assert (r.returncode, r.stderr) == (2, f"kd: error: {line}\n"), args
    assert check_loader("auto") == "auto"


def test_the_loaders_names_are_known_without_torch():
    """Validation and the command line's choices read the names; the loaders' modules (torch,
    torchvision, the GPU pipeline) are imported only when a loader is made."""
    code = (
        "import sys, cli; from kd import config; from kd.data.registry import check_loader, loader_choices; "
        "check_loader('gpu'); print(loader_choices(), 'torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD)
    assert r.stdout.split("]")[-1].strip() == "False", r.stdout + r.stderr


def test_config_names_match_the_modules_that_act_on_them():
    """A name validated in kd.config and mapped to its mechanics in a lower module (which kd.config
    does not import: torch) is the same list in both."""
    from kd import precision
    from kd.data import data_config, prepared, prepared_writer
    from kd.teacher import precision as teacher_precision
    from kd.teacher import store

    assert kd_config.OPT_LEVELS == tuple(precision.NATIVE)
    assert kd_config.AMP_DTYPES == tuple(precision.DTYPES)
    assert kd_config.TEACHER_PRECISIONS == ("auto", *teacher_precision.DTYPES)
    assert kd_config.SOFT_LABEL_DTYPES == ("auto", *store.DTYPES)
    assert kd_config.INTERPOLATIONS == data_config.INTERPOLATIONS
    assert set(prepared_writer.TRAIN_FORMATS) <= set(prepared.FORMATS)  # (the index codes, val images' too)
