"""What a new user met in the first hour (issue 17): eval settings from the checkpoint, slow reduced
precision on the CPU, empty class folders, report over a folder of runs, workers defaults, tables."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import ROOT, kd_main, make_image_folder

import kd
from kd import config as kd_config
from kd.errors import KDError

TINY = dict(
    student="timm:resnet10t",
    no_teacher=True,
    image_size=32,
    val_resize=32,
    batch_size=8,
    workers=0,
    epochs=1,
    lr=0.05,
    device="cpu",
    log_every=1,
    seed=0,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short run at image size 32, val resize 32 (the demo's preprocessing), shared by the readers."""
    root = tmp_path_factory.mktemp("newcomer")
    data = make_image_folder(root / "data")
    out = root / "run"
    kd.train(kd_config.resolve(options=dict(TINY, data=str(data), out=str(out))))
    logged = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    return data, out / "checkpoints" / "last.pt", logged


def one_error_line(r):
    lines = [line for line in r.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("kd: error: "), r.stderr
    return lines[0]


# item 1: kd eval takes the run's own settings from a kd checkpoint


def test_eval_cli_takes_model_and_preprocessing_from_the_checkpoint(trained):
    data, ckpt, logged = trained
    r = kd_main("eval", "--weights", ckpt, "--data", data, "-b", 8, "-j", 0, "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "timm:resnet10t" in r.stdout and "image size 32" in r.stdout and "val resize 32" in r.stdout, r.stdout
    assert "checkpoint" in r.stdout
    assert f"top-1 {logged['val_top1']:.2f}" in r.stdout
    assert f"loss {logged['val_loss']:.4f}" in r.stdout  # the mean validation loss, as timm's validate prints


def test_eval_of_a_checkpoint_is_the_runs_own_validation(trained):
    from kd.commands.evaluate import evaluate_model

    data, ckpt, logged = trained
    r = evaluate_model(None, str(ckpt), str(data), batch_size=8, device="cpu", workers=0)
    assert (r["model"], r["image_size"], r["val_resize"], r["num_classes"]) == ("timm:resnet10t", 32, 32, 3)
    assert r["loss"] == pytest.approx(logged["val_loss"], abs=1e-5)


def test_eval_options_override_the_checkpoint(trained):
    from kd.commands.evaluate import evaluate_model

    data, ckpt, logged = trained
    r = evaluate_model(None, str(ckpt), str(data), batch_size=8, device="cpu", workers=0, image_size=48)
    # a new size: the model's own resize for it (timm's floor(48 / 0.875) for resnet10t), not the run's 32
    assert (r["image_size"], r["val_resize"]) == (48, 54)
    assert "image size 48 (option)" in r["settings"]
    assert r["loss"] != pytest.approx(logged["val_loss"], abs=1e-5)
    r = evaluate_model("timm:resnet10t", str(ckpt), str(data), batch_size=8, device="cpu", workers=0, val_resize=40)
    assert (r["image_size"], r["val_resize"]) == (32, 40)


def test_eval_plain_weights_file_needs_model(trained, tmp_path):
    from kd.commands.evaluate import evaluate_model

    data, ckpt, _ = trained
    plain = tmp_path / "plain.pt"
    torch.save(torch.load(ckpt, weights_only=True)["student"], plain)
    with pytest.raises(KDError, match="--model"):
        evaluate_model(None, str(plain), str(data), device="cpu", workers=0)
    r = evaluate_model(
        "timm:resnet10t", str(plain), str(data), batch_size=8, device="cpu", image_size=32, val_resize=32, workers=0
    )
    assert "image size 32 (option)" in r["settings"] and r["num_classes"] == 3


def test_eval_class_count_must_fit_the_data(trained, tmp_path):
    data, ckpt, _ = trained
    other = make_image_folder(tmp_path / "four", classes=4, train_per_class=1, val_per_class=1)
    r = kd_main("eval", "--weights", ckpt, "--data", other, "-j", 0, "--device", "cpu")
    line = one_error_line(r)
    assert "3 classes" in line and "4 class folders" in line, line


# item 2: reduced precision on a CPU without the instructions for it


def test_slow_precision_warning_names_what_to_do():
    from kd.precision.cpu import slow_precision_warning

    cpu = torch.device("cpu")
    avx2 = {"sse4_2", "avx", "avx2", "fma"}
    warning = slow_precision_warning("O1", torch.bfloat16, cpu, flags=avx2)
    assert warning and "--opt O0" in warning and "bfloat16" in warning and "AMX" in warning, warning
    assert "\n" not in warning and "20-35x" in warning
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    warning = slow_precision_warning("O1", torch.bfloat16, cpu, flags=avx512)
    assert warning and "1.7x" in warning and "--opt O0" in warning, warning
    assert slow_precision_warning("O2", torch.bfloat16, cpu, flags=avx512 | {"avx512_bf16"}) is None
    assert slow_precision_warning("O1", torch.bfloat16, cpu, flags=avx2 | {"amx_bf16", "amx_tile"}) is None
    assert slow_precision_warning("O1", torch.bfloat16, cpu, flags={"fp", "asimd", "bf16"}) is None  # Arm with BF16
    assert slow_precision_warning("O0", torch.float32, cpu, flags=avx2) is None
    assert slow_precision_warning("O1", torch.bfloat16, torch.device("cuda", 0), flags=avx2) is None
    assert slow_precision_warning("O1", torch.bfloat16, cpu, flags=set()) is None  # flags unknown: no guess


def test_cpu_flags_of_this_machine():
    from kd.precision.cpu import cpu_flags

    if not Path("/proc/cpuinfo").is_file():
        pytest.skip("no /proc/cpuinfo: kd reads no flags here")
    flags = cpu_flags()
    assert flags and all(f == f.lower() and " " not in f for f in flags)


# item 3: a class folder with no image


def _without_images(folder: Path) -> None:
    for f in folder.iterdir():
        f.unlink()


def test_scan_names_class_folders_without_images(tmp_path):
    from kd.data.folder import scan

    data = make_image_folder(tmp_path / "d", classes=3, train_per_class=2, val_per_class=1)
    for split in ("train", "val"):
        (data / split / "class_09").mkdir()
    (data / "val" / "class_09" / "notes.txt").write_text("not an image")
    with pytest.raises(KDError) as err:
        scan(str(data))
    assert "train/class_09" in str(err.value) and "val/class_09" in str(err.value), err.value
    assert "no image" in str(err.value)


def test_scan_names_an_empty_train_class_with_val_images(tmp_path):
    from kd.data.folder import scan

    data = make_image_folder(tmp_path / "d", classes=3, train_per_class=2, val_per_class=1)
    _without_images(data / "train" / "class_01")
    with pytest.raises(KDError, match="train/class_01") as err:
        scan(str(data))
    assert "val/class" not in str(err.value)


def test_train_with_an_empty_class_folder_is_one_clear_error(tmp_path):
    data = make_image_folder(tmp_path / "d", classes=3, train_per_class=2, val_per_class=1)
    for split in ("train", "val"):
        (data / split / "class_03").mkdir()
    r = kd_main(
        "train",
        "--data",
        data,
        "--student",
        "resnet18",
        "--no-teacher",
        "--image-size",
        32,
        "-b",
        4,
        "-j",
        0,
        "--epochs",
        1,
        "--device",
        "cpu",
        "--out",
        tmp_path / "run",
    )
    line = one_error_line(r)
    assert "class_03" in line, line


# item 5: kd report over a folder of runs, durations a person reads


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
    assert "| 97.1 |" in r.stdout and "| 2.1m |" in r.stdout and "| 12m |" in r.stdout, r.stdout
    assert "data" in r.stderr and "skipped" in r.stderr, r.stderr
    r = kd_main("report", *sorted(runs.iterdir()))  # the shell's runs/demo/*
    assert r.returncode == 0, r.stderr
    assert len([line for line in r.stdout.splitlines() if line.startswith(f"| {runs}")]) == 2
    assert "skipped" in r.stderr and "notes.txt" in r.stderr


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
    assert text.splitlines()[0].endswith(",wall_s") and text.splitlines()[1].endswith(",90.0"), text


# item 6: the real workers default


def _help(*args) -> str:
    from cli import cli

    r = CliRunner().invoke(cli, [*args, "--help"])
    assert r.exit_code == 0, r.output
    return " ".join(r.output.split())


def test_workers_help_says_the_real_default():
    assert "[CPU cores per process less one]" in _help("train")
    assert "[8]" not in _help("train").split("--workers")[1][:80]
    assert "[CPU cores less one]" in _help("eval")


def test_eval_workers_default_to_the_cores(trained):
    from kd.commands.evaluate import resolve
    from kd.data.loader import default_workers

    _, ckpt, _ = trained
    assert resolve(None, str(ckpt)).workers == default_workers(1)
    assert resolve(None, str(ckpt), workers=0).workers == 0


# item 8: tables


def test_recipes_list_prints_dash_and_the_papers_decimals():
    from kd.commands.recipes import table

    rows = {line.split(" | ")[0][2:]: line for line in table().splitlines()[2:]}
    assert rows["imagenet/r101_r18_kd"].endswith("| - |"), rows["imagenet/r101_r18_kd"]
    assert rows["imagenet/r34_r18_dkd"].endswith("| 71.70 |")
    assert rows["imagenet/r50_mv1_kd"].endswith("| 70.50 |")
    assert "None" not in table()


def test_losses_fit_a_terminal():
    """Each method: its name and formula on one line, its defaults indented below, no line over 88
    columns (they had run to 205)."""
    from cli import cli
    from kd.losses import LOSSES

    r = CliRunner().invoke(cli, ["losses"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert max(len(line) for line in lines) <= 88, max(lines, key=len)
    words = " ".join(r.output.split())  # the wrapped lines joined again
    for name in LOSSES.names():
        cls = LOSSES.get(name)
        doc = (cls.__doc__ or "").strip().splitlines()[0].replace("``", "")
        params = " ".join(f"{k}={v}" for k, v in cls.defaults.items())
        assert f"{name} {doc} {params}" in words, (name, r.output)
    assert [line.split()[0] for line in lines if not line.startswith(" ")] == LOSSES.names()


def test_readme_method_table_lists_every_hyper_parameter():
    from kd.losses import LOSSES

    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        m = re.match(r"\| `(\w+)` \| [^|]+ \| ([^|]+) \|$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    for name in LOSSES.names():
        assert name in rows, f"README's method table has no row for {name}"
        for key, default in LOSSES.get(name).defaults.items():
            m = re.search(rf"\b{key} ([0-9.e+-]+)", rows[name])
            assert m, f"README: {name} does not list {key} ({rows[name]})"
            assert float(m.group(1)) == pytest.approx(float(default)), (name, key)


def test_precision_line_without_apex_closes_its_parentheses():
    import importlib.util

    from kd.config import RunConfig
    from kd.precision import make_precision

    if importlib.util.find_spec("apex"):
        pytest.skip("apex is installed: its reason differs")
    line = make_precision(RunConfig(opt="O1"), torch.device("cpu"), prefer_apex=True).describe()
    assert line.count("(") == line.count(")"), line
