"""kd report (kd.commands.report): the table over runs and folders of runs, durations a person reads,
CSV, the figure (and what is said without matplotlib), and the line each kd train ends with."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import HANG_GUARD, ROOT, kd_main, make_image_folder, one_error_line, run_kd, start_kd, train_args

from kd.errors import KDError


#: each duration kd prints (kd.commands.report.duration): 42s, 4.5m, 12m, 3.4h
DURATION = r"\d+s|\d+\.\dm|\d+m|\d+\.\dh"


def test_a_run_ends_with_where_its_result_is(teacher_run):
    """Its time is the one kd report gives the run (the line timed from after the imports: 10 min
    where kd report said 11)."""
    from kd.commands.report import collect

    r, out = teacher_run
    line = r.stdout.strip().splitlines()[-1]
    found = re.fullmatch(
        rf"done: best top-1 \d+\.\d\d at epoch 1, last top-1 \d+\.\d\d at epoch 1 \(\d+ val images, 0 unreadable\), "
        rf"({DURATION}); run {re.escape(str(out))}, "
        rf"best checkpoint {re.escape(str(out / 'checkpoints' / 'best.pt'))}",
        line,
    )
    assert found, r.stdout
    assert found.group(1) == collect(out)["wall_time"], (line, collect(out)["wall_time"])


def test_a_run_without_a_best_checkpoint_names_its_last_as_such(teacher_run, tmp_path):
    """A run continued into a new folder from another run's checkpoint (--out NEW --resume OLD/last.pt) may
    never beat the best top-1 it inherited, so it writes no best.pt: the line names last.pt as the last."""
    from kd.commands.report import summary_line

    _, out = teacher_run
    copy = tmp_path / "fork"
    shutil.copytree(out, copy)
    (copy / "checkpoints" / "best.pt").unlink()
    line = summary_line(copy, 1.0)
    assert line.endswith(f"run {copy}, last checkpoint {copy / 'checkpoints' / 'last.pt'} (no best.pt)"), line


def _wall(run: Path):
    """(the ended parts of ``run``'s wall.jsonl, the seconds of its epochs' training in metrics.jsonl);
    each ended part closes the line its start opened."""
    lines = [json.loads(line) for line in (run / "wall.jsonl").read_text().splitlines()]
    parts = [line for line in lines if not line.get("open")]
    assert [line["started"] for line in lines if line.get("open")] == [p["started"] for p in parts], lines
    epochs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return parts, sum(r["seconds"] for r in epochs)


def test_a_run_times_its_whole_command(teacher_run, image_folder):
    """wall.jsonl times the run from the command's start to its end: more than its epochs' training;
    a command refused on its folder adds no part."""
    _, out = teacher_run
    parts, train = _wall(out)
    assert [p["ended"] for p in parts] == ["finished"] and parts[0]["seconds"] > train > 0, parts
    r = kd_main(*train_args(image_folder, out, no_teacher=True, student="timm:resnet10t"))
    assert r.returncode == 2 and "already holds a run" in r.stderr, r.stderr
    assert _wall(out)[0] == parts
    r = kd_main("report", out, "--csv", out.parent / "report.csv")
    header = next(line for line in r.stdout.splitlines() if line.startswith("| run"))
    assert header.endswith("| wall_time | train_time |"), r.stdout
    row = next(csv_row for csv_row in (out.parent / "report.csv").read_text().splitlines()[1:])
    wall_s, train_s = map(float, row.split(",")[-2:])
    assert wall_s == round(parts[0]["seconds"], 1) and train_s == round(train, 1), row


def test_a_wall_time_that_cannot_be_written_is_said_and_the_run_stands(image_folder, tmp_path):
    """A wall.jsonl that cannot be appended to (a full disk, here a folder in its place) is one
    line on stderr, no traceback; the run's own outcome stays."""
    out = tmp_path / "run"
    r = kd_main(*train_args(image_folder, out, no_teacher=True, student="timm:resnet10t"))
    assert r.returncode == 0, r.stderr
    (out / "wall.jsonl").unlink()
    (out / "wall.jsonl").mkdir()
    r = kd_main("train", "--out", out, "--resume", "--epochs", 2)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert f"kd: this part's wall time is not in {out / 'wall.jsonl'}: Is a directory" in r.stderr, r.stderr


