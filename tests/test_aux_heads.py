"""Weights whose published files hold more than the model kd builds: the auxiliary heads of
torchvision's inception_v3 and googlenet (loaded, then dropped, as torchvision does), and every
torchvision weight's key set against the model kd builds for it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision.models as tvm
from torchvision.models._api import WeightsEnum

from kd import models


def _library_keys(name: str, member, monkeypatch) -> dict:
    """The keys and shapes of the model torchvision's builder loads ``member`` into (with the
    library's own arguments), found without any weights: the load is intercepted."""
    seen: dict = {}

    def capture(module, state, *args, **kwargs):
        seen.update({k: tuple(v.shape) for k, v in module.state_dict().items()})

    with monkeypatch.context() as patch:
        patch.setattr(WeightsEnum, "get_state_dict", lambda self, *a, **k: {})
        patch.setattr(torch.nn.Module, "load_state_dict", capture)
        with torch.device(_device(name)):
            tvm.get_model(name, weights=member)
    return seen


def _device(name: str) -> str:
    return "cpu" if name.startswith("regnet") else "meta"  # regnet computes its widths with tensors


def _every_weight():
    for name in models.torchvision_names():
        if name.startswith("regnet") and not name.endswith("_400mf"):
            continue  # regnets build on the CPU only (slowly): the smallest stand for them
        try:
            enum = tvm.get_model_weights(name)
        except ValueError:
            continue
        for member in enum:
            if member.meta.get("categories"):  # not a feature extractor's weights
                yield name, member


@pytest.mark.slow
def test_every_torchvision_weight_fits_the_model_kd_builds_for_it(monkeypatch):
    """Each classification weight torchvision publishes, its file's key set (the model the library
    builds to load it) against kd's model for it less the auxiliary heads kd leaves out."""
    # only keys and shapes are compared: both sides skip their random initialisation (on the meta
    # device each random fill runs as Python operators, half of the builds' time)
    for fill in ("normal_", "uniform_"):
        monkeypatch.setattr(torch.Tensor, fill, lambda self, *args, **kwargs: self)
    monkeypatch.setattr(torch.nn.init, "trunc_normal_", lambda tensor, *args, **kwargs: tensor)
    misfits = []
    for name, member in _every_weight():
        library = _library_keys(name, member, monkeypatch)
        with torch.device(_device(name)):
            model = models.construct(name, len(member.meta["categories"]), f"torchvision:{member.name}")
        state = models.without_aux_heads(model, {k: torch.empty(0) for k in library})
        own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if set(state) != set(own) or any(library[k] != own[k] for k in own):
            misfits.append(f"{name} {member.name}")
    assert not misfits


def _cached_file(torch_home: Path, name: str, member) -> dict:
    """A generated weight file of ``member``'s real key set (torchvision's model built with the
    library's own arguments), placed where torch's hub cache holds the published file."""
    torch.manual_seed(0)
    kwargs = {"aux_logits": True, "init_weights": True, "num_classes": len(member.meta["categories"])}
    state = tvm.get_model(name, weights=None, **kwargs).state_dict()
    folder = torch_home / "hub" / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / Path(member.url).name)
    return state


@pytest.mark.parametrize(
    "name,member,aux",
    [
        ("inception_v3", tvm.Inception_V3_Weights.IMAGENET1K_V1, ["AuxLogits"]),
        ("googlenet", tvm.GoogLeNet_Weights.IMAGENET1K_V1, ["aux1", "aux2"]),
    ],
)
def test_weights_with_auxiliary_heads_load_as_torchvision_loads_them(tmp_path, monkeypatch, name, member, aux):
    """``torchvision:IMAGENET1K_V1`` of inception_v3 (14 keys of its auxiliary head) and googlenet
    (20) load into kd's model, which gives torchvision's logits (its ``transform_input`` too)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    state = _cached_file(tmp_path, name, member)
    assert any(k.startswith(tuple(aux)) for k in state)
    ours = models.freeze(models.build(name, 1000, "torchvision:IMAGENET1K_V1"))
    theirs = tvm.get_model(name, weights=member).eval()  # from the same cached file, its heads kept
    assert all(getattr(ours, head, None) is None for head in aux)
    assert set(ours.state_dict()) == {k for k in theirs.state_dict() if not k.startswith(tuple(aux))}
    size = member.transforms().crop_size[0]
    images = torch.randn(2, 3, size, size)
    with torch.no_grad():
        torch.testing.assert_close(ours(images), theirs(images))


def _file_of_library_keys(path: Path, name: str, classes: int) -> Path:
    """A weight file of ``name`` with its auxiliary heads, as torchvision builds it to load its weights."""
    torch.manual_seed(0)
    model = tvm.get_model(name, weights=None, aux_logits=True, init_weights=True, num_classes=classes)
    torch.save(model.state_dict(), path)
    return path


@pytest.mark.slow
def test_kd_eval_and_a_student_load_files_with_auxiliary_heads(image_folder, tmp_path):
    from tests.conftest import kd_main, train_args

    weights = _file_of_library_keys(tmp_path / "inception.pth", "inception_v3", 3)
    r = kd_main("eval", "--model", "inception_v3", "--weights", weights, "--data", image_folder, "--device", "cpu")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "inception_v3" in r.stdout and "top-1" in r.stdout
    student = _file_of_library_keys(tmp_path / "googlenet.pth", "googlenet", 3)
    args = train_args(image_folder, tmp_path / "run", student="googlenet", student_weights=student, image_size=64)
    r = kd_main(*args, "--no-progress", "--limit-train-batches", "1", "--set", "val_cache_gb=0")
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_kd_checkpoint_is_built_as_the_named_weights_it_was_trained_from(tmp_path):
    """A student fine-tuned from googlenet's IMAGENET1K_V1 rescales its input (``transform_input``), a
    setting its state dict does not hold: loaded from its kd checkpoint (as a teacher, by kd eval) it
    is built as its run built it, not as a model of random weights."""
    from kd import __version__
    from kd.utils.checkpoint_io import save_atomic

    tuned = models.construct("googlenet", 10, "torchvision:IMAGENET1K_V1")
    assert tuned.transform_input
    path = tmp_path / "best.pt"
    state = tuned.state_dict()
    config = {"student": "googlenet", "student_weights": "torchvision:IMAGENET1K_V1"}
    save_atomic({"kd_version": __version__, "student": state, "student_name": "googlenet", "config": config}, path)
    assert models.build("googlenet", 10, str(path)).transform_input
    config["student_weights"] = "none"  # trained from random weights: as it was built then
    save_atomic({"kd_version": __version__, "student": state, "student_name": "googlenet", "config": config}, path)
    assert not models.build("googlenet", 10, str(path)).transform_input
