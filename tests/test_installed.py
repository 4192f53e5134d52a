"""torch and torchvision as installed (kd.utils.installed): a pair that cannot work together is one line and
exit code 2 before torchvision is imported, not the 50-line ``torchvision::nms`` traceback."""

from __future__ import annotations

import torch
from conftest import ROOT, kd_main, make_image_folder, one_error_line, run_kd

from kd.utils.installed import mismatch, version_of


def test_a_cpu_torch_beside_a_cuda_torchvision_is_named_with_what_to_install():
    assert mismatch("2.13.0+cpu", "0.28.0+cu128") == (
        "torchvision 0.28.0+cu128 does not work with torch 2.13.0+cpu: it is the CUDA 12.8 build beside "
        "torch's CPU build; install the pair from one index: pip install --force-reinstall torch==2.13.0 "
        "torchvision==0.28.* --index-url https://download.pytorch.org/whl/cpu"
    )
    assert "another release than torch 2.14's (0.29)" in mismatch("2.14.1+cu130", "0.28.0+cu130")
    assert "add --index-url" in mismatch("2.14.1+cu130", "0.28.0+cu130")  # a CUDA torch: PyPI's pair
    for torch_version, vision_version in [
        ("2.14.1+cu130", "0.29.1+cu130"),
        ("2.13.0", "0.28.0"),
        ("2.13.0+cpu", "0.28.1+cpu"),
        ("2.14.0a0+git5c48869", "0.29.0a0+1f1a920"),  # built from source: tags of commits
    ]:
        assert mismatch(torch_version, vision_version) is None, (torch_version, vision_version)


def test_kd_names_a_mismatched_pair_in_one_line_before_importing_torchvision(tmp_path):
    """A torchvision that fails on import as a CUDA build beside a CPU torch does, found first on the path."""
    fake = tmp_path / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    (fake / "version.py").write_text("__version__ = '0.20.0+cu999'\ngit_version = 'x'\n")
    r = run_kd("recipes", "list", env={"PYTHONPATH": f"{tmp_path}:{run_kd.__globals__['ROOT']}"})
    line = one_error_line(r)
    assert line.startswith(f"kd: error: torchvision 0.20.0+cu999 does not work with torch {version_of('torch')}"), line
    assert "pip install --force-reinstall torch==" in line and "nms" not in r.stderr, r.stderr


def test_the_stated_torch_minimum_is_the_one_kd_checks(tmp_path, monkeypatch):
    """setup.cfg's torch>= is kd's MIN_TORCH, and an older torch gets one line, not a traceback later."""
    import configparser

    from kd.version import MIN_TORCH

    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    pins = [line.strip() for line in setup["options"]["install_requires"].splitlines() if line.startswith("torch>=")]
    assert pins == [f"torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}"]
    monkeypatch.setattr(torch, "__version__", "2.3.1+cpu")
    data = make_image_folder(tmp_path / "data", classes=2, train_per_class=2, val_per_class=1, size=(16, 16))
    r = kd_main("train", "--data", data, "--no-teacher", "--student", "resnet18", "--out", tmp_path / "old")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "kd: error: kd needs torch 2.4 or newer, this is torch 2.3.1+cpu: pip install 'torch>=2.4'"
    ], r.stderr
    assert not (tmp_path / "old").exists()