@pytest.mark.slow
def test_a_stopped_and_resumed_run_reports_both_parts(image_folder, tmp_path):
    """Stopped by SIGTERM, then resumed: the report's wall time is the two commands' time (each from
    its process's start), not the epochs' seconds; the resumed run's last line says both."""
    out = tmp_path / "run"
    args = train_args(image_folder, out, no_teacher=True, student="timm:resnet10t", batch_size=4, epochs=2)
    args += ["--log-every", "1", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "first step done" in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=600)
    first = time.time() - t0
    assert proc.returncode == 143, "".join(seen) + rest
    t0 = time.time()
    r = run_kd("train", "--out", out, "--resume", "--no-progress")
    second = time.time() - t0
    assert r.returncode == 0, r.stderr
    parts, train = _wall(out)
    assert [p["ended"] for p in parts] == ["SIGTERM", "finished"], parts
    assert parts[0]["seconds"] <= first and parts[1]["seconds"] <= second, (parts, first, second)
    wall = sum(p["seconds"] for p in parts)
    assert wall > train, (wall, train)
    assert re.search(r", \d+(\.\d)?[sm] \(\d+(\.\d)?[sm] in all, 2 parts\); run ", r.stdout), r.stdout
    from kd.commands.report import report

    rows = report([out])
    assert rows[0]["wall_s"] == round(wall, 1) and rows[0]["train_s"] == round(train, 1), rows


def test_a_line_cut_by_a_kill_is_dropped_and_damage_is_one_line(teacher_run, tmp_path):
    """A kill mid-write leaves metrics.jsonl's last line cut short: kd report reads the run and
    --resume drops the line and goes on. A line elsewhere that is not JSON, or bytes that are not
    UTF-8 (in metrics.jsonl or config.yaml), are one line naming the file, for report and resume;
    so is a run file that cannot be written at the resume's start (a folder in its place)."""
    run = tmp_path / "run"
    shutil.copytree(teacher_run[1], run)
    metrics = run / "metrics.jsonl"
    with open(metrics, "a", encoding="utf-8") as fh:
        fh.write('{"epoch": 2, "train_lo')
    assert kd_main("report", run).returncode == 0
    r = kd_main("train", "--out", run, "--resume", "--epochs", 2)
    assert r.returncode == 0, r.stderr
    lines = metrics.read_text(encoding="utf-8").splitlines(keepends=True)
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2] and lines[-1].endswith("\n"), lines
    clean, config = metrics.read_bytes(), (run / "config.yaml").read_bytes()
    for damaged, content, expected in [
        (metrics, clean.replace(b"\n", b"\n{not json\n", 1), f"{metrics} is damaged: line 2 is not a JSON record"),
        (metrics, clean.replace(b"\n", b"\n\xff\xfe\n", 1), f"{metrics} is damaged: line 2 is not UTF-8 text"),
        (run / "config.yaml", config + b"# \xff\n", f"saved config {run / 'config.yaml'} is damaged: it is not UTF-8"),
    ]:
        damaged.write_bytes(content)
        assert expected in one_error_line(kd_main("report", run))
        if damaged == metrics:
            assert expected in one_error_line(kd_main("train", "--out", run, "--resume", "--epochs", 3))
        damaged.write_bytes(clean if damaged == metrics else config)
    (run / "provenance.json").unlink()
    (run / "provenance.json").mkdir()
    r = kd_main("train", "--out", run, "--resume", "--epochs", 3)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"kd: error: cannot write {run / 'provenance.json'}: is a directory; "), line


def test_a_run_log_that_cannot_be_written_is_one_line(tmp_path):
    """metrics.jsonl and tb/ where no file can be written (root writes through permission bits: a
    folder where the file goes, a file where the folder goes) stop the run in one line naming
    the file and what to do (kd.run.log.RunLogger)."""
    from kd.run.log import RunLogger

    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(KDError) as caught:
        RunLogger(tmp_path).epoch({"epoch": 1, "train_loss": 1.0})
    assert str(caught.value).startswith(f"cannot write {tmp_path / 'metrics.jsonl'}: is a directory; a folder"), caught
    assert str(caught.value).endswith("then continue with --resume"), caught
    (tmp_path / "tb").write_text("")
    with pytest.raises(KDError, match=f"^cannot write {tmp_path / 'tb'}: file exists; a file stands where a folder"):
        RunLogger(tmp_path).scalars("train", {"loss": 1.0}, 1)


def test_report_outputs_that_cannot_be_written_are_one_line(tmp_path):
    """--csv and --plot where no file can be made (root writes through permission bits: a file as
    their folder) are one line naming the file, the table printed first."""
    run = _fake_run(tmp_path / "a", 60.0, 90.0)
    (tmp_path / "a_file").write_text("")
    for option, target, reason in [("--csv", "x.csv", "not a directory"), ("--plot", "x.png", "file exists")]:
        r = kd_main("report", run, option, tmp_path / "a_file" / target)
        assert r.returncode == 2 and "Traceback" not in r.stderr and "| 60.0 |" in r.stdout, r.stderr
        assert (
            r.stderr.strip()
            .splitlines()[-1]
            .startswith(f"kd: error: cannot write {tmp_path / 'a_file' / target}: {reason}; ")
        ), r.stderr


