"""kd bench on the CPU: every combination in its own process set, one table, rows that explain failures."""

from __future__ import annotations

import csv
import json

import pytest
from conftest import kd_main, make_image_folder, one_error_line

SETS = ["--set", "fuse_teacher=false", "--set", "momentum=0.5"]
#: the models of the combinations bench starts: squeezenet1_1 builds, steps and saves its checkpoint in
#: less CPU than resnet18 (a tenth of its size); what is timed does not matter here
MODELS = ["--teacher", "squeezenet1_1", "--student", "squeezenet1_1"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """One ``kd bench`` over single, torch_ddp and dp at O0 with two --set options; the
    combinations are real ``kd train`` processes (bench starts them), the bench itself runs here;
    the titles of the charts it drew come back too."""
    import matplotlib.pyplot as plt

    out = tmp_path_factory.mktemp("bench") / "bench"
    figures = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plt, "close", lambda fig=None: figures.append(fig))
        r = kd_main(
            "bench",
            *MODELS,
            "--device",
            "cpu",
            "--nproc",
            "2",
            "--backends",
            "single,torch_ddp,dp",
            "--opt",
            "O0",
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
    return out, r, [fig.axes[0].get_title() for fig in figures]


@pytest.mark.slow
def test_bench_table_csv_json_on_cpu(bench):
    out, r, _ = bench
    assert r.returncode == 0, r.stderr
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert [(x["backend"], x["opt"]) for x in rows] == [(b, "O0") for b in ("single", "torch_ddp", "dp")]
    ran = [x for x in rows if x["backend"] != "dp"]
    for x in ran:
        assert x["img_per_s"] > 0 and x["s_per_20_iters"] > 0, x
    # impl names what ran in a word; the note says what the other columns do not (the processes; the
    # reduced dtype: test_impl_names_what_ran...); the whole description the combination logged stays in bench.json
    assert [x["impl"] for x in ran] == ["native"] * 2, ran
    assert [x["note"] for x in ran] == ["", "2 processes"], ran
    assert any(line.startswith("backend torch_ddp: 2 process(es)") for line in ran[1]["described"]), ran
    for x in rows[2:]:
        assert x["img_per_s"] == "-" and ("CUDA" in x["note"] or "--nproc" in x["note"]), x
    assert ran[0]["speedup"] == 1.0
    with open(out / "bench.csv") as fh:
        assert len(list(csv.DictReader(fh))) == 3
    assert "| torch_ddp | O0 |" in r.stdout


@pytest.mark.slow
def test_bench_chart_names_the_models_and_the_device(bench):
    out, r, titles = bench
    assert r.returncode == 0, r.stderr
    assert titles == ["kd bench: squeezenet1_1 -> squeezenet1_1, batch 4, 32 px, synthetic data\ncpu"], titles
    saved = json.loads((out / "bench.json").read_text())
    assert saved["setting"] == "squeezenet1_1 -> squeezenet1_1, batch 4, 32 px, synthetic data"
    assert saved["device"] == "cpu"


@pytest.mark.slow
def test_bench_passes_set_to_every_combination(bench):
    out, r, _ = bench
    assert r.returncode == 0, r.stderr
    for combo in ("single_O0", "torch_ddp_O0"):  # every one that ran
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
    common = [*MODELS, "--device", "cpu", "--backends", "single"]
    common += ["--opt", "O0", "-b", "4", "--image-size", "32", "--iters", "2", "--warmup", "1"]
    r = kd_main(
        "bench", *common, "--data", data, "--loader", "gpu", "-j", "0", "--vs-synthetic", "--out", out, "--keep-runs"
    )
    assert r.returncode == 0, r.stderr
    (row,) = json.loads((out / "bench.json").read_text())["rows"]
    assert row["img_per_s"] > 0 and row["synthetic_img_per_s"] > 0, row
    assert row["of_synthetic_pct"] == round(100 * row["img_per_s"] / row["synthetic_img_per_s"], 1)
    on_folder = (out / "runs" / "single_O0" / "config.yaml").read_text()
    assert f"data: {data}" in on_folder and "loader: gpu" in on_folder and "workers: 0" in on_folder
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


def test_a_backend_that_cannot_run_here_is_refused_without_starting_its_runs(tmp_path, monkeypatch):
    """dp on a machine without CUDA: each dp row says what kd train says of it (on the CPU, or with
    --device auto), and no kd train process is started only to be refused."""
    import subprocess

    import torch

    if torch.cuda.is_available():
        pytest.skip("dp runs where CUDA is usable")
    started = []
    run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda cmd, *a, **kw: started.append(cmd) or run(cmd, *a, **kw))
    models = ["--teacher", "resnet18", "--student", "resnet18"]
    for device in ("cpu", "auto"):
        out = tmp_path / device
        args = [*models, "--backends", "dp", "--opt", "O0,O1", "--device", device, "--iters", "1", "--warmup", "1"]
        r = kd_main("bench", *args, "--out", out / "bench")
        assert r.returncode == 0, r.stderr
        rows = json.loads((out / "bench" / "bench.json").read_text())["rows"]
        train = [*models, "--teacher-weights", "none", "--backend", "dp", "--device", device, "--data", "synthetic"]
        said = one_error_line(kd_main("train", *train, "--out", out / "train"))[len("kd: error: ") :]
        assert [(x["img_per_s"], x["note"]) for x in rows] == [("-", said)] * 2, (rows, said)
    assert started == [], started


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


