"""A newcomer's second hour (issue 34): a run ends with a line saying where its result is, --resume
says when there is nothing to do, a kd checkpoint names the teacher's model."""

from __future__ import annotations

import re

import pytest
from conftest import kd_main, make_image_folder

TINY = ["--image-size", 32, "-b", 8, "-j", 0, "--device", "cpu", "--epochs", 1, "--no-progress"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("second_hour"))


@pytest.fixture(scope="module")
def teacher_run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher") / "run"
    r = kd_main("train", "--data", data, "--no-teacher", "--student", "timm:resnet10t", *TINY, "--out", out)
    assert r.returncode == 0, r.stderr
    return r, out


def test_a_run_ends_with_where_its_result_is(teacher_run):
    r, out = teacher_run
    line = r.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"done: best top-1 \d+\.\d\d at epoch 1, last top-1 \d+\.\d\d at epoch 1 \(\d+ val images, 0 unreadable\), "
        rf"\d+s; run {re.escape(str(out))}, "
        rf"best checkpoint {re.escape(str(out / 'checkpoints' / 'best.pt'))}",
        line,
    ), r.stdout


def test_several_students_end_with_a_line_each(data, tmp_path):
    out = tmp_path / "table"
    args = ["--teacher", "timm:resnet10t", "--teacher-weights", "none", "--student", "timm:resnet10t"]
    r = kd_main("train", "--data", data, *args, "--kd-loss", "kd,dkd", *TINY, "--limit-train-batches", 1, "--out", out)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()[-2:]
    assert lines[0].startswith("[kd] done: best top-1 ") and lines[0].endswith(
        f"{out / 'kd' / 'checkpoints' / 'best.pt'}"
    )
    assert lines[1].startswith("[dkd] done: best top-1 ") and str(out / "dkd") in lines[1]


def test_resume_where_nothing_was_run_says_so(tmp_path):
    r = kd_main("train", "--out", tmp_path / "empty", "--resume")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"kd: error: nothing to resume: {tmp_path / 'empty' / 'checkpoints' / 'last.pt'} does not exist "
        f"({tmp_path / 'empty'} holds no run; start it without --resume)"
    ], r.stderr


def test_resume_of_a_finished_run_says_how_to_continue(teacher_run):
    _, out = teacher_run
    r = kd_main("train", "--out", out, "--resume")
    assert r.returncode == 0 and r.stderr.strip().splitlines() == [
        f"kd: {out} already finished (1 epochs); raise --epochs to continue"
    ], r.stderr
    assert r.stdout == ""


def test_a_kd_checkpoint_as_teacher_names_its_model(data, teacher_run, tmp_path):
    _, teacher = teacher_run
    ckpt = teacher / "checkpoints" / "best.pt"
    r = kd_main(
        "train", "--data", data, "--teacher-weights", ckpt, "--student", "resnet18", *TINY, "--out", tmp_path / "s"
    )
    assert r.returncode == 0, r.stderr
    assert "teacher timm:resnet10t: runs in" in r.stderr
    r = kd_main("train", "--data", data, "--student", "resnet18", *TINY, "--out", tmp_path / "t")
    assert r.returncode == 2 and "--teacher is required" in r.stderr


