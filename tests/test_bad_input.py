"""Every bad input ends with one clear line on stderr, exit code 2, and no change to existing files.

Every case runs through the console script's body in this process; a few, one per layer that
refuses (click, kd.config, the weights loader, kd eval), also in a fresh ``kd`` process."""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, kd_main, make_image_folder, run_kd

BASE = ["--image-size", "32", "-b", "8", "-j", "0", "--epochs", "1", "--device", "cpu"]


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/kd-pwned",))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Data, a finished run, and assorted broken files, shared by the cases."""
    root = tmp_path_factory.mktemp("bad")
    data = make_image_folder(root / "data")
    (root / "empty" / "train").mkdir(parents=True)
    (root / "empty" / "val").mkdir(parents=True)
    mismatch = make_image_folder(root / "mismatch", classes=3)
    (mismatch / "val" / "class_02").rename(mismatch / "val" / "other")
    oneempty = make_image_folder(root / "oneempty", classes=2)
    (oneempty / "train" / "class_02").mkdir()
    (oneempty / "val" / "class_02").mkdir()
    noimg = root / "noimg"
    for split in ("train", "val"):
        (noimg / split / "a").mkdir(parents=True)
        (noimg / split / "a" / "readme.txt").write_text("not an image")
    (root / "bad.yaml").write_text("epochs: [1, 2\n")
    (root / "unknown.yaml").write_text("epochz: 3\n")
    (root / "list.yaml").write_text("- 1\n- 2\n")
    (root / "wrongtype.yaml").write_text("epochs: one\n")
    torch.save({"conv1.weight": torch.zeros(3)}, root / "wrong.pt")
    torch.save({"conv1.weight": torch.zeros(3)}, root / "legacy.pth", _use_new_zipfile_serialization=False)
    (root / "garbage.pt").write_bytes(b"this is not a checkpoint")
    with open(root / "evil.pt", "wb") as fh:
        pickle.dump({"state_dict": Evil()}, fh)
    run = root / "run"
    r = kd_main(
        "train",
        "--data",
        data,
        "--teacher",
        "resnet18",
        "--teacher-weights",
        "none",
        "--student",
        "resnet18",
        "--out",
        run,
        *BASE,
    )
    assert r.returncode == 0, r.stderr
    return root


def snapshot(root: Path):
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def T(*extra, data="data", out="new"):
    return [
        "train",
        "--data",
        f"{{root}}/{data}",
        "--teacher",
        "resnet18",
        "--teacher-weights",
        "none",
        "--student",
        "resnet18",
        "--out",
        f"{{root}}/{out}",
        *BASE,
        *extra,
    ]


def UNNAMED(weights):
    """A run whose teacher is named by its --teacher-weights alone (a kd checkpoint names its model)."""
    args = ["train", "--data", "{root}/data", "--teacher-weights", weights, "--student", "resnet18"]
    return args + ["--out", "{root}/new", *BASE]