def _fake_run(folder: Path, top1: float, seconds: float) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("kd_loss: kd\nteacher: resnet34\nstudent: resnet18\nepochs: 1\n")
    (folder / "metrics.jsonl").write_text(
        json.dumps({"epoch": 1, "val_top1": top1, "val_top5": 99.0, "seconds": seconds}) + "\n"
    )
    (folder / "checkpoints").mkdir()
    return folder


def test_duration_a_person_reads():
    from kd.commands.report import duration

    seconds = (0, 42, 270, 720, 3.4 * 3600, 30 * 3600)
    assert [duration(s) for s in seconds] == ["0s", "42s", "4.5m", "12m", "3.4h", "30.0h"]


def test_report_a_folder_of_runs(tmp_path):
    runs = tmp_path / "demo"
    _fake_run(runs / "teacher", 97.1, 125.0)
    _fake_run(runs / "student_kd", 95.3, 720.0)
    make_image_folder(runs / "data", classes=2, train_per_class=1, val_per_class=1)
    (runs / "notes.txt").write_text("a file beside the runs")
    r = kd_main("report", runs)
    assert r.returncode == 0, r.stderr
    body = [line for line in r.stdout.splitlines() if line.startswith(f"| {runs}")]
    assert len(body) == 2, r.stdout
    assert "| 97.1 |" in r.stdout and "| - | 2.1m |" in r.stdout and "| - | 12m |" in r.stdout, r.stdout
    assert "data" in r.stderr and "skipped" in r.stderr, r.stderr
    assert f"{runs / 'teacher'}: wall_time -, no wall.jsonl (a run of an older kd)" in r.stderr, r.stderr
    r = kd_main("report", *sorted(runs.iterdir()))  # the shell's runs/demo/*
    assert r.returncode == 0, r.stderr
    assert len([line for line in r.stdout.splitlines() if line.startswith(f"| {runs}")]) == 2
    assert "skipped" in r.stderr and "notes.txt" in r.stderr


def test_a_run_with_a_moving_average_adds_its_columns_and_one_without_shows_dashes(tmp_path):
    from kd.commands.report import markdown, report, to_csv

    averaged = _fake_run(tmp_path / "ema", 60.0, 90.0)
    epochs = [
        {"epoch": e, "val_top1": 60.0, "val_top5": 99.0, "val_top1_ema": t, "seconds": 1.0}
        for e, t in ((1, 64.0), (2, 62.5))
    ]
    (averaged / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in epochs))
    assert "best_top1_ema" not in markdown(report([_fake_run(tmp_path / "plain", 50.0, 90.0)]))
    table = markdown(report([averaged, tmp_path / "plain"])).splitlines()
    assert "| last_top5 | best_top1_ema | last_top1_ema | val_images |" in table[0]
    assert "| 99.0 | 64.0 | 62.5 | - |" in table[2] and "| 99.0 | - | - | - |" in table[3], table
    assert ",best_top1_ema,last_top1_ema," in to_csv(report([averaged]))


def test_report_without_any_run_is_an_error(tmp_path):
    from kd.commands.report import report

    make_image_folder(tmp_path / "data", classes=2, train_per_class=1, val_per_class=1)
    with pytest.raises(KDError, match="no kd run"):
        report([tmp_path / "data"])
    with pytest.raises(KDError, match="does not exist"):
        report([tmp_path / "nowhere"])


def test_report_csv_keeps_seconds(tmp_path):
    from kd.commands.report import report, to_csv

    rows = report([_fake_run(tmp_path / "a", 60.0, 90.0)])
    text = to_csv(rows)
    assert text.splitlines()[0].endswith(",wall_s,train_s") and text.splitlines()[1].endswith(",,90.0"), text
    (tmp_path / "a" / "wall.jsonl").write_text(json.dumps({"started": 0.0, "seconds": 100.0, "ended": "finished"}))
    text = to_csv(report([tmp_path / "a"]))
    assert text.splitlines()[1].endswith(",100.0,90.0"), text


def test_report_calls_a_run_without_teacher_by_its_method_ce(teacher_run):
    _, out = teacher_run
    r = kd_main("report", out)
    assert r.returncode == 0 and f"| {out} | ce | - | timm:resnet10t |" in r.stdout, r.stdout
    r = kd_main("recipes", "list")
    assert "| imagenet/baseline_r18 | - | resnet18 | ce |" in r.stdout, r.stdout


def test_figures_are_part_of_the_plain_install():
    import configparser

    from conftest import ROOT

    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    assert "matplotlib>=3.5" in setup["options"]["install_requires"].split()


