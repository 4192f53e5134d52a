"""Several students in one run (kd.run.students): bit for bit equal to separate runs, a non-finite student
stopped alone, shared settings enforced, a line each at the end; resume, and what it says where there
is nothing to resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TINY_RUN, kd_main, last_checkpoint, make_image_folder, train_args
from tiny import DROP_RUN

import kd
from kd import config as kd_config
from kd.errors import KDError
from kd.run import students as multi
from kd.run.jobs import TrainJob
from kd.run.launch import train as launch
from kd.run.students import for_command


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(
        tmp_path_factory.mktemp("students"), classes=3, train_per_class=4, val_per_class=2, size=(20, 16)
    )


def options(data, out, **kw):
    return {**DROP_RUN, "data": str(data), "out": str(out), **kw}


def test_students_together_equal_separate_runs_bit_for_bit(data, tmp_path):
    students = multi.plan([], options(data, tmp_path / "table", kd_loss="kd,dkd"), [])
    assert students.names == ("kd", "dkd")
    launch(TrainJob(students))
    for method in ("kd", "dkd"):
        kd.train(kd_config.resolve(options=options(data, tmp_path / "alone" / method, kd_loss=method)))
        together, alone = last_checkpoint(tmp_path / "table" / method), last_checkpoint(tmp_path / "alone" / method)
        assert together["global_step"] == alone["global_step"] == 3
        for key, value in alone["student"].items():
            assert torch.equal(together["student"][key], value), (method, key)
        assert torch.equal(together["rng"]["0"]["torch"], alone["rng"]["0"]["torch"])  # its own dropout masks
        records = [
            json.loads(line) for line in (tmp_path / "table" / method / "metrics.jsonl").read_text().splitlines()
        ]
        assert records[0]["teacher_top1"] >= 0 and "val_top1" in records[0]
        saved = yaml.safe_load((tmp_path / "table" / method / "config.yaml").read_text())
        assert saved["kd_loss"] == method and saved["out"] == str(tmp_path / "table" / method)
    assert yaml.safe_load((tmp_path / "table" / "students.yaml").read_text()) == {"students": ["kd", "dkd"]}

    # --resume on the parent folder continues every student from its own last.pt
    kd.train({"out": str(tmp_path / "table"), "epochs": 2}, resume="last")
    for method in ("kd", "dkd"):
        records = (tmp_path / "table" / method / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["epoch"] for line in records] == [1, 2]


def test_students_on_one_mixed_batch_equal_their_separate_runs(data, tmp_path):
    """--mixup and --cutmix: every student of a run trains on the one mixed batch the teacher forwarded,
    bit for bit as it trains alone (the draw is the step's, not the students' own generators')."""
    mixing = dict(mixup=0.8, cutmix=1.0)
    launch(TrainJob(multi.plan([], options(data, tmp_path / "table", kd_loss="kd,dist", **mixing), [])))
    for method in ("kd", "dist"):
        kd.train(kd_config.resolve(options=options(data, tmp_path / "alone" / method, kd_loss=method, **mixing)))
        together, alone = last_checkpoint(tmp_path / "table" / method), last_checkpoint(tmp_path / "alone" / method)
        assert together["global_step"] == alone["global_step"] == 3
        for key, value in alone["student"].items():
            assert torch.equal(together["student"][key], value), (method, key)


@pytest.mark.parametrize("methods", ["kd,fitnet", "kd,at", "kd,crd"])
def test_a_feature_student_after_another_equals_its_separate_run(data, tmp_path, methods):
    """A feature method's connectors (and CRD's memory) are drawn from its own seed, not from where the
    RNG stood after the student that built the shared teacher."""
    layers = {} if "crd" in methods else dict(feature_layers=["body.2"])
    launch(TrainJob(multi.plan([], options(data, tmp_path / "table", kd_loss=methods, **layers), [])))
    for method in methods.split(","):
        kd.train(kd_config.resolve(options=options(data, tmp_path / "alone" / method, kd_loss=method, **layers)))
        together, alone = last_checkpoint(tmp_path / "table" / method), last_checkpoint(tmp_path / "alone" / method)
        assert together["global_step"] == alone["global_step"] == 3
        assert alone["loss"] or method not in ("fitnet", "crd")  # connectors (and CRD's memory) are in the checkpoint
        for part in ("student", "loss"):
            assert together[part].keys() == alone[part].keys()
            for key, value in alone[part].items():
                assert torch.equal(together[part][key], value), (method, part, key)


def test_a_diverging_student_stops_alone(data, tmp_path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump({"kd_loss": "kd", "lr": 0.05}))
    bad.write_text(yaml.safe_dump({"kd_loss": "dkd", "lr": 1e30}))
    shared = {k: v for k, v in options(data, tmp_path / "table", max_nonfinite_steps=1, epochs=2).items() if k != "lr"}
    students = multi.plan([str(good), str(bad)], shared, [])
    with pytest.raises(KDError, match=r"student bad stopped: the loss was not finite .*\(completed: good\)"):
        launch(TrainJob(students))
    records = [json.loads(line) for line in (tmp_path / "table" / "good" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]
    # --resume with more epochs continues the student that trained and leaves the stopped one stopped
    with pytest.raises(KDError, match=r"student bad stopped: the loss was not finite .*\(completed: good\)"):
        kd.train({"out": str(tmp_path / "table"), "epochs": 3}, resume="last")
    records = [json.loads(line) for line in (tmp_path / "table" / "good" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3]


def test_students_must_agree_on_what_they_share(data, tmp_path):
    """The refusal names only the keys that differ, in kd train's words (on/off, auto), each with the
    option that makes them one (not Python's False and None, not every shared key)."""
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(yaml.safe_dump({"kd_loss": "kd", "batch_size": 8, "lr": 0.1, "compile": False}))
    b.write_text(yaml.safe_dump({"kd_loss": "dist", "batch_size": 16, "lr": 0.2, "compile": None}))
    with pytest.raises(KDError) as refused:
        multi.plan([str(a), str(b)], {k: v for k, v in options(data, tmp_path / "t").items() if k != "batch_size"}, [])
    assert str(refused.value) == (
        "the students of one run share what they train on, and these differ: --batch-size (a: 8, b: 16): give one "
        "--batch-size; --compile (a: off, b: auto): give --compile or --no-compile (each student keeps its own "
        "model, method and optimisation)"
    )
    with pytest.raises(KDError, match="not both"):
        multi.plan([str(a), str(b)], options(data, tmp_path / "t", kd_loss="kd,dkd"), [])


def test_students_validated_on_other_crops_are_refused_unless_one_val_resize_is_given(data, tmp_path):
    """The val loader makes one set of crops for every student (the first's resize and interpolation): a
    student whose own would differ (timm's test_mambaout: crop_pct 1.0, bicubic, beside test_resnet's 0.95,
    bilinear) would be logged and reported as validated on crops it was not; refused before any work, and
    trained once --val-resize and val_interpolation make them one."""
    a, b = tmp_path / "resnet.yaml", tmp_path / "mambaout.yaml"
    a.write_text(yaml.safe_dump({"student": "timm:test_resnet", "kd_loss": "kd"}))
    b.write_text(yaml.safe_dump({"student": "timm:test_mambaout", "kd_loss": "kd"}))
    shared = dict(options(data, tmp_path / "t"), teacher="timm:test_resnet", teacher_weights="none")
    shared.pop("student", None)
    with pytest.raises(KDError) as refused:
        launch(TrainJob(multi.plan([str(a), str(b)], shared, [])))
    assert str(refused.value) == (
        "the students of one run are validated on one set of crops, and theirs differ: resnet: resize 16, "
        "bilinear; mambaout: resize 16, bicubic; give --val-resize and --set val_interpolation=... to validate "
        "them alike, or train them in separate runs"
    )
    assert not (tmp_path / "t").exists()
    alike = multi.plan([str(a), str(b)], dict(shared, val_resize=18, val_interpolation="bicubic"), [])
    launch(TrainJob(alike))
    assert (tmp_path / "t" / "mambaout" / "metrics.jsonl").is_file()


def test_a_recipe_for_one_method_gives_the_others_their_defaults(data, tmp_path):
    students = multi.plan(["imagenet/r34_r18_kd"], options(data, tmp_path / "t", kd_loss="kd,dkd,dist,lskd"), [])
    cfgs = dict(zip(students.names, students.cfgs))
    assert cfgs["kd"].loss_args["kd_weight"] == 0.5
    assert "kd_weight" not in cfgs["dkd"].loss_args and cfgs["dkd"].batch_size == 4


def test_the_command_line_trains_a_table_and_resumes_it(data, tmp_path):
    out = tmp_path / "table"
    net = "timm:kd_drop_net"
    options = dict(teacher=net, student=net, kd_loss="kd,dkd", image_size=16, batch_size=4, limit_train_batches=2)
    args = train_args(data, out, limit_val_batches=1, no_progress=True, **options)
    r = kd_main(*args)
    assert r.returncode == 0, r.stderr
    assert "[kd] epoch 1/1" in r.stderr and "[dkd] epoch 1/1" in r.stderr
    setups = set()
    for name in ("kd", "dkd"):
        records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert [rec["epoch"] for rec in records] == [1]
        assert yaml.safe_load((out / name / "config.yaml").read_text())["kd_loss"] == name
        setups.add(records[0]["startup_setup_s"])
    assert len(setups) == 1, setups  # every student's first step counts from the command, set-up shared
    table = kd_main("report", out)
    assert table.returncode == 0 and "| kd |" in table.stdout and "| dkd |" in table.stdout, table.stdout
    args[args.index("--epochs") + 1] = "2"
    wrong = list(args)
    wrong[wrong.index("kd,dkd")] = "kd,dist"
    r = kd_main(*wrong, "--resume")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"kd: error: --resume continues the students --out {out} holds (kd, dkd), not kd, dist; "
        "leave out --recipe and --kd-loss, or name the same ones"
    ], r.stderr
    r = kd_main(*args, "--resume")  # the same command again, with --resume and more epochs
    assert r.returncode == 0, r.stderr
    for name in ("kd", "dkd"):
        assert [json.loads(line)["epoch"] for line in (out / name / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_several_students_end_with_a_line_each(image_folder, tmp_path):
    out = tmp_path / "table"
    args = dict(teacher="timm:resnet10t", student="timm:resnet10t", kd_loss="kd,dkd", limit_train_batches=1)
    r = kd_main(*train_args(image_folder, out, **args, no_progress=True))
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


def test_apex_ddp_with_several_students_takes_native_amp_where_apex_amp_is_installed(data, tmp_path, monkeypatch):
    """apex_ddp prefers apex.amp with --amp-impl auto, but apex.amp holds one model per process:
    several students run native torch.amp instead of stopping. (apex.amp is stood in for here:
    it needs CUDA; the GPU tests run the real one alone.)"""
    from kd.precision import apex as apex_amp

    class Chosen(Exception):
        pass

    def chosen(*args, **kwargs):
        raise Chosen("apex.amp was chosen")

    monkeypatch.setattr(apex_amp, "unavailable", lambda cfg, device: None)
    monkeypatch.setattr(apex_amp, "ApexAmpPrecision", chosen)
    opts = options(data, tmp_path / "table", kd_loss="kd,dkd", backend="apex_ddp", nproc=1, opt="O1")
    opts.update(amp_dtype="bfloat16")
    launch(TrainJob(multi.plan([], opts, [])))
    for name in ("kd", "dkd"):
        assert (tmp_path / "table" / name / "checkpoints" / "last.pt").is_file()
    with pytest.raises(Chosen, match="apex.amp was chosen"):  # one student: apex_ddp's wish holds
        kd.train(kd_config.resolve(options={**opts, "kd_loss": "kd", "out": str(tmp_path / "alone")}))


#: one tiny student alone, two steps an epoch (the resolution of a command's students)
ALONE = {**TINY_RUN, "limit_train_batches": 2, "progress_bar": False}


def epochs(out: Path):
    return [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_kd_train_resumes_from_python_as_the_command_line_does(data, tmp_path, capsys):
    """The dict of options of a resume is applied to the run's saved config (no data or models
    given again), as ``kd train --out OUT --resume --epochs 2`` does; a finished run says so and
    trains nothing."""
    out = tmp_path / "run"
    kd.train({**ALONE, "data": str(data), "out": str(out), "epochs": 1})
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
        kd.train({**ALONE, "data": str(data), "out": str(tmp_path / "r")}, resume="last", overwrite=True)
    with pytest.raises(KDError, match="nothing to resume: .* does not exist"):
        kd.train({**ALONE, "data": str(data), "out": str(tmp_path / "r")}, resume="last")


def test_the_students_of_a_command(data, tmp_path):
    """One student alone is its run folder; a comma list of methods plans one student each below
    --out; each names the checkpoint it continues from only when resuming."""
    alone = for_command([], {**ALONE, "data": str(data), "out": str(tmp_path / "a")})
    assert alone.names == ("a",) and not alone.grouped and not alone.resuming
    assert alone.folders() == [tmp_path / "a"]
    several = for_command([], {**ALONE, "data": str(data), "out": str(tmp_path / "t"), "kd_loss": "kd,dkd"})
    assert several.names == ("kd", "dkd") and several.grouped
    assert several.folders() == [tmp_path / "t", tmp_path / "t" / "kd", tmp_path / "t" / "dkd"]
    assert [c.kd_loss for c in several.cfgs] == ["kd", "dkd"]