CASES = {
    "unknown option": (T("--frobnicate"), "no such option"),
    "unknown student": (
        ["train", "--data", "{root}/data", "--teacher", "resnet18", "--student", "resnet1B", "--out", "{root}/new"],
        "did you mean",
    ),
    "unknown timm model": (T("--student", "timm:notamodel"), "unknown timm model"),
    "unknown teacher": (T("--teacher", "vgg99"), "unknown torchvision model"),
    "missing data": (T(data="nowhere"), "does not exist"),
    "empty data": (T(data="empty"), "no class folders"),
    "no images": (T(data="noimg"), "no images"),
    "class mismatch": (T(data="mismatch"), "different classes"),
    "an empty class": (T(data="oneempty"), "class folders with no image"),
    "missing student": (
        ["train", "--data", "{root}/data", "--teacher", "resnet18", "--out", "{root}/new"],
        "--student is required",
    ),
    "bad opt level": (T("--opt", "O7"), "O7"),
    "bad number": (T("--epochs", "many"), "many"),
    "zero epochs": (T("--epochs", "0"), "--epochs must be at least 1"),
    "unknown recipe": (T("--recipe", "imagenet/nope"), "no recipe"),
    "broken recipe yaml": (T("--recipe", "{root}/bad.yaml"), "not valid YAML"),
    "unknown recipe key": (T("--recipe", "{root}/unknown.yaml"), "unknown option 'epochz'"),
    "recipe not a mapping": (T("--recipe", "{root}/list.yaml"), "must be a mapping"),
    "recipe value of the wrong type": (
        T("--recipe", "{root}/wrongtype.yaml"),
        "option 'epochs' must be an integer, got 'one' in recipe",
    ),
    "no-teacher with a teacher": (T("--no-teacher", "--teacher", "resnet50"), "conflicts with --teacher resnet50"),
    "save every 0 steps": (T("--save-every-steps", "0"), "--save-every-steps must be at least 1"),
    "out where no folder can be made": (T("--out", "/proc/kd-test/run"), "/proc takes no new folders"),
    "out under a file": (T("--out", "{root}/bad.yaml/run"), "is a file, not a folder"),
    "unknown --set key": (T("--set", "lrr=0.1"), "unknown option 'lrr'"),
    "--set without =": (T("--set", "lr"), "key=value"),
    "unknown kd loss": (T("--kd-loss", "kdd"), "unknown KD loss"),
    "unknown loss arg": (T("--loss-arg", "gamma=2"), "no hyper-parameter gamma"),
    "unknown backend": (T("--backend", "horovod"), "unknown backend"),
    "unknown loader": (T("--loader", "dali"), "unknown loader 'dali'"),
    "weights do not fit": (T("--teacher-weights", "{root}/wrong.pt"), "do not fit"),
    "weights missing": (T("--teacher-weights", "{root}/nope.pt"), "does not exist"),
    # without --teacher the file must name the model: what is wrong with it is said, not "--teacher is required"
    "teacher weights alone, missing": (UNNAMED("{root}/nope.pt"), "weights file {root}/nope.pt does not exist"),
    "teacher weights alone, garbage": (UNNAMED("{root}/garbage.pt"), "cannot read weights file {root}/garbage.pt"),
    "teacher weights alone, not kd's": (UNNAMED("{root}/wrong.pt"), "not a kd checkpoint, so it names no model"),
    # torch's legacy format cannot be memory-mapped: read whole, not called damaged
    "teacher weights alone, legacy": (UNNAMED("{root}/legacy.pth"), "legacy.pth is not a kd checkpoint"),
    "weights garbage": (T("--teacher-weights", "{root}/garbage.pt"), "cannot read weights"),
    "malicious pickle": (T("--teacher-weights", "{root}/evil.pt"), "refuses"),
    "resume nothing": (T("--resume", out="fresh"), "nothing to resume"),
    "resume garbage": (T("--resume", "{root}/garbage.pt"), "cannot load checkpoint"),
    "out holds a run": (T(out="run"), "already holds a run"),
    "resume and overwrite": (T("--resume", "--overwrite", out="run"), "contradict"),
    "overwrite, then a failed start": (
        T("--overwrite", "--teacher-weights", "{root}/wrong.pt", out="run"),
        "do not fit",
    ),
    "cuda without cuda": (T("--device", "cuda"), "CUDA"),
    "gpus on cpu": (T("--gpus", "0"), "--gpus needs --device cuda"),
    "alpha out of range": (T("--alpha", "1.5"), "--alpha must be between 0 and 1"),
    "cpu decode share out of range": (T("--cpu-decode-share", "1.5"), "--cpu-decode-share must be between 0 and 1"),
    "negative val cache": (T("--val-cache-gb", "-1"), "--val-cache-gb must be 0 or more"),
    "alpha for another method": (T("--kd-loss", "dkd", "--alpha", "1"), "tckd_weight"),
    "former and current loss arg": (
        T("--kd-loss", "dkd", "--loss-arg", "beta=1", "--loss-arg", "nckd_weight=1"),
        "not both",
    ),
    "negative ce weight": (T("--ce-weight", "-1"), "--ce-weight must be 0 or more"),
    "label smoothing out of range": (T("--label-smoothing", "1"), "--label-smoothing must be in [0, 1)"),
    "temperature without one": (T("--kd-loss", "at", "-T", "2"), "KD loss 'at' has no temperature"),
    "standardisation without the switch": (
        T("--kd-loss", "nkd", "--logit-standardisation"),
        "KD loss 'nkd' has no standardisation switch; the methods with it: ctdkd, ctkd, dkd, kd, mlkd",
    ),
    "one image a step with BatchNorm": (T("-b", "1"), "BatchNorm layers, which need more than one value per channel"),
    "one image a step with MLKD": (T("-b", "1", "--kd-loss", "mlkd"), "use --batch-size 2 or more"),
    "num classes mismatch": (T("--num-classes", "7"), "class folders"),
    "ema decay out of range": (T("--model-ema", "--model-ema-decay", "1"), "--model-ema-decay must be in [0, 1)"),
    "drop path out of range": (T("--drop-path", "1"), "--drop-path must be in [0, 1)"),
    "drop path on a model without it": (T("--drop-path", "0.1"), "--drop-path: resnet18 has no stochastic depth"),
    "export the average of a run without one": (
        ["export", "{root}/run", "-o", "{root}/w.pt", "--ema"],
        "holds no moving average of the weights",
    ),
    "no-teacher with dkd": (T("--no-teacher", "--kd-loss", "dkd"), "conflicts"),
    "mixup for a method of one target class": (T("--kd-loss", "dkd", "--mixup", "0.8"), "no one target class"),
    "features from a store": (T("--kd-loss", "at", "--soft-labels", "{root}/store"), "needs the teacher's features"),
    "fp16 on cpu": (T("--opt", "O1", "--amp-dtype", "float16"), "float16 needs CUDA"),
    "eval missing weights": (
        ["eval", "--model", "resnet18", "--weights", "{root}/nope.pt", "--data", "{root}/data", "--device", "cpu"],
        "does not exist",
    ),
    "eval without val": (
        ["eval", "--model", "resnet18", "--weights", "none", "--data", "{root}/empty/train", "--device", "cpu"],
        "no val/",
    ),
}
if torch.cuda.is_available():
    CASES.pop("cuda without cuda")