def test_report_plot_tells_runs_apart_and_draws_what_its_title_says(tmp_path, monkeypatch):
    """Two runs named kd in two folders get labels a/kd and b/kd, not kd twice;
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


def test_report_plot_gives_every_run_its_own_line_and_the_loss_a_log_axis(tmp_path, monkeypatch):
    """Twelve runs (matplotlib's own cycle repeats after ten) are twelve lines told apart by colour
    and style, on both axes; a FitNet loss of ~662 beside KD losses of ~3 needs a log axis."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    from kd.commands import report

    runs = [_fake_run(tmp_path / f"run{i:02d}", 60.0 + i, 100.0) for i in range(12)]
    for i, run in enumerate(runs):
        loss = 662.0 if i == 0 else 3.0 + i / 10
        rows = [{"epoch": e, "val_top1": 60 + i + e, "val_top5": 90, "train_loss": loss / e} for e in (1, 2)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    notes, figures = [], []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))  # the figure, as drawn and saved
    report.plot([tmp_path], tmp_path / "fig.png", notes.append)
    top1, loss = figures[-1].axes
    for ax in (top1, loss):
        looks = {(to_rgba(line.get_color()), line.get_linestyle()) for line in ax.get_lines()}
        assert len(ax.get_lines()) == 12 and len(looks) == 12, looks
    assert loss.get_yscale() == "log" and "log" in loss.get_ylabel(), loss.get_ylabel()
    assert max(loss.get_lines()[0].get_ydata()) == 662.0 and not notes, notes
    assert len({style for _, style in report.run_styles(200)}) > 1
    assert len(set(report.run_styles(200))) == 200


