"""kd demo (kd.commands.demo): stopped, it continues where it stopped when run again; its folder
is a demo's or refused; its help tells the epochs it trains."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from conftest import ROOT, kd_main, one_error_line

from kd.commands import demo


def test_demo_help_tells_the_epochs_it_trains():
    r = kd_main("demo", "--help")
    assert f"[teacher {demo.TEACHER_EPOCHS}, students {demo.STUDENT_EPOCHS}]" in " ".join(r.stdout.split()), r.stdout


def test_a_folder_that_holds_no_demo_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("not a demo")
    line = one_error_line(kd_main("demo", "--out", tmp_path, "--epochs", 1))
    assert f"{tmp_path} is not empty and holds no kd demo; pass --overwrite" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_demo_out_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    line = one_error_line(kd_main("demo", "--out", tmp_path / "a_file" / "demo", "--epochs", 1))
    assert f"cannot write {tmp_path / 'a_file' / 'demo'}: not a directory; " in line, line
    assert line.endswith(f"then run kd demo --out {tmp_path / 'a_file' / 'demo'} --epochs 1 again"), line


def test_a_demo_of_other_epochs_is_refused_and_overwrite_starts_over(tmp_path):
    out = tmp_path / "demo"
    out.mkdir()
    (out / demo.DEMO_FILE).write_text(json.dumps({"epochs": 2, "finished": ["teacher"]}))
    (out / "teacher").mkdir()
    line = one_error_line(kd_main("demo", "--out", out, "--epochs", 1))
    assert f"continue it with kd demo --out {out} --epochs 2, or pass --overwrite" in line, line
    assert demo.demo_state(out, 1, overwrite=True) == {"epochs": 1, "finished": []}
    assert sorted(p.name for p in out.iterdir()) == [demo.DEMO_FILE]


@pytest.mark.slow
def test_a_stopped_demo_continues_where_it_stopped(tmp_path):
    """Ctrl-C once the teacher has trained: the line says to run kd demo again; run again, the demo
    keeps the teacher (not trained again) and ends with its table."""
    out = tmp_path / "demo"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "demo", "--out", str(out), "--epochs", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("== kd demo: student =="):
            proc.send_signal(signal.SIGINT)
            break
    rest, _ = proc.communicate(timeout=600)
    said = "".join(seen) + rest
    assert proc.returncode == 130, said
    assert f"continue with: kd demo --out {out} --epochs 1" in said and "kd train" not in said, said
    teacher = (out / "teacher" / "metrics.jsonl").read_text()
    assert json.loads((out / demo.DEMO_FILE).read_text()) == {"epochs": 1, "finished": ["teacher"]}

    r = kd_main("demo", "--out", out, "--epochs", 1)
    assert r.returncode == 0, r.stderr
    assert "== kd demo: teacher" not in r.stdout and "== kd demo: student_kd ==" in r.stdout, r.stdout
    # each run's start says how long the rest will take: first as on an idle machine, then at this one's pace
    assert re.search(r"kd demo: run 2 of 3, about \S+ left on 2 idle cores", r.stdout), r.stdout
    assert re.search(r"kd demo: run 3 of 3, about \S+ left at this machine's pace", r.stdout), r.stdout
    assert "KD's gain over the student alone: " in r.stdout and "| teacher resnet18" in r.stdout, r.stdout
    assert "student timm:resnet10t with KD from the teacher, the same 200" in r.stdout, r.stdout
    for name in ("teacher", "student", "student_kd"):
        assert (out / name / "metrics.jsonl").is_file()
    assert (out / "teacher" / "metrics.jsonl").read_text() == teacher
    for name in demo.RUNS:
        assert (out / name / "checkpoints" / "best.pt").is_file()
        assert not (out / name / "checkpoints" / "last.pt").exists()
    r = kd_main("demo", "--out", out, "--epochs", 1)  # finished: the table again, nothing trained
    assert r.returncode == 0 and "== kd demo:" not in r.stdout and "KD's gain" in r.stdout, r.stdout


def test_a_run_stopped_mid_way_resumes_from_its_last_checkpoint(tmp_path, monkeypatch):
    """A demo whose teacher was stopped after its checkpoint: kd demo resumes it from last.pt,
    not from the start."""
    from kd.run import launch

    out = tmp_path / "demo"
    calls = []
    monkeypatch.setattr(launch, "train", lambda job, overwrite=False: calls.append((job, overwrite)))
    (out / "teacher" / "checkpoints").mkdir(parents=True)
    (out / "teacher" / "checkpoints" / "last.pt").write_bytes(b"")
    (out / demo.DEMO_FILE).write_text(json.dumps({"epochs": 1, "finished": []}))
    with pytest.raises(ValueError, match="empty"):  # the fake train wrote no metrics: no best epoch to read
        demo.run_demo(out, epochs=1)
    ((job, overwrite),) = calls
    assert job.students.resume == (out / "teacher" / "checkpoints" / "last.pt",) and not overwrite
