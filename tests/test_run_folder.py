"""A run folder continues exactly or says why in one line: copied, moved, stopped, edited, or
resumed with other options (kd/run/resume.py, kd/run/students.py, kd/runfolder.py).

Each test works on a copy of one of two finished tiny runs (a single student, and two students
of one teacher), so the runs train once for the file."""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import kd_main, make_image_folder, run_kd, start_kd

TINY = ["--teacher", "timm:test_resnet", "--teacher-weights", "none", "--student", "timm:test_resnet"]
TINY += ["--image-size", "32", "-b", "8", "--device", "cpu", "--workers", "0", "--opt", "O0", "--no-compile"]


def train(data, out, *extra):
    return kd_main("train", "--data", data, *TINY, "--out", out, *extra)


def one_line_error(r, *words):
    """Exit 2, one line on stderr, no traceback, holding each of ``words``."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def files(folder: Path) -> dict:
    """Every file below ``folder`` and its bytes: what a refusal must leave as it was."""
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("data"), classes=3, train_per_class=8, val_per_class=4)


@pytest.fixture(scope="module")
def single(tmp_path_factory, data):
    out = tmp_path_factory.mktemp("single") / "run"
    r = train(data, out, "--epochs", "1", "--lr", "0.05")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def grouped(tmp_path_factory, data):
    out = tmp_path_factory.mktemp("grouped") / "run"
    r = train(data, out, "--kd-loss", "kd,ctkd", "--epochs", "1")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture
def copy_of(tmp_path):
    def copy(run: Path) -> Path:
        target = tmp_path / "copy"
        shutil.copytree(run, target)
        return target

    return copy


def epoch_of(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["epoch"])


# ----------------------------------------------------------------------------- several students
def test_a_stopped_several_students_run_keeps_its_list_and_resumes(tmp_path, data):
    """SIGTERM on a fresh several-students run once a checkpoint is written: students.yaml stays,
    and the resume the stop printed continues every student."""
    out = tmp_path / "run"
    args = ["train", "--data", data, *TINY, "--out", out, "--kd-loss", "kd,ctkd", "--epochs", "2"]
    proc = start_kd(*args, "--save-every-steps", "1", "--no-progress")
    deadline = time.time() + 600
    while not (out / "ctkd" / "checkpoints" / "last.pt").is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode != 0 and "--resume" in err, err
    assert (out / "students.yaml").is_file(), err
    r = kd_main("train", "--out", out, "--resume")
    assert r.returncode == 0, r.stderr
    assert all(epoch_of(out / s / "checkpoints" / "last.pt") == 2 for s in ("kd", "ctkd"))


def test_a_moved_several_students_run_resumes_in_its_new_folder(grouped, tmp_path):
    """A copy resumes from its own checkpoints, with its first folder gone (``mv``): nothing names it."""
    moved = tmp_path / "moved"
    shutil.copytree(grouped, moved)
    away = grouped.with_name("away")
    grouped.rename(away)  # the folder it was copied from is gone while the copy resumes
    try:
        r = kd_main("train", "--out", moved, "--resume", "--epochs", "2")
    finally:
        away.rename(grouped)
    assert r.returncode == 0, r.stderr
    assert str(grouped) not in r.stdout + r.stderr
    assert [epoch_of(moved / s / "checkpoints" / "last.pt") for s in ("kd", "ctkd")] == [2, 2]
    assert epoch_of(grouped / "kd" / "checkpoints" / "last.pt") == 1  # the original untouched


@pytest.mark.parametrize(
    "damage, words",
    [
        ("students:\n- kd\n", ["students.yaml", "ctkd"]),  # cut to its first student
        ("", ["students.yaml"]),
        ("students: [kd\n\x00", ["students.yaml"]),  # not YAML
        ("students: 3\n", ["students.yaml"]),
    ],
    ids=["cut", "empty", "not yaml", "wrong shape"],
)
def test_a_damaged_students_list_is_one_line(grouped, copy_of, damage, words):
    run = copy_of(grouped)
    (run / "students.yaml").write_text(damage)
    before = files(run)
    one_line_error(kd_main("train", "--out", run, "--resume", "--epochs", "2"), *words)
    assert files(run) == before


# ----------------------------------------------------------------------------- what a resume may change
def test_the_config_that_resumes_is_the_one_that_ran(single, copy_of):
    """config.yaml edited (one value) or cut is refused in one line naming what differs; deleted,
    it is written again from the checkpoint and the run resumes."""
    run = copy_of(single)
    saved = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(saved.replace("seed: 0", "seed: 1"))
    before = files(run)
    one_line_error(kd_main("train", "--out", run, "--resume", "--epochs", "2"), "config.yaml", "seed")
    assert files(run) == before
    (run / "config.yaml").write_text(saved[: saved.index("kd_loss:") + len("kd_loss:")])
    one_line_error(kd_main("train", "--out", run, "--resume", "--epochs", "2"), "config.yaml")
    (run / "config.yaml").unlink()
    r = kd_main("train", "--out", run, "--resume", "--epochs", "2")
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load((run / "config.yaml").read_text())["lr"] == 0.05
    assert epoch_of(run / "checkpoints" / "last.pt") == 2


@pytest.mark.parametrize(
    "option, words",
    [
        (["--lr", "0.5"], ["--lr", "0.05"]),
        (["-b", "16"], ["--batch-size", "8"]),
        (["--seed", "3"], ["--seed"]),
        (["--temperature", "2"], ["--temperature 2", "(run: 4)"]),  # the run left it to KD's default 4
    ],
    ids=["lr", "batch", "seed", "temperature"],
)
def test_a_resume_refuses_what_would_change_the_run(single, copy_of, option, words):
    run = copy_of(single)
    before = files(run)
    one_line_error(kd_main("train", "--out", run, "--resume", "--epochs", "2", *option), *words)
    assert files(run) == before


@pytest.mark.parametrize("option", [{"teacher_weights": "none"}, {"teacher": "resnet50"}])
def test_a_resume_of_a_run_without_a_teacher_says_it_had_none(option):
    """A teacher option given to the resume of a --no-teacher run: the run's side of the refusal is no
    teacher, not the defaults it never used (pretrained, auto)."""
    from kd import config as kd_config
    from kd.errors import KDError
    from kd.run.resume import continued

    ran = kd_config.resolve(options=dict(data="synthetic", student="resnet18", no_teacher=True, out="/tmp/r"))
    with pytest.raises(KDError, match=r"cannot change --teacher[-a-z]* \S+ \(run: no teacher, --no-teacher\); "):
        continued(ran, option, [])


def test_a_resume_takes_the_same_values_and_what_may_change(single, copy_of, data):
    """The options of the run again (the same command with --resume) and the machine's (--workers,
    --no-progress, --data at another path) are taken; --epochs extends the run."""
    run = copy_of(single)
    moved = data.parent / "moved-data"
    if not moved.exists():
        shutil.copytree(data, moved)
    again = ["--lr", "0.05", "--temperature", "4"]  # the method's default 4, which the run left to it
    r = kd_main("train", "--data", moved, *TINY, "--out", run, *again, "--resume", "--epochs", "2")
    assert r.returncode == 0, r.stderr
    assert epoch_of(run / "checkpoints" / "last.pt") == 2
    assert yaml.safe_load((run / "config.yaml").read_text())["data"] == str(moved)


def test_a_moved_teacher_file_is_taken_and_another_refused(single, data, tmp_path):
    """--teacher-weights at another path on --resume: the same bytes (the file moved) are taken,
    another file is refused naming the option."""
    moved, other = tmp_path / "moved.pt", tmp_path / "other.pt"
    first = tmp_path / "teacher.pt"
    shutil.copy(single / "checkpoints" / "last.pt", first)
    run = tmp_path / "run"
    args = ["--data", data, "--student", "timm:test_resnet", "--image-size", "32", "-b", "8", "--device", "cpu"]
    args += ["--workers", "0", "--out", run]
    assert kd_main("train", *args, "--teacher-weights", first, "--epochs", "1").returncode == 0
    shutil.copy(first, other)
    with open(other, "ab") as fh:
        fh.write(b"\0")  # other bytes
    first.rename(moved)
    one_line_error(
        kd_main("train", *args, "--teacher-weights", other, "--epochs", "2", "--resume"), "--teacher-weights"
    )
    r = kd_main("train", *args, "--teacher-weights", moved, "--epochs", "2", "--resume")
    assert r.returncode == 0, r.stderr
    assert epoch_of(run / "checkpoints" / "last.pt") == 2


# ----------------------------------------------------------------------------- best.pt, class names
def test_a_best_checkpoint_older_than_the_best_epoch_is_found_and_repaired(single, copy_of, data):
    """The state a kill between last.pt's write and best.pt's copy leaves: last.pt says its own
    epoch is the best, best.pt holds an earlier one. kd verify names it; the resume repairs it."""
    from kd.utils.checkpoint_io import copy_atomic, save_atomic

    run = copy_of(single)
    ckpt = run / "checkpoints"
    copy_atomic(ckpt / "last.pt", ckpt / "epoch1.pt")
    r = kd_main("train", "--out", run, "--resume", "--epochs", "2")
    assert r.returncode == 0, r.stderr
    state = torch.load(ckpt / "last.pt", map_location="cpu", weights_only=True)
    state["best_top1"], state["best_epoch"] = 100.0, 2  # epoch 2 the best, as last.pt records it
    save_atomic(state, ckpt / "last.pt")
    copy_atomic(ckpt / "epoch1.pt", ckpt / "best.pt")  # ... but best.pt still epoch 1's
    (ckpt / "epoch1.pt").unlink()
    (ckpt / "epoch1.pt.sha256").unlink()
    v = kd_main("verify", run)
    assert v.returncode != 0 and "best.pt" in v.stdout + v.stderr and "STALE" in v.stdout + v.stderr, v.stdout
    r = kd_main("train", "--out", run, "--resume", "--epochs", "2")
    assert r.returncode == 0 and "best.pt" in r.stderr, r.stderr
    assert epoch_of(ckpt / "best.pt") == 2
    assert kd_main("verify", run).returncode == 0


def test_class_names_other_than_the_checkpoints_are_refused(single, copy_of, data, tmp_path):
    """A val (or train) folder whose class names differ from the run's: kd eval, --resume and a kd
    checkpoint as the teacher's weights each refuse it in one line naming the classes."""
    other = tmp_path / "renamed"
    shutil.copytree(data, other)
    for split in ("train", "val"):
        (other / split / "class_00").rename(other / split / "class_09")
    run = copy_of(single)
    last = run / "checkpoints" / "last.pt"
    one_line_error(kd_main("eval", "--data", other, "--weights", last, "--device", "cpu"), "class_00", "class_09")
    before = files(run)
    one_line_error(kd_main("train", "--data", other, "--out", run, "--resume", "--epochs", "2"), "class_00")
    assert files(run) == before
    student = tmp_path / "student"  # a student of a kd-trained teacher, resumed on the renamed data: its own
    args = ["--data", data, "--teacher-weights", last, *TINY[4:], "--epochs", "1", "--out", student]
    assert kd_main("train", *args).returncode == 0
    r = kd_main("train", "--data", other, "--out", student, "--resume", "--epochs", "2")
    assert str(student / "checkpoints" / "last.pt") in one_line_error(r, "class_00"), r.stderr
    r = kd_main(
        "train", "--data", other, "--teacher-weights", last, "--student", "timm:test_resnet",
        "--image-size", "32", "-b", "8", "--device", "cpu", "--workers", "0", "--out", tmp_path / "t",
    )  # fmt: skip
    one_line_error(r, "class_00", "class_09")
    assert not (tmp_path / "t").exists()


