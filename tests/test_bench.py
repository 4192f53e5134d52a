"""kd bench on the CPU: every combination in its own process set, one table, rows that explain failures."""

from __future__ import annotations

import csv
import json

import pytest
from conftest import kd_main, make_image_folder

SETS = ["--set", "fuse_teacher=false", "--set", "momentum=0.5"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """One ``kd bench`` over single, torch_ddp and dp at O0 and O1 with two --set options; the
    combinations are real ``kd train`` processes (bench starts them), the bench itself runs here."""
    out = tmp_path_factory.mktemp("bench") / "bench"
    r = kd_main(
        "bench",
        "--teacher",
        "resnet18",
        "--student",
        "resnet18",
        "--device",
        "cpu",
        "--nproc",
        "2",
        "--backends",
        "single,torch_ddp,dp",
        "--opt",
        "O0,O1",
        "-b",
        "4",
        "--image-size",
        "32",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--out",
        out,
        "--keep-runs",  # the tests below read each combination's config.yaml
        *SETS,
    )
    return out, r


@pytest.mark.slow
def test_bench_table_csv_json_on_cpu(bench):
    out, r = bench
    assert r.returncode == 0, r.stderr
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert [(x["backend"], x["opt"]) for x in rows] == [
        (b, o) for b in ("single", "torch_ddp", "dp") for o in ("O0", "O1")
    ]
    ran = [x for x in rows if x["backend"] != "dp"]
    for x in ran:
        assert x["img_per_s"] > 0 and x["s_per_20_iters"] > 0, x
    assert "2 process(es)" in ran[2]["impl"] and "bfloat16" in ran[3]["impl"]
    for x in rows[4:]:
        assert x["img_per_s"] == "-" and ("CUDA" in x["note"] or "--nproc" in x["note"]), x
    assert ran[0]["speedup"] == 1.0
    with open(out / "bench.csv") as fh:
        assert len(list(csv.DictReader(fh))) == 6
    assert "| torch_ddp | O1 |" in r.stdout


@pytest.mark.slow
def test_bench_passes_set_to_every_combination(bench):
    out, r = bench
    assert r.returncode == 0, r.stderr
    for combo in ("single_O0", "single_O1", "torch_ddp_O0", "torch_ddp_O1"):  # every one that ran
        saved = (out / "runs" / combo / "config.yaml").read_text()
        assert "fuse_teacher: false" in saved and "momentum: 0.5" in saved, combo


def test_bench_data_reports_the_loader_alone(tmp_path):
    data = make_image_folder(tmp_path / "data", classes=2, train_per_class=6)
    for loader in ("pil", "gpu"):  # gpu falls back to CPU decoding here, and says so
        r = kd_main(
            "bench",
            "data",
            "--data",
            data,
            "--loader",
            loader,
            "-b",
            "4",
            "-j",
            "2",
            "--epochs",
            "2",
            "--device",
            "cpu",
            "--image-size",
            "32",
        )
        assert r.returncode == 0, r.stderr
        lines = [x for x in r.stdout.splitlines() if x.startswith("epoch ")]
        assert len(lines) == 2 and all("12 images in" in x and "images/s" in x for x in lines), r.stdout
        assert r.stdout.startswith(f"loader {loader}")
    r = kd_main("bench", "data", "--data", tmp_path / "missing")
    assert r.returncode == 2 and r.stderr.startswith("kd: error:") and "Traceback" not in r.stderr


@pytest.mark.slow
def test_bench_vs_synthetic_gives_each_row_its_share_of_the_step(tmp_path):
    """--vs-synthetic runs each combination on the folder and on synthetic tensors (two kd train
    processes, the second without the loader's options) and reports the folder's share, in %."""
    data = make_image_folder(tmp_path / "data", classes=2, train_per_class=12)
    out = tmp_path / "bench"
    common = ["--teacher", "resnet18", "--student", "resnet18", "--device", "cpu", "--backends", "single"]
    common += ["--opt", "O0", "-b", "4", "--image-size", "32", "--iters", "2", "--warmup", "1"]
    r = kd_main(
        "bench", *common, "--data", data, "--loader", "gpu", "-j", "1", "--vs-synthetic", "--out", out, "--keep-runs"
    )
    assert r.returncode == 0, r.stderr
    (row,) = json.loads((out / "bench.json").read_text())["rows"]
    assert row["img_per_s"] > 0 and row["synthetic_img_per_s"] > 0, row
    assert row["of_synthetic_pct"] == round(100 * row["img_per_s"] / row["synthetic_img_per_s"], 1)
    on_folder = (out / "runs" / "single_O0" / "config.yaml").read_text()
    assert f"data: {data}" in on_folder and "loader: gpu" in on_folder and "workers: 1" in on_folder
    synthetic = (out / "runs" / "single_O0_synthetic" / "config.yaml").read_text()
    assert "data: synthetic" in synthetic and "loader: auto" in synthetic and "workers: null" in synthetic
    header = r.stdout.splitlines()[0]
    assert "| img_per_s | synthetic_img_per_s | of_synthetic_pct |" in header, r.stdout
    with open(out / "bench.csv") as fh:
        assert next(csv.DictReader(fh))["of_synthetic_pct"] == str(row["of_synthetic_pct"])


@pytest.mark.slow
def test_bench_vs_synthetic_skips_the_synthetic_run_of_a_failed_row(tmp_path):
    data = make_image_folder(tmp_path / "data", classes=2, train_per_class=4)
    out = tmp_path / "bench"
    args = ["--teacher", "resnet18", "--student", "resnet18", "--device", "cpu", "--backends", "dp", "--opt", "O0"]
    r = kd_main(
        "bench", *args, "--iters", "1", "--warmup", "1", "--data", data, "--vs-synthetic", "-o", out, "--keep-runs"
    )
    assert r.returncode == 0, r.stderr
    (row,) = json.loads((out / "bench.json").read_text())["rows"]
    assert row["img_per_s"] == "-" and "CUDA" in row["note"], row  # dp needs GPUs
    assert row["of_synthetic_pct"] == "-" and not (out / "runs" / "dp_O0_synthetic").exists()


def test_bench_vs_synthetic_needs_a_folder_and_one_method(tmp_path):
    for extra in ([], ["--data", tmp_path, "--methods", "kd,dkd"]):
        out = tmp_path / "bench"
        r = kd_main("bench", "--device", "cpu", "--vs-synthetic", "--out", out, *extra)
        assert r.returncode == 2 and r.stderr.startswith("kd: error: --vs-synthetic"), r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert not out.exists()


def test_bench_refuses_a_missing_data_folder_before_any_run(tmp_path):
    out = tmp_path / "bench"
    r = kd_main("bench", "--device", "cpu", "--data", tmp_path / "missing", "--out", out)
    assert r.returncode == 2 and r.stderr.startswith("kd: error: data folder"), r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_a_failed_synthetic_run_says_why_in_the_row():
    from kd.commands.bench import add_synthetic

    folder_ran = {"img_per_s": 120.0, "note": ""}
    add_synthetic(folder_ran, {"note": "timed out after 60s"})
    assert folder_ran["note"] == "synthetic: timed out after 60s"
    assert folder_ran["synthetic_img_per_s"] == "-" and folder_ran["of_synthetic_pct"] == "-"


def test_bench_keeps_only_its_table_unless_asked(tmp_path, capsys):
    """The combinations' run folders (a CPU bench left 250 MB) go once the table is written."""
    from kd.commands.bench import drop_runs

    for keep in (True, False):
        (tmp_path / "runs" / "single_O0" / "checkpoints").mkdir(parents=True, exist_ok=True)
        (tmp_path / "runs" / "single_O0" / "checkpoints" / "last.pt").write_bytes(b"x" * 1000)
        (tmp_path / "bench.json").write_text("{}")
        drop_runs(tmp_path, {"keep_runs": keep})
        assert (tmp_path / "runs").exists() == keep and (tmp_path / "bench.json").exists()
    assert f"removed the combinations' runs in {tmp_path / 'runs'} (--keep-runs keeps them)" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_vs_store_times_live_teach_store_and_alone(tmp_path):
    """--vs-store: the student with the live teacher, kd teach on the same synthetic tensors (timed
    after the warm-up), the student from that store and the student alone, in one table with each
    row against the live teacher and the student alone, and the store's break-even."""
    out = tmp_path / "bench"
    common = ["--teacher", "resnet18", "--student", "resnet18", "--device", "cpu", "--backends", "single"]
    common += ["--opt", "O0", "-b", "4", "--image-size", "32", "--iters", "3", "--warmup", "1"]
    r = kd_main("bench", *common, "--vs-store", "--top-k", "5", "--out", out, "--keep-runs")
    assert r.returncode == 0, r.stderr
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert [x["teacher"] for x in rows] == ["resnet18 (live)", "kd teach", "store (top-k 5)", "none (--no-teacher)"]
    live, teach, store, alone = rows
    assert all(x["img_per_s"] > 0 for x in rows), rows
    assert store["speedup"] == round(store["img_per_s"] / live["img_per_s"], 2)
    assert store["of_alone_pct"] == round(100 * store["img_per_s"] / alone["img_per_s"], 1)
    assert teach["of_alone_pct"] == "-" and teach["impl"] == "teacher in float32; top-k 5"
    gain = 1 / live["img_per_s"] - 1 / store["img_per_s"]
    said = f"teaching repaid after {(1 / teach['img_per_s']) / gain:.1f}" if gain > 0 else "no faster"
    assert store["note"].startswith(said), store
    runs = out / "runs" / "single_O0"
    (log,) = [json.loads(x) for x in (runs / "store" / "kd-teach-log.jsonl").read_text().splitlines()]
    assert log["batches"] == 4 and log["timed_steps"] == 3 and round(log["timed_img_per_s"], 1) == teach["img_per_s"]
    assert f"soft_labels: {runs / 'store'}" in (runs / "from_store" / "config.yaml").read_text()
    assert "no_teacher: true" in (runs / "alone" / "config.yaml").read_text()
    header = r.stdout.splitlines()[0]
    assert header.startswith("| backend | opt | teacher | methods |") and "| img_per_s | of_alone_pct |" in header
    for wrong in (["--vs-store", "--methods", "kd,dkd"], ["--vs-store", "--top-k", "0"], ["--top-k", "3"]):
        r = kd_main("bench", *common, *wrong, "--out", tmp_path / "wrong")
        assert r.returncode == 2 and r.stderr.startswith("kd: error:") and "Traceback" not in r.stderr, r.stderr
        assert not (tmp_path / "wrong").exists()
