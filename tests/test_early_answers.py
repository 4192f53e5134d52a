"""Mistakes answered before torch is imported: KD method names, model names (from the libraries'
lists kept per installed version), weights files, and CUDA asked for where none can exist."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, train_args

import kd.losses
from kd.errors import KDError
from kd.losses import LOSSES

# kd.utils.model_names and placement's why_no_cuda are imported in the tests of them: the tests of the
# command line also run against a kd that has neither

#: cli.main in a fresh interpreter; then whether torch was imported, on stdout
MAIN_THEN_TORCH = (
    "import sys, cli; code = cli.main(sys.argv[1:]); print('torch' in sys.modules, end=''); sys.exit(code)"
)


def kd_then_torch(*args, env=None) -> subprocess.CompletedProcess:
    """``kd ARGS`` in a fresh interpreter; stdout says whether torch was imported by its end."""
    return subprocess.run(
        [sys.executable, "-c", MAIN_THEN_TORCH, *map(str, args)],
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )


def error_line(r) -> str:
    """The one ``kd: error:`` line of a run refused as a user error (exit code 2)."""
    assert r.returncode == 2 and r.stderr.startswith("kd: error: ") and len(r.stderr.splitlines()) == 1, r.stderr
    return r.stderr.strip()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty XDG cache folder, for this process and the ones it starts."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder))
    return folder


def test_an_unknown_kd_method_is_answered_with_near_names_before_torch(image_folder, tmp_path):
    r = kd_then_torch(*train_args(image_folder, tmp_path / "run", kd_loss="dkdd"))
    assert "unknown KD loss 'dkdd' (did you mean dkd" in error_line(r)
    assert r.stdout == "False", "torch was imported before the method was refused"


def test_an_unknown_method_is_answered_before_a_teachers_checkpoint_is_read(image_folder, tmp_path):
    """A kd checkpoint as --teacher-weights names the teacher; reading it takes torch: a mistyped
    method is answered first."""
    weights = tmp_path / "teacher.pt"
    weights.write_bytes(b"a checkpoint kd would read with torch")
    r = kd_then_torch(
        *train_args(image_folder, tmp_path / "run", kd_loss="dkdd", teacher=None, teacher_weights=weights)
    )
    assert "unknown KD loss 'dkdd'" in error_line(r)
    assert r.stdout == "False", "torch was imported before the method was refused"


def test_the_help_of_kd_train_is_shown_before_torch():
    """Its choices (backends, KD methods) come from the registries' names, which import no torch
    (kd train --help took 16 s at load where kd --help took 1 s)."""
    r = kd_then_torch("train", "--help")
    shown = " ".join(r.stdout.split())
    assert r.returncode == 0 and "Parallel backend: apex_ddp, dp, single, torch_ddp;" in shown, r.stdout
    assert "KD method: at, ce, crd, crld, ctdkd," in shown
    assert r.stdout.endswith("False"), "torch was imported for kd train --help"


def leaf_classes(package, base) -> set:
    """The subclasses of ``base`` that ``package``'s modules define and none of them derives from
    (importing every module: one that registered itself would show in the registry's names)."""
    found = set()
    for module in pkgutil.iter_modules(package.__path__):
        mod = importlib.import_module(f"{package.__name__}.{module.name}")
        found |= {
            c
            for c in vars(mod).values()
            if isinstance(c, type) and issubclass(c, base) and c.__module__ == mod.__name__
        }
    return {c for c in found if not any(other is not c and issubclass(other, c) for other in found)}


def test_every_backend_class_is_listed_once_by_backends():
    """kd's backends are registered once each, by their line in backends/__init__.py."""
    import backends
    from backends.base import Backend

    listed = backends.BACKENDS.names()
    classes = leaf_classes(backends, Backend)
    assert backends.BACKENDS.names() == listed, "a backend module registers a name of its own"
    assert {backends.get(name) for name in listed} == classes
    assert all(backends.get(name).name == name for name in listed)


def test_a_methods_card_by_name_and_a_mistyped_name_gets_the_near_ones():
    from kd.losses import card

    assert card("ofd").tap_point == "pre_relu" and card("dkd").class_labels and not card("ce").needs_teacher
    with pytest.raises(KDError, match="unknown KD loss 'dkdd' \\(did you mean dkd"):
        card("dkdd")


def test_every_method_class_is_listed_once_by_kd_losses():
    """Each KD method is registered once, by its line in kd/losses/__init__.py (its name, class and card)."""
    from kd.losses.base import DistillLoss

    listed = LOSSES.names()
    classes = leaf_classes(kd.losses, DistillLoss)
    assert LOSSES.names() == listed, "a method module registers a name of its own"
    assert {LOSSES.get(name) for name in listed} == classes
    for name in listed:
        assert LOSSES.get(name).name == name and LOSSES.get(name).card is LOSSES.card(name)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("resnet1B", "unknown torchvision model 'resnet1B' (did you mean resnet18"),
        ("timm:resnet10tt", "unknown timm model 'resnet10tt' (did you mean resnet10t"),
        ("timm:resnet10t.c3_in1kk", "timm has no tag 'c3_in1kk' for resnet10t (did you mean c3_in1k?)"),
    ],
)
def test_an_unknown_model_is_answered_before_torch_once_kd_has_kept_the_names(
    image_folder, tmp_path, cache, name, expected
):
    args = train_args(image_folder, tmp_path / "run", student=name)
    first = kd_then_torch(*args)  # nothing kept yet: answered after the libraries listed their names
    assert expected in error_line(first) and first.stdout == "True"
    assert list((cache / "kd").glob("models-*.json")), "the names were not kept"
    again = kd_then_torch(*args)
    assert error_line(again) == error_line(first)
    assert again.stdout == "False", "torch was imported before the model name was refused"