def test_the_cli_help_says_what_a_resume_may_change():
    r = run_kd("train", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "--epochs" in text and "refused" in text


def test_a_resume_that_extended_the_run_and_stopped_before_a_checkpoint_resumes_again(single, copy_of):
    """A resume writes config.yaml with what it changed (--epochs 3); stopped before its next
    checkpoint, the next resume keeps that choice and is not refused for it."""
    run = copy_of(single)
    saved = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(saved.replace("epochs: 1\n", "epochs: 3\n").replace("workers: 0", "workers: 1"))
    r = kd_main("train", "--out", run, "--resume", "--workers", "0")
    assert r.returncode == 0, r.stderr
    assert epoch_of(run / "checkpoints" / "last.pt") == 3


def test_the_same_recipe_command_again_resumes(data, tmp_path):
    """kd train --recipe R --epochs N, then the same command with --resume (and more epochs): the
    recipe is the run's own, its schedule as the run scaled it, not laid over the run again."""
    recipe = tmp_path / "small.yaml"
    recipe.write_text("epochs: 100\nlr: 0.05\nlr_schedule: step\nlr_milestones: [30, 60, 90]\nbatch_size: 8\n")
    run = tmp_path / "run"
    args = ["--recipe", recipe, "--data", data, *TINY, "--out", run]
    assert kd_main("train", *args, "--epochs", "1").returncode == 0
    r = kd_main("train", *args, "--epochs", "2", "--resume")
    assert r.returncode == 0, r.stderr
    assert epoch_of(run / "checkpoints" / "last.pt") == 2
    other = tmp_path / "other.yaml"
    other.write_text(recipe.read_text())
    one_line_error(kd_main("train", *args[2:], "--recipe", other, "--epochs", "2", "--resume"), "--recipe")


def test_a_damaged_last_checkpoint_does_not_block_the_resume_from_a_step_checkpoint(data, tmp_path):
    """kd verify points at a step checkpoint where last.pt is damaged; that resume goes on."""
    run = tmp_path / "run"
    args = ["--data", data, *TINY, "--out", run, "--save-every-steps", "2", "--keep-last", "9"]
    assert kd_main("train", *args, "--epochs", "1").returncode == 0
    last = run / "checkpoints" / "last.pt"
    last.write_bytes(last.read_bytes()[:1000])
    r = kd_main("train", *args, "--epochs", "1", "--resume", run / "checkpoints" / "step_00000002.pt")
    assert r.returncode == 0, r.stderr
    assert epoch_of(last) == 1