def test_report_plot_leaves_a_loss_a_log_axis_cannot_show_off_and_says_so(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from kd.commands import report

    run = _fake_run(tmp_path / "kd", 60.0, 100.0)
    rows = [{"epoch": e, "val_top1": 60 + e, "val_top5": 90, "train_loss": loss} for e, loss in ((1, 2.0), (2, 0.0))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    notes, figures = [], []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    report.plot([run], tmp_path / "fig.png", notes.append)
    assert list(figures[-1].axes[1].get_lines()[0].get_ydata()) == [2.0]
    assert notes == [f"{run}: 1 epoch(s) of train loss 0, below or NaN left off the log axis"], notes


def test_report_without_matplotlib_prints_the_table_first(teacher_run, tmp_path, no_matplotlib):
    _, out = teacher_run
    r = kd_main("report", out, "--plot", tmp_path / "fig.png")
    assert r.returncode == 2 and f"| {out} | ce |" in r.stdout, (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == [
        "kd: error: matplotlib is not installed, and kd draws its figures with it: pip install matplotlib "
        "(a dependency of kd: pip install -e . in this clone installs it too)"
    ]


def test_report_plot_draws_the_runs(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    for name, ref in (("kd", 71.03), ("dkd", 71.7)):
        run = tmp_path / "table" / name
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(yaml.safe_dump({"kd_loss": name, "reference": {"top1": ref}}))
        (run / "metrics.jsonl").write_text(
            "".join(
                json.dumps({"epoch": e, "val_top1": 60 + e, "val_top5": 90, "train_loss": 3 - e}) + "\n"
                for e in (1, 2, 3)
            )
        )
    from cli import main

    assert main(["report", str(tmp_path / "table"), "--plot", str(tmp_path / "fig.png")]) == 0
    with Image.open(tmp_path / "fig.png") as image:
        assert image.size[0] > 100 and image.size[1] > 100


def test_missing_matplotlib_is_said_not_skipped(tmp_path, no_matplotlib):
    from kd.commands import bench
    from kd.commands.report import plot

    with pytest.raises(KDError, match=r"matplotlib.*pip install"):
        plot([], tmp_path / "fig.png")
    notes = []
    row = {**{c: "-" for c in bench.COLUMNS}, "backend": "single", "opt": "O0", "img_per_s": 10.0}
    bench.write_outputs([row], tmp_path, "single O0", notes.append)
    assert any("matplotlib" in note and "bench.png" in note for note in notes)
    assert (tmp_path / "bench.csv").is_file()


def _table_run(
    root: Path, recipe: str, top1: float, options=None, teacher=None, images=1_281_167, then=None, held=None
) -> Path:
    """A run folder as kd writes it for ``recipe``: config.yaml and two evaluated epochs of ``images``
    training images, the first with the teacher's measured accuracy ``teacher`` (top-1, top-5); ``then``:
    the top-1 of a third, last epoch; ``held``: the training images its data holds (a run of an older kd
    recorded none)."""
    from kd import config as kd_config

    out = root / recipe.split("/")[-1]
    out.mkdir(parents=True)
    kd_config.save(kd_config.resolve(recipe=recipe, options=options or {}), out / "config.yaml")
    first = {"epoch": 1, "train_images": images, "val_top1": top1 - 5, "val_top5": top1 + 15, "seconds": 60}
    if held is not None:
        first["train_set_images"] = held
    if teacher:
        first.update(teacher_top1=teacher[0], teacher_top5=teacher[1])
    last = {"epoch": 2, "train_images": images, "val_top1": top1, "val_top5": top1 + 19.5, "seconds": 60}
    records = [first, last] + ([{**last, "epoch": 3, "val_top1": then, "val_top5": then + 10}] if then else [])
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return out


def test_a_recipe_run_on_a_small_folder_is_never_labelled_the_papers_setting_and_shows_its_last_epoch(tmp_path):
    """A run of a recipe at another batch and epoch count on 600 images is 'unlike' it, with why, in every
    format, the runs table too; the paper's table shows the last epoch beside the best (the best, chosen on
    the validation set, can hide that a method ended below the student alone)."""
    small = dict(images=600, options={"batch_size": 32, "epochs": 8})
    _table_run(tmp_path, "imagenet/r34_r18_crd", 73.0, then=70.0, **small)
    _table_run(tmp_path, "imagenet/baseline_r18", 72.0, **small)
    why = "unlike imagenet/r34_r18_crd: not ImageNet (600 train images), batch_size 32 (256), epochs 8 (100) ..."
    r = kd_main("report", tmp_path, "--csv", tmp_path / "runs.csv")
    assert r.returncode == 0 and "as imagenet" not in r.stdout + (tmp_path / "runs.csv").read_text(), r.stdout
    assert f"| {why} |" in r.stdout and why in (tmp_path / "runs.csv").read_text(), r.stdout
    r = kd_main("report", tmp_path, "--format", "markdown")
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    assert rows[0] == "| method | best top-1 | best top-5 | last top-1 | last top-5 | paper top-1 | diff (best) |"
    assert rows[1:] == [
        "| student alone (resnet18) [1] | 72.00 | 91.50 | 72.00 | 91.50 | - | - |",
        "| CRD [2] | 73.00 | 92.50 | 70.00 | 80.00 | - | - |",
    ], r.stdout
    assert "best: the epoch of the highest val top-1, chosen on the validation set (what the papers report)" in r.stdout
    assert f"[2] {why}" in r.stdout, r.stdout
    r = kd_main("report", tmp_path, "--format", "latex", "--epoch", "last")
    assert r"CRD [2] & 70.00 & 80.00 & - & - \\" in r.stdout.splitlines(), r.stdout
    assert r"Method & Last top-1 & Last top-5 & Paper top-1 & $\Delta$ (last) \\" in r.stdout, r.stdout
    assert why.replace("_", r"\_") in r.stdout
    r = kd_main("report", tmp_path, "--format", "csv", "--epoch", "best")
    lines = list(csv.reader(r.stdout.splitlines()))
    assert lines[0] == "teacher,student,method,best top-1,best top-5,paper top-1,diff (best),paper_setting".split(",")
    assert lines[2] == ["resnet34", "resnet18", "CRD", "73.00", "92.50", "-", "-", why], r.stdout


def test_the_scale_decoupled_rows_follow_the_methods_they_extend(tmp_path):
    _table_run(tmp_path / "a", "imagenet/r34_r18_sddkd", 72.0)
    _table_run(tmp_path / "b", "imagenet/r34_r18_dkd", 71.6)
    _table_run(tmp_path / "c", "imagenet/r34_r18_kd", 71.0)
    r = kd_main("report", tmp_path, "--format", "markdown")
    assert r.returncode == 0, r.stderr
    rows = [line.split(" | ")[0] for line in r.stdout.splitlines() if line.startswith(("| KD", "| DKD", "| SD"))]
    assert rows == ["| KD", "| DKD", "| SD-DKD"]
    assert "| SD-DKD | 72.00 | 91.50 | 72.00 | 91.50 | 72.02 | -0.02 |" in r.stdout, r.stdout


def test_a_dot_run_is_titled_so_and_compared_with_the_dot_recipe_only(tmp_path):
    """--dot is a trainer switch outside the method's recipe keys: a KD recipe run with it is 'KD + DOT'
    and gets no paper reference (the KD recipe's is not its setting); the DOT recipe's run gets DOT's."""
    _table_run(tmp_path / "kd", "imagenet/r34_r18_kd", 71.3, options={"dot": True})
    _table_run(tmp_path / "dot", "imagenet/r34_r18_kd_dot", 71.6)
    r = kd_main("report", tmp_path, "--format", "markdown")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("| KD")]
    assert lines == [
        "| KD + DOT (dot/r34_r18_kd_dot) | 71.60 | 91.10 | 71.60 | 91.10 | 71.72 | -0.12 |",
        "| KD + DOT (kd/r34_r18_kd) [1] | 71.30 | 90.80 | 71.30 | 90.80 | - | - |",
    ], r.stdout
    assert "[1] unlike imagenet/r34_r18_kd: DOT" in r.stdout  # the paper setting it departs from
    assert (
        "kd/r34_r18_kd: no paper reference shown, not the setting of recipe imagenet/r34_r18_kd: dot True" in r.stderr
    )


def test_report_prints_the_papers_table_in_markdown_and_latex(tmp_path):
    """Teacher, student alone, then the methods in the papers' order, with top-1, top-5 and the
    published top-1 (torchvision's for the teacher) where each run was that setting on ImageNet."""
    teacher = (73.3, 91.4)
    _table_run(tmp_path, "imagenet/r34_r18_dkd", 71.5, teacher=teacher)
    _table_run(tmp_path, "imagenet/r34_r18_crd", 71.0, teacher=teacher)
    _table_run(tmp_path, "imagenet/r34_r18_kd", 70.9, teacher=teacher)
    _table_run(tmp_path, "imagenet/baseline_r18", 69.6)
    _table_run(tmp_path / "ls", "imagenet/r34_r18_ctdkd", 71.2, options={"standardise": True}, teacher=teacher)
    _table_run(tmp_path / "again", "imagenet/r34_r18_dkd", 71.4, teacher=teacher)
    r = kd_main("report", tmp_path, "--format", "markdown")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    assert lines == [
        "| method | best top-1 | best top-5 | last top-1 | last top-5 | paper top-1 | diff (best) |",
        "| teacher (resnet34) | 73.30 | 91.40 | 73.30 | 91.40 | 73.31 | -0.01 |",
        "| student alone (resnet18) | 69.60 | 89.10 | 69.60 | 89.10 | 69.76 | -0.16 |",
        "| KD | 70.90 | 90.40 | 70.90 | 90.40 | 71.03 | -0.13 |",
        "| CRD | 71.00 | 90.50 | 71.00 | 90.50 | 71.17 | -0.17 |",
        "| DKD (again/r34_r18_dkd) | 71.40 | 90.90 | 71.40 | 90.90 | 71.70 | -0.30 |",  # two DKD runs: told apart
        f"| DKD ({tmp_path.name}/r34_r18_dkd) | 71.50 | 91.00 | 71.50 | 91.00 | 71.70 | -0.20 |",
        "| DKD + CTKD + LS [1] | 71.20 | 90.70 | 71.20 | 90.70 | - | - |",  # not the recipe's setting: no reference
    ], r.stdout
    assert r.stdout.startswith("resnet34 -> resnet18\n")
    assert (
        "ls/r34_r18_ctdkd: no paper reference shown, not the setting of recipe imagenet/r34_r18_ctdkd: loss_args.standardise 1.0 (recipe: 0.0)"
        in r.stderr
    )
    r = kd_main("report", tmp_path, "--format", "latex")
    assert r.returncode == 0, r.stderr
    body = r.stdout.splitlines()
    assert body[1:5] == [
        r"\begin{tabular}{lrrrrrr}",
        r"\toprule",
        r"Method & Best top-1 & Best top-5 & Last top-1 & Last top-5 & Paper top-1 & $\Delta$ (best) \\",
        r"\midrule",
    ]
    assert body[5:9] == [
        r"teacher (resnet34) & 73.30 & 91.40 & 73.30 & 91.40 & 73.31 & -0.01 \\",
        r"student alone (resnet18) & 69.60 & 89.10 & 69.60 & 89.10 & 69.76 & -0.16 \\",
        r"\midrule",
        r"KD & 70.90 & 90.40 & 70.90 & 90.40 & 71.03 & -0.13 \\",
    ], r.stdout
    assert body[-1] == r"\end{tabular}" and r"\bottomrule" in body[-5:]


def test_the_2024_logit_rows_follow_the_earlier_methods_with_their_references(tmp_path):
    """The logit-standardisation recipes are titled '+ LS' beside their method, with Table 3's numbers; the
    later methods follow in the order of kd/losses/__init__.py's lines (CRLD's recipe has no reference number)."""
    for recipe, top1 in (("r34_r18_crld", 72.0), ("r34_r18_luminet", 72.1), ("r34_r18_dkd_ls", 71.8),
                         ("r34_r18_dkd", 71.6), ("r34_r18_lskd", 71.4), ("r34_r18_mlkd_ls", 72.0)):  # fmt: skip
        _table_run(tmp_path, f"imagenet/{recipe}", top1)
    r = kd_main("report", tmp_path, "--format", "latex", "--epoch", "best")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.endswith(r"\\") and "multicolumn" not in line][1:]
    assert rows == [
        r"DKD & 71.60 & 91.10 & 71.70 & -0.10 \\",
        r"DKD + LS & 71.80 & 91.30 & 71.88 & -0.08 \\",
        r"MLKD + LS & 72.00 & 91.50 & 72.08 & -0.08 \\",
        r"KD + LS & 71.40 & 90.90 & 71.42 & -0.02 \\",
        r"LumiNet & 72.10 & 91.60 & 72.16 & -0.06 \\",
        r"CRLD & 72.00 & 91.50 & - & - \\",
    ], r.stdout


def test_the_papers_table_of_a_small_folder_has_no_references(tmp_path):
    """Runs on a few images are not the published setting: no reference, and no baseline row without a
    student-alone run (said on stderr)."""
    _table_run(tmp_path, "imagenet/r34_r18_ofd", 40.0, teacher=(50.0, 80.0), images=1200)
    r = kd_main("report", tmp_path, "--format", "markdown")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ")][1:]
    assert rows == [
        "| teacher (resnet34) | 50.00 | 80.00 | 50.00 | 80.00 | - | - |",
        "| OFD [1] | 40.00 | 59.50 | 40.00 | 59.50 | - | - |",
    ], r.stdout
    assert "[1] unlike imagenet/r34_r18_ofd: not ImageNet (1,200 train images)" in r.stdout
    assert "; teacher: its weights' top-1 and top-5, measured once before training (it has no epochs)" in r.stdout
    assert "no run of resnet18 alone among the runs" in r.stderr


def test_a_part_killed_outright_is_said_to_be_missing_from_the_wall_time(image_folder, tmp_path):
    """kill -9 leaves no end line: kd report marks the wall time as a lower bound (``+``) and says
    which part is missing, also after the run was resumed and finished."""
    out = tmp_path / "run"
    # squeezenet1_1 (at a learning rate it trains at) writes a tenth of resnet18's checkpoint at every step; five
    # epochs: the kill lands while the process still trains, after its first epoch's line
    args = train_args(
        image_folder, out, "--save-every-steps", 1, epochs=5, no_teacher=True, student="squeezenet1_1", lr=0.01
    )
    proc = start_kd(*args)
    deadline = time.time() + HANG_GUARD
    metrics = out / "metrics.jsonl"  # its first epoch's line written whole (the file opens before it)
    while not (metrics.exists() and metrics.read_text().endswith("\n")):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL) if os.getpgid(proc.pid) == proc.pid else proc.kill()
    proc.communicate()
    r = kd_main("report", out)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith(f"| {out} "))
    assert row.split("|")[-3].strip() == "-", row  # no part ended yet: no wall time to give
    assert "wall_time leaves out 1 part(s) that began" in r.stderr and "wrote no end" in r.stderr, r.stderr
    r = kd_main("train", "--out", out, "--resume")
    assert r.returncode == 0, r.stderr
    assert "in all: 1 earlier part(s) wrote no end)" in r.stdout.strip().splitlines()[-1], r.stdout
    r = kd_main("report", out)
    row = next(line for line in r.stdout.splitlines() if line.startswith(f"| {out} "))
    assert row.split("|")[-3].strip().endswith("+"), row
    assert "wall_time leaves out 1 part(s)" in r.stderr, r.stderr