IN_A_FRESH_PROCESS = ["unknown option", "zero epochs", "weights do not fit", "eval without val"]


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_one_line_exit_2_nothing_lost(world, name):
    check(world, name, kd_main)


@pytest.mark.parametrize("name", IN_A_FRESH_PROCESS)
def test_bad_input_from_the_console_script(world, name):
    check(world, name, run_kd)


def check(world, name, runner):
    args, expected = CASES[name]
    before = snapshot(world)
    r = runner(*[a.format(root=world) for a in args])
    lines = [
        line
        for line in r.stderr.splitlines()
        if line.strip() and "Warning" not in line and not line.startswith("  ")  # a warning's source line
    ]
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("kd: error: "), r.stderr
    assert expected.format(root=world).lower() in lines[0].lower(), lines[0]
    assert snapshot(world) == before, "an existing file changed"
    assert not (world / "new").exists(), "a failed start left its --out folder behind"
    assert not Path("/tmp/kd-pwned").exists()


#: the mistakes kd answers before torch is imported: paths, and options that contradict each other
BEFORE_TORCH = ["missing data", "empty data", "no images", "class mismatch", "an empty class", "out holds a run"]
BEFORE_TORCH += ["out under a file", "no-teacher with a teacher", "zero epochs", "unknown recipe key", "gpus on cpu"]
BEFORE_TORCH += ["mixup for a method of one target class", "features from a store"]  # the methods' cards

#: cli.main in a fresh interpreter; then whether torch was imported, on stdout
MAIN_THEN_TORCH = (
    "import sys, cli; code = cli.main(sys.argv[1:]); print('torch' in sys.modules, end=''); sys.exit(code)"
)


@pytest.mark.parametrize("name", BEFORE_TORCH)
def test_a_mistaken_path_or_option_is_answered_before_torch_is_imported(world, name):
    args, expected = CASES[name]
    r = subprocess.run(
        [sys.executable, "-c", MAIN_THEN_TORCH, *[a.format(root=world) for a in args]],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and r.stderr.startswith("kd: error: ") and len(r.stderr.splitlines()) == 1, r.stderr
    assert expected.lower() in r.stderr.lower(), r.stderr
    assert r.stdout == "False", "torch was imported before the mistake was answered"
