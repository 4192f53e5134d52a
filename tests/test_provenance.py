"""RUN/provenance.json (kd.run.provenance): each side's weights as resolved (library, enum member or
timm tag, file, SHA-256), the libraries' versions, kd's version and commit, devices and processes;
one per student's folder; shown by ``kd report --provenance``. Weights are generated files of the
real key sets in temporary caches: nothing is downloaded."""

from __future__ import annotations

import hashlib
import json
import subprocess

import timm
import torch
import torchvision
import torchvision.models as tvm
from conftest import ROOT, kd_main, train_args
from test_offline import place_timm_weights

from kd.run import provenance
from kd.version import __version__


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_named_weights_resolve_to_their_file_and_its_sum(tmp_path, monkeypatch):
    """``pretrained`` of torchvision is its default member, of timm the default tag (which a timm
    release may change): both recorded as resolved, with the file read and its SHA-256."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    folder = tmp_path / "torch" / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save(tvm.resnet18().state_dict(), folder / "resnet18-f37072fd.pth")
    entry = provenance.side("resnet18", "pretrained")
    assert entry == {
        "model": "resnet18",
        "weights": "pretrained",
        "library": "torchvision",
        "name": "ResNet18_Weights.IMAGENET1K_V1",
        "source": "https://download.pytorch.org/models/resnet18-f37072fd.pth",
        "file": str(folder / "resnet18-f37072fd.pth"),
        "sha256": sha(folder / "resnet18-f37072fd.pth"),
    }
    path, _ = place_timm_weights(tmp_path / "hf", "resnet10t", "c3_in1k", revision="ab" * 20)
    entry = provenance.side("timm:resnet10t", "pretrained")
    assert (entry["library"], entry["name"], entry["source"]) == (
        "timm",
        "resnet10t.c3_in1k",
        "hf-hub:timm/resnet10t.c3_in1k",
    )
    assert (entry["revision"], entry["sha256"]) == ("ab" * 20, sha(path))
    assert provenance.side("resnet18", "none") == {"model": "resnet18", "weights": "none", "library": "random init"}
    missing = provenance.side("resnet50", "torchvision:IMAGENET1K_V1")  # a store's teacher, not on this machine
    assert missing["name"] == "ResNet50_Weights.IMAGENET1K_V1" and missing["file"] is None
    gone = provenance.side("resnet18", str(tmp_path / "elsewhere.pt"))
    assert (gone["library"], gone["sha256"]) == ("file", None)


def test_a_run_records_what_it_was_made_of_and_kd_report_shows_it(image_folder, tmp_path):
    weights = tmp_path / "student.pt"
    torch.manual_seed(0)
    torch.save(timm.create_model("resnet10t", num_classes=3).state_dict(), weights)
    out = tmp_path / "run"
    args = dict(teacher="timm:resnet10t", student="timm:resnet10t", student_weights=weights, no_progress=True)
    r = kd_main(*train_args(image_folder, out, **args))
    assert r.returncode == 0, r.stderr
    (part,) = json.loads((out / "provenance.json").read_text())["parts"]
    assert part["student"] == {
        "model": "timm:resnet10t",
        "weights": str(weights),
        "library": "file",
        "file": str(weights.resolve()),
        "sha256": sha(weights),
    }
    assert part["teacher"] == {"model": "timm:resnet10t", "weights": "none", "library": "random init"}
    versions = part["versions"]
    assert versions["torch"] == torch.__version__ and versions["torchvision"] == torchvision.__version__
    assert versions["timm"] == timm.__version__ and "apex" in versions
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert part["kd"]["version"] == __version__ and part["kd"]["checkout"]["commit"] == head
    assert part["kd"]["checkout"]["dirty"] in (True, False)
    assert (part["devices"], part["processes"], part["backend"]) == (["cpu"], 1, "single")

    r = kd_main("report", out, "--provenance")
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith(f"| {out} | random init |"))
    assert f"| file student.pt sha256 {sha(weights)[:12]} |" in row, row
    assert f"torch {torch.__version__} torchvision {torchvision.__version__} timm {timm.__version__}" in row
    assert f"| {__version__} ({head[:10]}" in row and "| cpu | 1 (single) |" in row, row

    r = kd_main("train", "--out", out, "--resume", "--epochs", "2", "--no-progress")
    assert r.returncode == 0, r.stderr
    parts = json.loads((out / "provenance.json").read_text())["parts"]
    assert len(parts) == 2 and parts[1]["student"] == parts[0]["student"]
    r = kd_main("report", out, "--provenance")
    assert "| 1 (single); 2 parts |" in r.stdout, r.stdout


def test_each_student_of_a_run_has_its_own(image_folder, tmp_path):
    out = tmp_path / "table"
    args = dict(teacher="timm:resnet10t", student="timm:resnet10t", kd_loss="kd,dkd", limit_train_batches=1)
    r = kd_main(*train_args(image_folder, out, **args, no_progress=True))
    assert r.returncode == 0, r.stderr
    for name in ("kd", "dkd"):
        (part,) = json.loads((out / name / "provenance.json").read_text())["parts"]
        assert part["student"]["library"] == "random init" and part["processes"] == 1


def test_a_run_of_an_older_kd_is_said_to_have_none(teacher_run, tmp_path):
    import shutil

    _, out = teacher_run
    old = tmp_path / "old"
    shutil.copytree(out, old)
    (old / "provenance.json").unlink()
    r = kd_main("report", old, "--provenance")
    assert r.returncode == 0, r.stderr
    assert f"{old}: no provenance.json (a run of an older kd)" in r.stderr
    assert f"| {old} | - | - |" in r.stdout


def test_checkout_reads_a_worktrees_head(tmp_path):
    """kd's commit is read from .git without running git: a worktree's ``gitdir:`` file and packed refs."""
    common = tmp_path / "repo.git"
    (common / "worktrees" / "wt").mkdir(parents=True)
    (common / "HEAD").write_text("ref: refs/heads/main\n")
    (common / "packed-refs").write_text("# pack-refs with: peeled\n" + "c" * 40 + " refs/heads/topic\n")
    wt_git = common / "worktrees" / "wt"
    (wt_git / "HEAD").write_text("ref: refs/heads/topic\n")
    (wt_git / "commondir").write_text("../..\n")
    checkout = tmp_path / "wt"
    checkout.mkdir()
    (checkout / ".git").write_text(f"gitdir: {wt_git}\n")
    assert provenance.checkout(checkout)["commit"] == "c" * 40
    assert provenance.checkout(tmp_path / "elsewhere") is None


def test_a_sums_file_a_write_was_replacing_is_not_taken_for_the_files_sum(tmp_path):
    """Beside a checkpoint whose replacement was cut short, NAME.sha256 lists the new sum and the old:
    the file holds the old one, and its provenance says the sum of what it holds."""
    import hashlib

    import torch

    from kd.run.provenance import sha256
    from kd.utils.checkpoint_io import _write_sums, save_atomic

    path = tmp_path / "best.pt"
    old = save_atomic({"a": torch.zeros(3)}, path)
    _write_sums(path, ["f" * 64, old])  # what a kill between the two renames of a write leaves
    assert sha256(path) == old == hashlib.sha256(path.read_bytes()).hexdigest()