def test_a_folder_of_several_students_is_reported_without_a_word_about_its_own_files(tmp_path):
    """A run of several students keeps students.yaml beside their folders: kd report says nothing
    about it (not 'skipped .../students.yaml: not a run folder'), and still names a folder in it
    that holds no run."""
    from kd.commands.report import find_runs

    group = tmp_path / "table"
    for student in ("kd", "dkd"):
        (group / student).mkdir(parents=True)
        (group / student / "metrics.jsonl").write_text("")
    (group / "students.yaml").write_text("students: [kd, dkd]\n")
    (group / "notes").mkdir()
    said = []
    assert find_runs(group, said.append) == [group / "dkd", group / "kd"]
    assert said == [f"skipped {group / 'notes'}: no run in it"]


def _paper_rows(r) -> list:
    return [line for line in r.stdout.splitlines() if line.startswith("| ")][1:]


def test_a_model_taught_from_two_weights_is_two_teachers_whatever_the_order(tmp_path):
    """Two resnet34 teachers of other weights files head their own students with their own accuracy, and
    the order of the folders given changes nothing; the teacher row says what its numbers are."""
    strong = {"teacher_weights": str(tmp_path / "strong.pt")}
    _table_run(tmp_path / "kd", "imagenet/r34_r18_kd", 71.0, options=strong, teacher=(98.0, 99.0))
    weak = {"teacher_weights": "none"}
    _table_run(tmp_path / "kd_weak", "imagenet/r34_r18_dkd", 40.0, options=weak, teacher=(30.5, 60.0))
    r = kd_main("report", tmp_path / "kd", tmp_path / "kd_weak", "--format", "markdown")
    assert r.returncode == 0, r.stderr
    assert kd_main("report", tmp_path / "kd_weak", tmp_path / "kd", "--format", "markdown").stdout == r.stdout
    tables = r.stdout.split("\n\n")
    assert "resnet34 (none) -> resnet18" in tables and "resnet34 (strong.pt) -> resnet18" in tables, r.stdout
    assert "| teacher (resnet34 (none)) | 30.50 | 60.00 | 30.50 | 60.00 | - | - |\n| DKD [1] |" in r.stdout, r.stdout
    assert "| teacher (resnet34 (strong.pt)) | 98.00 | 99.00 | 98.00 | 99.00 | - | - |\n| KD |" in r.stdout
    assert "teacher: its weights' top-1 and top-5, measured once before training (it has no epochs)" in r.stdout
    rows = list(csv.reader(kd_main("report", tmp_path, "--format", "csv").stdout.splitlines()))
    assert [row[:4] for row in rows[1:]] == [
        ["resnet34 (none)", "resnet18", "teacher (resnet34 (none))", "30.50"],
        ["resnet34 (none)", "resnet18", "DKD", "40.00"],
        ["resnet34 (strong.pt)", "resnet18", "teacher (resnet34 (strong.pt))", "98.00"],
        ["resnet34 (strong.pt)", "resnet18", "KD", "71.00"],
    ], rows