def test_impl_names_what_ran_and_the_note_keeps_what_the_columns_do_not():
    """The precision and backend lines a combination logs (their describe()), as impl and note."""
    from kd.commands.bench import implementation

    assert implementation([]) == ("", "")
    native = "precision O1 (native, float32 weights, autocast to float16, dynamic loss scaling)"
    assert implementation([native, "backend single: 1 process(es), device cuda:0"]) == ("native", "float16")
    ddp = (
        "backend torch_ddp: 4 process(es) over nccl, rank 0, device cuda:0, "
        "find_unused_parameters=True (detected: a student parameter got no gradient)"
    )
    assert implementation([native, ddp]) == ("native", "float16; 4 processes; find_unused_parameters")
    apex = "precision O2 (apex, float16 weights, BatchNorm float32, float32 master weights, dynamic loss scaling)"
    real = (
        "backend apex_ddp: 2 process(es) over nccl, rank 0, device cuda:0, "
        "real apex.parallel.DistributedDataParallel(delay_allreduce=True), parameters contiguous (apex copies ...)"
    )
    assert implementation([apex, real]) == ("apex + apex.parallel", "float16; 2 processes")
    fallback = (
        "precision O1 (native, float32 weights, autocast to bfloat16, no loss scaling, "
        "not apex.amp: NVIDIA apex is not installed)"
    )
    own = (
        "backend apex_ddp: 2 process(es) over gloo, rank 0, device cpu, kd's native delayed all-reduce "
        "(apex.parallel is not importable: No module named 'apex'), sync_bn"
    )
    assert implementation([fallback, own]) == (
        "native + kd all-reduce",
        "bfloat16; 2 processes; not apex.amp: NVIDIA apex is not installed; "
        "apex.parallel is not importable: No module named 'apex'",
    )


def test_bench_chart_title_names_the_setting_and_the_device(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from kd.commands import bench

    args = {"teacher": "resnet101", "student": "resnet18", "batch_size": 256, "image_size": 224, "device": "cpu"}
    assert bench.setting_of(args) == "resnet101 -> resnet18, batch 256, 224 px, synthetic data"
    assert (
        bench.setting_of({**args, "data": "/data/imagenet/"})
        == "resnet101 -> resnet18, batch 256, 224 px, data imagenet"
    )
    assert bench.device_of(args) == "cpu"
    figures = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    row = {**{c: "-" for c in bench.COLUMNS}, "backend": "single", "opt": "O0", "img_per_s": 10.0}
    bench.write_outputs([row], tmp_path, "single O0", setting=bench.setting_of(args), device="NVIDIA H100 80GB HBM3")
    title = figures[-1].axes[0].get_title()
    assert title == "kd bench: resnet101 -> resnet18, batch 256, 224 px, synthetic data\nNVIDIA H100 80GB HBM3"
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["device"] == "NVIDIA H100 80GB HBM3" and saved["setting"].startswith("resnet101 -> resnet18")


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
    common = [*MODELS, "--device", "cpu", "--backends", "single"]
    common += ["--opt", "O0", "-b", "4", "--image-size", "32", "--iters", "3", "--warmup", "1"]
    r = kd_main("bench", *common, "--vs-store", "--top-k", "5", "--out", out, "--keep-runs")
    assert r.returncode == 0, r.stderr
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert [x["teacher"] for x in rows] == [
        "squeezenet1_1 (live)",
        "kd teach",
        "store (top-k 5)",
        "none (--no-teacher)",
    ]
    live, teach, store, alone = rows
    assert all(x["img_per_s"] > 0 for x in rows), rows
    assert store["speedup"] == round(store["img_per_s"] / live["img_per_s"], 2)
    assert store["of_alone_pct"] == round(100 * store["img_per_s"] / alone["img_per_s"], 1)
    assert teach["of_alone_pct"] == "-" and teach["impl"] == "teacher float32"
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
