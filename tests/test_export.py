"""kd's checkpoints where timm and torchvision users look: timm's own checkpoint loader reads a kd
checkpoint, and ``kd export`` writes a plain state dict (.pt or .safetensors) that a strict
torchvision ``load_state_dict`` and timm's ``create_model(checkpoint_path=...)`` take."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import torch
import torchvision
from conftest import kd_main, make_image_folder, one_error_line

TINY = ["--no-teacher", "--image-size", 32, "-b", 8, "-j", 0, "--device", "cpu", "--epochs", 1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A timm student's run and a torchvision student's run, one epoch each, on 3 classes."""
    root = tmp_path_factory.mktemp("export")
    data = make_image_folder(root / "data")
    out = {}
    for name in ("timm:resnet10t", "resnet18"):
        run = root / name.replace(":", "_")
        r = kd_main("train", "--data", data, "--student", name, *TINY, "--out", run)
        assert r.returncode == 0, r.stderr
        out[name] = run
    return out


def student_state(run: Path):
    return torch.load(run / "checkpoints" / "best.pt", weights_only=True)["student"]


def test_timm_loads_a_kd_checkpoint(runs):
    run = runs["timm:resnet10t"]
    ckpt = run / "checkpoints" / "best.pt"
    model = timm.create_model("resnet10t", num_classes=3)
    timm.models.load_checkpoint(model, str(ckpt), strict=True)
    for key, value in student_state(run).items():
        assert torch.equal(model.state_dict()[key], value), key
    made = timm.create_model("resnet10t", num_classes=3, checkpoint_path=str(ckpt))
    assert all(torch.equal(made.state_dict()[k], v) for k, v in student_state(run).items())


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_export_gives_a_plain_state_dict_torchvision_and_timm_load(runs, tmp_path, suffix):
    out = tmp_path / f"resnet18{suffix}"
    r = kd_main("export", runs["resnet18"], "-o", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {out} and {out.with_suffix('.json')} (resnet18, 3 classes)")
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(out))
    else:
        state = torch.load(out, weights_only=True)
    model = torchvision.models.get_model("resnet18", num_classes=3)
    model.load_state_dict(state, strict=True)
    for key, value in student_state(runs["resnet18"]).items():
        assert torch.equal(model.state_dict()[key], value), key
    info = json.loads(out.with_suffix(".json").read_text())
    assert info["model"] == "resnet18" and info["num_classes"] == 3
    assert info["classes"] == ["class_00", "class_01", "class_02"]
    assert info["preprocessing"] == {
        "image_size": 32,
        "resize": 37,
        "interpolation": "bilinear",
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
    }
    timm_out = tmp_path / f"resnet10t{suffix}"
    assert kd_main("export", runs["timm:resnet10t"] / "checkpoints" / "last.pt", "-o", timm_out).returncode == 0
    made = timm.create_model("resnet10t", num_classes=3, checkpoint_path=str(timm_out))
    assert all(torch.equal(made.state_dict()[k], v) for k, v in student_state(runs["timm:resnet10t"]).items())


def test_export_refuses_what_it_cannot_write_in_one_line(runs, tmp_path):
    r = kd_main("export", tmp_path / "nothing", "-o", tmp_path / "w.pt")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"kd: error: {tmp_path / 'nothing'} holds no checkpoint (neither "
        f"{tmp_path / 'nothing' / 'checkpoints' / 'best.pt'} nor {tmp_path / 'nothing' / 'checkpoints' / 'last.pt'})"
    ], r.stderr
    r = kd_main("export", runs["resnet18"], "-o", tmp_path / "w.txt")
    assert r.returncode == 2 and "give a file ending in .pt, .pth, .safetensors" in r.stderr
    assert not list(tmp_path.glob("w.*"))
    # a target that cannot be written (root writes through permission bits: a file as its folder, /proc)
    (tmp_path / "a_file").write_text("")
    line = one_error_line(kd_main("export", runs["resnet18"], "-o", tmp_path / "a_file" / "w.pt"))
    assert line.startswith(f"kd: error: cannot write {tmp_path / 'a_file' / 'w.pt'}: file exists; "), line
    line = one_error_line(kd_main("export", runs["resnet18"], "-o", "/proc/w.safetensors"))
    assert line.startswith("kd: error: cannot write /proc/w.safetensors: no such file or directory; "), line