def test_two_teacher_files_of_one_name_are_told_apart_by_their_paths(tmp_path):
    """Two teachers' best.pt: neither table is lost under the other's name."""
    for name, top1 in (("a", 80.0), ("b", 60.0)):
        weights = {"teacher_weights": f"runs/{name}/best.pt"}
        _table_run(tmp_path / name, "imagenet/r34_r18_kd", top1 - 10, options=weights, teacher=(top1, 90.0))
    r = kd_main("report", tmp_path, "--format", "markdown")
    assert r.returncode == 0, r.stderr
    assert "| teacher (resnet34 (runs/a/best.pt)) | 80.00 |" in r.stdout, r.stdout
    assert "| teacher (resnet34 (runs/b/best.pt)) | 60.00 |" in r.stdout, r.stdout


def test_the_student_alone_of_its_students_setting_is_shown_and_another_said_left_out(tmp_path):
    """Of two student-alone runs, the one of the students' setting (data, epochs, batch) is the row in
    either order given; the other is named on stderr with why; two of that setting are both shown."""
    _table_run(tmp_path / "kd", "imagenet/r34_r18_kd", 71.0)
    _table_run(tmp_path / "a", "imagenet/baseline_r18", 60.0)  # 90 epochs, batch 256: torchvision's
    same = {"epochs": 100, "batch_size": 512}
    _table_run(tmp_path / "b", "imagenet/baseline_r18", 69.0, options=same)
    for order in ([tmp_path / "a", tmp_path / "b"], [tmp_path / "b", tmp_path / "a"]):
        r = kd_main("report", *order, tmp_path / "kd", "--format", "markdown")
        assert r.returncode == 0, r.stderr
        assert _paper_rows(r)[0].startswith("| student alone (resnet18) [1] | 69.00 |"), r.stdout
        left = f"{tmp_path / 'a' / 'baseline_r18'}: left out of the resnet34 -> resnet18 table's student-alone rows"
        assert f"{left}: epochs 90 (its students': 100), batch_size 256 (its students': 512); shown: " in r.stderr
    _table_run(tmp_path / "c", "imagenet/baseline_r18", 68.0, options=same)
    r = kd_main("report", tmp_path, "--format", "markdown")
    assert [row.split(" | ")[:2] for row in _paper_rows(r)[:2]] == [
        ["| student alone (resnet18) (b/baseline_r18) [1]", "69.00"],
        ["| student alone (resnet18) (c/baseline_r18) [1]", "68.00"],
    ], r.stdout