def test_names_are_kept_per_installed_version_and_read_only_for_it(cache):
    from importlib import metadata

    from kd.utils import model_names

    version = metadata.version("torchvision")
    assert model_names.cache_file("torchvision") == cache / "kd" / f"models-torchvision-{version}.json"
    model_names.keep("torchvision", {"models": ["resnet18"]})
    assert model_names.kept("torchvision", "models") == ["resnet18"]
    model_names.keep("torchvision", {"models": ["other"]})  # kept once per version
    assert model_names.kept("torchvision", "models") == ["resnet18"]
    assert not [p for p in (cache / "kd").iterdir() if p.suffix == ".tmp"]
    other = cache / "kd" / "models-torchvision-0.0.0.json"
    other.write_text(json.dumps({"models": ["resnet18"]}))
    model_names.cache_file("torchvision").unlink()
    assert model_names.kept("torchvision", "models") is None  # another version's list is not this one's
    model_names.check_early("no_such_model")  # nothing kept: left to kd.models.check_name


def test_a_model_registered_in_this_process_is_not_refused_by_the_kept_names(cache):
    """kd.train() in a process that registered its own timm model: the kept lists (of the installed
    timm) lack it, the loaded timm has it, and timm's word counts."""
    import timm
    from timm.models import register_model

    from kd.utils import model_names

    model_names.keep("timm", {"models": ["resnet10t"], "pretrained": []})
    if "kd_registered_here" not in timm.list_models():

        @register_model
        def kd_registered_here(pretrained=False, **kwargs):
            return timm.create_model("resnet10t", **kwargs)

    model_names.check_early("timm:kd_registered_here")


def test_an_unwritable_or_damaged_cache_is_passed_over_quietly(tmp_path, monkeypatch):
    from kd.utils import model_names

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    model_names.keep("timm", {"models": ["resnet10t"], "pretrained": []})
    assert model_names.kept("timm", "models") is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "kd").mkdir()
    model_names.cache_file("timm").write_text("{not json")
    assert model_names.kept("timm", "models") is None
    model_names.check_early("timm:no_such_model")


def test_the_kept_names_refuse_no_name_the_libraries_accept():
    import timm
    import torchvision.models as tvm

    from kd.utils import model_names

    lists = {
        ("torchvision", "models"): tvm.list_models(module=tvm),
        ("timm", "models"): timm.list_models(),
        ("timm", "pretrained"): timm.list_pretrained(),
    }
    accepted = [*lists["torchvision", "models"], *(f"timm:{n}" for n in lists["timm", "models"])]
    accepted += [f"timm:{n}" for n in lists["timm", "pretrained"]]
    refused = [n for n in accepted if model_names.refusal(n, lambda *key: lists[key])]
    assert not refused


