"""kd installs ``backends`` and ``cli`` beside ``kd`` under those plain names: another package of
such a name, first on ``sys.path`` or installed by another distribution, is refused in one line
that says where it came from and what to do (kd.siblings)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HANG_GUARD

from kd.siblings import own

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ["train", "--data", "synthetic", "--student", "resnet18", "--no-teacher", "--device", "cpu"]


#: what the ``kd`` console script runs (setup.cfg's entry point)
CONSOLE_SCRIPT = "from kd.siblings import run_cli; run_cli()"


def kd_from(folder: Path, *args: str, path: str = "") -> subprocess.CompletedProcess:
    """``kd ARGS`` started in ``folder``, which comes first on sys.path, with kd from this checkout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (path, str(ROOT)) if p)}
    return subprocess.run(
        [sys.executable, "-c", CONSOLE_SCRIPT, *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
    )


def test_kds_own_are_its_own():
    assert own("backends").BACKENDS.names() and own("cli").RUN_COMMANDS


def test_a_foreign_backends_first_on_sys_path_is_one_line(tmp_path):
    (tmp_path / "backends").mkdir()
    (tmp_path / "backends" / "__init__.py").write_text('"""Another project\'s backends."""\n')
    r = kd_from(tmp_path, *TRAIN)
    where = tmp_path / "backends" / "__init__.py"
    assert (r.returncode, r.stderr) == (
        2,
        f"kd: error: Python imports 'backends' from {where}, not kd's own (it comes first on sys.path); "
        f"rename or move it, or run kd from another folder\n",
    )


def test_a_backends_installed_by_another_distribution_names_it(tmp_path):
    site = tmp_path / "site"
    (site / "backends").mkdir(parents=True)
    (site / "backends" / "__init__.py").write_text("")
    info = site / "otherpkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: otherpkg\nVersion: 1.0\n")
    (info / "RECORD").write_text("backends/__init__.py,,\notherpkg-1.0.dist-info/METADATA,,\n")
    r = kd_from(tmp_path, *TRAIN, path=str(site))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"kd: error: Python imports 'backends' from {site / 'backends' / '__init__.py'}, ")
    assert "which otherpkg installed, not kd" in r.stderr and "pip uninstall otherpkg, then reinstall kd" in r.stderr


@pytest.mark.parametrize("command", [["backends"], ["--help"]])
def test_a_foreign_cli_first_on_sys_path_is_one_line(tmp_path, command):
    (tmp_path / "cli.py").write_text("def run():\n    print('another project')\n")
    r = kd_from(tmp_path, *command)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (
        f"kd: error: Python imports 'cli' from {tmp_path / 'cli.py'}, not kd's own (it comes first on sys.path); "
        f"rename or move it, or run kd from another folder\n"
    )


def test_the_console_script_is_kds_command_line(tmp_path):
    assert "kd = kd.siblings:run_cli" in (ROOT / "setup.cfg").read_text()
    r = kd_from(tmp_path, "recipes", "list")
    assert r.returncode == 0 and "r34_r18_kd" in r.stdout, r.stderr