@pytest.mark.parametrize("fmt", ["markdown", "latex", "csv"])
def test_the_papers_table_of_runs_without_a_teacher_is_a_user_error(tmp_path, fmt):
    """No distilled run: no table to print, said in one line (as kd report of no run at all), exit 2."""
    _table_run(tmp_path / "a", "imagenet/baseline_r18", 60.0)
    _table_run(tmp_path / "b", "imagenet/baseline_r18", 61.0)
    line = one_error_line(kd_main("report", tmp_path, "--format", fmt))
    assert line == (
        "kd: error: the paper's table needs distilled runs (a teacher's), and the 2 run(s) given are all "
        "--no-teacher: kd report without --format lists them"
    )


def test_a_run_of_fewer_batches_than_its_folder_names_both(tmp_path):
    """A run of --limit-train-batches 4 on a folder of 600 images: the footnote names the folder's 600 and the
    limit as a reason of its own (not '128 train images'); a run of an older kd, without the folder's
    count, says its images an epoch."""
    limited = dict(options={"batch_size": 32, "limit_train_batches": 4}, teacher=(50.0, 80.0))
    _table_run(tmp_path / "new", "imagenet/r34_r18_kd", 40.0, images=128, held=600, **limited)
    _table_run(tmp_path / "old", "imagenet/r34_r18_dkd", 41.0, images=128, **limited)
    r = kd_main("report", tmp_path, "--format", "markdown")
    assert r.returncode == 0, r.stderr
    limit = "--limit-train-batches 4, batch_size 32 (512)"
    assert f"unlike imagenet/r34_r18_kd: not ImageNet (600 train images), {limit}" in r.stdout, r.stdout
    assert f"unlike imagenet/r34_r18_dkd: not ImageNet (128 images an epoch), {limit}" in r.stdout, r.stdout
