"""One entry for a run (kd.run.students.for_command, kd.run.jobs): resume is resolved once, so
``kd.train`` from Python and ``kd train`` on the command line continue a run alike."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from conftest import kd_main, make_image_folder

import kd
from kd.errors import KDError
from kd.run.jobs import TeachJob, TrainJob
from kd.run.students import Students, for_command

OPTIONS = dict(
    teacher="timm:resnet10t",
    teacher_weights="none",
    student="timm:resnet10t",
    image_size=32,
    batch_size=4,
    workers=0,
    device="cpu",
    lr=0.05,
    limit_train_batches=2,
    progress_bar=False,
)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("jobs"), classes=2, train_per_class=4, val_per_class=2)


def epochs(out: Path):
    return [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_kd_train_resumes_from_python_as_the_command_line_does(data, tmp_path, capsys):
    """The dict of options of a resume is applied to the run's saved config (no data or models
    given again), as ``kd train --out OUT --resume --epochs 2`` does; a finished run says so and
    trains nothing."""
    out = tmp_path / "run"
    kd.train({**OPTIONS, "data": str(data), "out": str(out), "epochs": 1})
    record = kd.train({"out": str(out), "epochs": 2}, resume="last")
    assert record["epoch"] == 2 and epochs(out) == [1, 2]
    capsys.readouterr()
    assert kd.train({"out": str(out), "epochs": 2}, resume="last") == {}
    assert capsys.readouterr().err.strip() == f"kd: {out} already finished (2 epochs); raise --epochs to continue"
    r = kd_main("train", "--out", out, "--resume", "--epochs", 3)
    assert r.returncode == 0, r.stderr
    assert epochs(out) == [1, 2, 3]


def test_resume_and_overwrite_contradict_from_python_too(data, tmp_path):
    with pytest.raises(KDError, match="--resume and --overwrite contradict each other"):
        kd.train({**OPTIONS, "data": str(data), "out": str(tmp_path / "r")}, resume="last", overwrite=True)
    with pytest.raises(KDError, match="nothing to resume: .* does not exist"):
        kd.train({**OPTIONS, "data": str(data), "out": str(tmp_path / "r")}, resume="last")


def test_the_students_of_a_command(data, tmp_path):
    """One student alone is its run folder; a comma list of methods plans one student each below
    --out; each names the checkpoint it continues from only when resuming."""
    alone = for_command([], {**OPTIONS, "data": str(data), "out": str(tmp_path / "a")})
    assert alone.names == ("a",) and not alone.grouped and not alone.resuming
    assert alone.folders() == [tmp_path / "a"]
    several = for_command([], {**OPTIONS, "data": str(data), "out": str(tmp_path / "t"), "kd_loss": "kd,dkd"})
    assert several.names == ("kd", "dkd") and several.grouped
    assert several.folders() == [tmp_path / "t", tmp_path / "t" / "kd", tmp_path / "t" / "dkd"]
    assert [c.kd_loss for c in several.cfgs] == ["kd", "dkd"]


def test_jobs_travel_to_spawned_processes(data, tmp_path):
    """kd's launcher hands each process its job by pickle (torch's elastic launcher spawns them)."""
    cfg = for_command([], {**OPTIONS, "data": str(data), "out": str(tmp_path / "a")}).first
    for job in (TrainJob(Students.alone(cfg), timed_after=3), TeachJob(cfg)):
        again = pickle.loads(pickle.dumps(job))
        assert again == job and again.cfg == cfg