def test_a_broken_weights_file_is_named_for_what_it_is(data, tmp_path):
    """One complete sentence: random bytes are no PyTorch file (not an unpickling matter), a cut
    archive is damaged, a pickle of objects is refused for what it holds."""
    import os
    import pickle

    import torch

    (tmp_path / "random.pt").write_bytes(os.urandom(4096).replace(b"PK", b"pk").lstrip(b"\x80") or b"x")
    torch.save({"w": torch.ones(8)}, tmp_path / "whole.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "whole.pt").read_bytes()[:300])
    with open(tmp_path / "objects.pt", "wb") as fh:
        pickle.dump({"w": torch.nn.Linear(2, 2)}, fh, protocol=2)
    expected = {
        "random.pt": "it is not a PyTorch file (torch.save writes a zip archive or a pickle, and this file is neither)",
        "cut.pt": "the PyTorch archive is damaged or truncated (RuntimeError); copy or save it again",
        "objects.pt": "it is a pickle of Python objects other than tensors, which would need code to be unpickled, "
        "and kd refuses that (weights_only=True); save the model's state_dict() with torch.save instead",
    }
    for name, why in expected.items():
        path = tmp_path / name
        r = kd_main("train", "--data", data, "--teacher", "resnet18", "--teacher-weights", path, "--student", "resnet18",
                    *TINY, "--out", tmp_path / "out")  # fmt: skip
        lines = [line for line in r.stderr.splitlines() if "Warning" not in line and not line.startswith("  ")]
        assert r.returncode == 2 and lines[-1] == f"kd: error: cannot read weights file {path}: {why}", r.stderr


def test_report_calls_a_run_without_teacher_by_its_method_ce(teacher_run):
    _, out = teacher_run
    r = kd_main("report", out)
    assert r.returncode == 0 and f"| {out} | ce | - | timm:resnet10t |" in r.stdout, r.stdout
    r = kd_main("recipes", "list")
    assert "| imagenet/baseline_r18 | - | resnet18 | ce |" in r.stdout, r.stdout


def test_a_recipes_compile_applies_on_cuda_only_and_says_when_it_starts(data, tmp_path, capfd):
    """Recipes ask for torch.compile on CUDA (``compile: auto``): on the CPU it cost a silent minute
    for little gain. Asked for (--compile), it is used anywhere, and the log says the first step compiles."""

    import torch

    import backends
    from kd import config as kd_config
    from kd.run.loop import Trainer
    from kd.run.students import Students
    from kd.run.runtime import resolve

    cfg = kd_config.resolve(recipe="imagenet/r34_r18_dkd", options={"data": str(data)})
    assert cfg.compile is None
    assert not resolve(cfg, torch.device("cpu")).compile and resolve(cfg, torch.device("cuda")).compile
    forced = kd_config.resolve(recipe="imagenet/r34_r18_dkd", options={"data": str(data), "compile": True})
    assert resolve(forced, torch.device("cpu")).compile
    tiny = dict(
        data=str(data), out=str(tmp_path / "c"), no_teacher=True, student="resnet18", image_size=32, batch_size=8,
        workers=0, device="cpu", compile=True, progress_bar=False,
    )  # fmt: skip
    cfg = kd_config.resolve(options=tiny)
    backend = backends.get("single")(cfg)
    backend.setup()
    Trainer(Students.alone(cfg), backend).close()  # torch.compile is lazy: nothing compiles before a step
    assert "torch.compile (default): the first step compiles the student (a minute or more)" in capfd.readouterr().err


def test_figures_are_part_of_the_plain_install():
    import configparser

    from conftest import ROOT

    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    assert "matplotlib>=3.5" in setup["options"]["install_requires"].split()


def test_report_plot_tells_runs_apart_and_draws_what_its_title_says(tmp_path, monkeypatch):
    """Two runs named kd in two folders get labels a/kd and b/kd (the legend had shown kd twice);
    without a recipe reference the title does not promise dashed lines."""
    import json

    import matplotlib.pyplot as plt

    from kd.commands import report

    runs = []
    for parent in ("a", "b"):
        run = tmp_path / parent / "kd"
        run.mkdir(parents=True)
        (run / "config.yaml").write_text("kd_loss: kd\n")
        rows = [{"epoch": e, "val_top1": 50 + e, "val_top5": 90, "train_loss": 2 - e / 3} for e in (1, 2)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(run)
    figures = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    report.plot(runs, tmp_path / "fig.png")
    top1 = figures[-1].axes[0]
    assert [t.get_text() for t in top1.get_legend().get_texts()] == ["a/kd", "b/kd"]
    assert top1.get_title() == "validation top-1"


def test_report_without_matplotlib_prints_the_table_first(teacher_run, tmp_path, no_matplotlib):
    _, out = teacher_run
    r = kd_main("report", out, "--plot", tmp_path / "fig.png")
    assert r.returncode == 2 and f"| {out} | ce |" in r.stdout, (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == [
        "kd: error: matplotlib is not installed, and kd draws its figures with it: pip install matplotlib "
        "(a dependency of kd: pip install -e . in this clone installs it too)"
    ]