def test_a_missing_weights_file_is_answered_before_torch(image_folder, tmp_path):
    r = kd_then_torch(*train_args(image_folder, tmp_path / "run", teacher_weights=tmp_path / "missing.pt"))
    assert f"--teacher-weights: weights file {tmp_path / 'missing.pt'} does not exist" in error_line(r)
    assert r.stdout == "False"


@pytest.mark.parametrize("visible", ["", "-1"])
def test_gpus_where_no_cuda_gpu_can_be_used_is_answered_before_torch(image_folder, tmp_path, visible):
    args = train_args(image_folder, tmp_path / "run", device="auto", gpus="0")
    r = kd_then_torch(*args, env={"CUDA_VISIBLE_DEVICES": visible})
    assert error_line(r).startswith("kd: error: --gpus 0 asks for a CUDA GPU, but none can be usable here")
    assert r.stdout == "False"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="device files are Linux's")
def test_cuda_is_ruled_out_only_without_any_gpu_device_file_or_driver(tmp_path):
    from kd.utils.placement import why_no_cuda

    assert "no GPU device" in why_no_cuda({}, root=str(tmp_path))
    for present in ("dev/nvidia0", "dev/nvhost-ctrl-gpu", "dev/nvmap", "dev/dxg", "dev/kfd", "proc/driver/nvidia"):
        (tmp_path / present).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / present).touch()
        assert why_no_cuda({}, root=str(tmp_path)) is None, present
        assert why_no_cuda({"CUDA_VISIBLE_DEVICES": "0"}, root=str(tmp_path)) is None
        assert "CUDA_VISIBLE_DEVICES" in why_no_cuda({"CUDA_VISIBLE_DEVICES": "-1"}, root=str(tmp_path))
        (tmp_path / present).unlink()


def test_check_early_refuses_from_the_kept_lists(cache, monkeypatch):
    from kd.utils import model_names

    for library in ("timm", "torchvision"):  # as in a fresh kd process (loaded, they would answer themselves)
        monkeypatch.delitem(sys.modules, library, raising=False)
    model_names.keep("torchvision", {"models": ["resnet18", "resnet50"]})
    model_names.check_early("resnet18")
    with pytest.raises(KDError, match="did you mean resnet18"):
        model_names.check_early("resnet1B")
    model_names.check_early("alexnot_zz")  # no near name and no timm list kept: left to the libraries


def test_an_editable_install_keeps_no_names_and_a_git_install_keeps_them_per_commit(tmp_path, monkeypatch, cache):
    from kd.utils import model_names

    def install(direct_url: dict) -> None:
        info = tmp_path / "site" / "fakelib-1.0.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakelib\nVersion: 1.0\n")
        (info / "direct_url.json").write_text(json.dumps(direct_url))

    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    install({"url": "file:///src/fakelib", "dir_info": {"editable": True}})
    assert model_names.cache_file("fakelib") is None
    files = set()
    for commit in ("a" * 40, "b" * 40):
        install({"url": "https://example.org/fakelib.git", "vcs_info": {"vcs": "git", "commit_id": commit}})
        files.add(model_names.cache_file("fakelib"))
    assert len(files) == 2 and all(f.name.startswith("models-fakelib-1.0-") for f in files)


def test_names_the_kept_lists_accept_are_checked_without_loading_the_libraries(cache):
    """kd.models.check_name in a process that has not loaded timm or torchvision (the launcher of
    --nproc N, which only starts the processes that build the models): a name the kept lists
    accept does not load them; a refused name is still the libraries' own answer."""
    from kd.utils import model_names

    model_names.keep("torchvision", {"models": ["resnet18"]})
    model_names.keep("timm", {"models": ["resnet10t"], "pretrained": ["resnet10t.c3_in1k"]})
    probe = (
        "import sys\nfrom kd import models\nfrom kd.errors import KDError\n"
        "for name in ('resnet18', 'timm:resnet10t', 'timm:resnet10t.c3_in1k'):\n"
        "    models.check_name(name)\n"
        "print(sorted({'timm', 'torchvision'} & set(sys.modules)))\n"
        "try:\n    models.check_name('timm:resnet10tt')\nexcept KDError as e:\n    print(e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    loaded, refused = r.stdout.splitlines()
    assert loaded == "[]", "a name the kept lists accept loaded the libraries"
    assert refused.startswith("unknown timm model 'resnet10tt' (did you mean resnet10t")
