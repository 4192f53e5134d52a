"""The soft-label store never holds a non-finite value, and a damaged or edited one is refused
(kd.teacher.store): the stored dtype chosen from the teacher's logits, every written batch
checked, a checksum per epoch file and one of the manifest itself, and kd teach on a full disk."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from conftest import kd_main, make_image_folder
from PIL import Image

from kd.errors import KDError
from kd.teacher import store as kd_store

pytestmark = pytest.mark.slow

MEAN_GREY = (124, 116, 104)  # ImageNet's mean colour: about zero once normalised


def common(data, *extra):
    return ["--data", data, "--image-size", 32, "-b", 8, "--device", "cpu", "--no-progress", "-j", 0, *extra]


def teacher_file(path: Path, scale: float) -> Path:
    """A resnet18 teacher (4 classes) whose logits are ``scale`` times a fresh one's, with no bias:
    a ReLU network without biases (batch norms at their initial statistics) is positively
    homogeneous, so an image of the mean colour gives logits near zero and any other large ones."""
    torch.manual_seed(3)
    model = torchvision.models.resnet18(num_classes=4)
    with torch.no_grad():
        model.fc.weight.mul_(scale)
        model.fc.bias.zero_()
    torch.save(model.state_dict(), path)
    return path


def grey(folder: Path) -> None:
    """Every JPEG under ``folder`` made one of the mean colour (same names: the listing unchanged)."""
    for image in folder.rglob("*.jpg"):
        Image.new("RGB", (40, 32), MEAN_GREY).save(image, quality=95)


def one_line(r):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert lines and lines[-1].startswith("kd: error: ") and "Traceback" not in r.stderr, r.stderr
    return lines[-1]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    data = make_image_folder(root / "data", classes=4, train_per_class=4, val_per_class=2)
    return root, data, teacher_file(root / "sane.pt", 1.0), teacher_file(root / "loud.pt", 1e5)


def test_default_dtype_follows_the_teachers_logits_and_float16_that_cannot_hold_them_is_refused(world, tmp_path):
    """A teacher whose logits pass float16's range (65504) gets a float32 store by default, said in
    one line; asked for float16, kd teach refuses before writing anything; a sane teacher keeps
    float16. No store ever holds inf."""
    root, data, sane, loud = world
    store = tmp_path / "loud"
    r = kd_main("teach", *common(data, "--teacher", "resnet18", "--teacher-weights", loud, "--epochs", 1,
                                 "--top-k", "all", "--out", store))  # fmt: skip
    assert r.returncode == 0, r.stderr
    manifest = kd_store.read_manifest(store)
    assert manifest["dtype"] == "float32", manifest
    assert "logits stored in float32 (auto: the teacher's largest |logit|" in r.stderr, r.stderr
    values = np.load(store / "epoch-001.values.npy")
    assert np.isfinite(values).all() and np.abs(values).max() > 65504
    refused = tmp_path / "refused"
    line = one_line(kd_main("teach", *common(data, "--teacher", "resnet18", "--teacher-weights", loud, "--epochs", 1,
                                             "--logits-dtype", "float16", "--out", refused)))  # fmt: skip
    assert "cannot hold" in line and "--logits-dtype float32" in line, line
    assert not refused.exists()
    quiet = tmp_path / "sane"
    r = kd_main("teach", *common(data, "--teacher", "resnet18", "--teacher-weights", sane, "--epochs", 1,
                                 "--top-k", 2, "--out", quiet))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert kd_store.read_manifest(quiet)["dtype"] == "float16"
    assert "logits stored in float16 (auto: the teacher's largest |logit|" in r.stderr


def test_a_batch_that_overflows_stops_teach_and_keeps_the_complete_epochs(tmp_path):
    """The probe sees logits float16 holds (grey validation images), a later epoch's crops do not:
    kd teach stops in one line naming the epoch and the largest |logit|, epoch 1 kept, epoch 2 not
    committed; a student run for one epoch still trains from it."""
    data = make_image_folder(tmp_path / "data", classes=4, train_per_class=4, val_per_class=2)
    saved = {p: p.read_bytes() for p in (data / "train").rglob("*.jpg")}
    grey(data)
    weights = teacher_file(tmp_path / "t.pt", 3e5)  # grey: about 2e3, the others about 1e5
    store = tmp_path / "store"
    args = ["--teacher", "resnet18", "--teacher-weights", weights, "--logits-dtype", "float16", "--top-k", 2]
    r = kd_main("teach", *common(data, *args, "--epochs", 1, "--out", store))
    assert r.returncode == 0, r.stderr
    for path, content in saved.items():  # the same listing, images float16 cannot hold the logits of
        path.write_bytes(content)
    first = (store / "epoch-001.values.npy").read_bytes()
    line = one_line(kd_main("teach", *common(data, *args, "--epochs", 2, "--out", store)))
    assert "epoch 2" in line and "largest |logit|" in line and "--logits-dtype float32" in line, line
    manifest = kd_store.read_manifest(store)
    assert manifest["epochs_done"] == 1 and (store / "epoch-001.values.npy").read_bytes() == first
    assert not (store / "epoch-002.values.npy").exists() and not list(store.glob("*.partial.npy"))
    assert "sound" in kd_store.verify(store)


def test_verify_names_damaged_bytes_and_non_finite_rows(world, tmp_path):
    root, data, sane, loud = world
    store = tmp_path / "store"
    r = kd_main("teach", *common(data, "--teacher", "resnet18", "--teacher-weights", sane, "--epochs", 2,
                                 "--top-k", 2, "--out", store))  # fmt: skip
    assert r.returncode == 0, r.stderr
    summary = kd_store.verify(store)
    assert "sound" in summary and "2 epoch(s)" in summary and "\n" not in summary
    r = kd_main("verify", store)  # the command users run after a copy
    assert r.returncode == 0 and summary in r.stdout, (r.stdout, r.stderr)
    manifest = kd_store.read_manifest(store)
    assert manifest["format"] == 2 and len(manifest["epoch_files"]) == 2
    # three flipped bytes in epoch 2's logits: the start of a run cannot see them, verify does
    path = store / "epoch-002.values.npy"
    data_bytes = bytearray(path.read_bytes())
    for offset in (-1, -7, -20):
        data_bytes[offset] ^= 0x5A
    path.write_bytes(bytes(data_bytes))
    with pytest.raises(KDError, match="epoch-002.values.npy does not match its checksum"):
        kd_store.verify(store)
    r = kd_main("verify", store)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("kd: error: "), r.stderr
    assert "epoch-002.values.npy does not match its checksum" in r.stderr
    # a store whose checksums agree with an inf in its rows (as a teach without the check wrote)
    values = np.load(path, mmap_mode="r+")
    values[3, 0] = np.inf
    values.flush()
    del values
    manifest["epoch_files"][1]["values"]["sha256"] = kd_store.file_sha256(str(path))
    kd_store.write_manifest(store, manifest)
    with pytest.raises(KDError, match="epoch-002.values.npy, row 3: a non-finite logit"):
        kd_store.verify(store)
    # and one whose checksums agree with a class outside the store's
    classes = store / "epoch-001.classes.npy"
    with_class = np.load(classes)
    with_class[6, 1] = 4
    np.save(classes, with_class)
    manifest["epoch_files"][0]["classes"]["sha256"] = kd_store.file_sha256(str(classes))
    kd_store.write_manifest(store, manifest)
    with pytest.raises(KDError, match="epoch-001.classes.npy, row 6: class 4, the store's classes are 0 to 3"):
        kd_store.verify(store)


def test_an_edited_or_old_manifest_is_refused_in_one_line(world, tmp_path):
    root, data, sane, loud = world
    store = tmp_path / "store"
    r = kd_main("teach", *common(data, "--teacher", "resnet18", "--teacher-weights", sane, "--epochs", 1,
                                 "--out", store))  # fmt: skip
    assert r.returncode == 0, r.stderr
    manifest_path = store / kd_store.MANIFEST
    original = manifest_path.read_text()
    train = ["train", *common(data, "--student", "resnet18", "--epochs", 1, "--soft-labels", store)]
    for edit in (
        lambda m: m.update(classes=5),
        lambda m: m["epoch_files"][0].pop("written"),
        lambda m: m.update(epochs_done=2, epochs=2),
    ):
        manifest = json.loads(original)
        edit(manifest)
        manifest_path.write_text(json.dumps(manifest, indent=1))
        line = one_line(kd_main(*train, "--out", tmp_path / "run"))
        assert "kd-soft-labels.json was edited or damaged" in line, line
        with pytest.raises(KDError, match="edited or damaged"):
            kd_store.verify(store)
        assert not (tmp_path / "run").exists()
    # a store of format 1 (no checksums, and it may hold inf): refused, taught again
    old = json.loads(original)
    for key in ("epoch_files", "manifest_sha256"):
        old.pop(key)
    old["format"] = 1
    manifest_path.write_text(json.dumps(old, indent=1))
    line = one_line(kd_main(*train, "--out", tmp_path / "run"))
    assert "format 1" in line and "kd teach" in line, line
    # a listed file whose size differs from its manifest's: refused at the start, cheaply
    manifest_path.write_text(original)
    with open(store / "epoch-001.values.npy", "ab") as f:
        f.write(b"\0" * 8)
    line = one_line(kd_main(*train, "--out", tmp_path / "run"))
    assert "epoch-001.values.npy" in line and "bytes" in line, line


@pytest.fixture(scope="module")
def top_k_store(world, tmp_path_factory):
    """One epoch of the top 2 of 4 logits in float16 (timm's test ResNet, random weights): the
    tests below copy it before they damage it."""
    root, data, sane, loud = world
    out = tmp_path_factory.mktemp("top_k") / "store"
    teacher = ["--teacher", "timm:test_resnet", "--teacher-weights", "none", "--top-k", 2, "--logits-dtype", "float16"]
    r = kd_main("teach", *common(data, *teacher, "--epochs", 1, "--out", out))
    assert r.returncode == 0, r.stderr
    return out


def damage(store: Path, folder: Path, part: str, row: int, value) -> Path:
    """A copy of ``store`` with ``value`` written into row ``row`` of its first epoch's ``part``
    file, in place: its size kept, as a run's start checks it."""
    copy = folder / f"{part}-{row}"
    shutil.copytree(store, copy)
    array = np.load(copy / f"epoch-001.{part}.npy", mmap_mode="r+")
    array[row] = value
    array.flush()
    del array
    return copy


def test_an_inf_read_from_a_store_stops_the_run_in_one_line(world, top_k_store, tmp_path):
    """An inf in float16 (one value, the file's size kept): the run stops where it reads it, naming
    the file and the training image, instead of a step skipped and the run done."""
    root, data, sane, loud = world
    damaged = damage(top_k_store, tmp_path, "values", 3, np.inf)
    student = ["--student", "timm:test_resnet", "--epochs", 1, "--soft-labels", damaged]
    line = one_line(kd_main("train", *common(data, *student, "--out", tmp_path / "run")))
    assert "epoch-001.values.npy, training image 3: a non-finite logit" in line, line
    assert "kd teach" in line and "kd verify" in line, line


@pytest.mark.parametrize(
    "part, value, what",
    [
        ("values", np.nan, "epoch-001.values.npy, training image 5: a non-finite logit"),
        ("rest", np.inf, "epoch-001.rest.npy, training image 5: a non-finite logit"),
        ("classes", 300, "epoch-001.classes.npy, training image 5: class 300, the store's classes are 0 to 3"),
        ("classes", -2, "epoch-001.classes.npy, training image 5: class -2, the store's classes are 0 to 3"),
    ],
)
def test_a_damaged_row_is_refused_as_it_is_read(top_k_store, tmp_path, part, value, what):
    manifest = kd_store.read_manifest(top_k_store)
    wanted = {key: manifest[key] for key in kd_store.PINNED}
    labels = kd_store.SoftLabels(damage(top_k_store, tmp_path, part, 5, value), wanted, epochs=1)
    assert labels.logits(0, torch.arange(5), torch.device("cpu")).isfinite().all()  # the rows before it
    with pytest.raises(KDError, match=re.escape(what)):
        labels.logits(0, torch.arange(4, 8), torch.device("cpu"))


@contextlib.contextmanager
def tmpfs(folder: Path, size: str):
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)]).returncode:  # a map still open: detached, freed when closed
            subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="mounts a tmpfs: root only")
def test_teach_onto_a_full_disk_says_so_and_keeps_its_complete_epochs(world, tmp_path, monkeypatch):
    """On a small tmpfs: a store that cannot fit is refused before anything is written; where the
    disk fills up under way (its free space measured wrong: another writer took it), one line, and
    the complete epochs stay, continued once there is room."""
    root, data, sane, loud = world
    args = ["--teacher", "resnet18", "--teacher-weights", sane, "--top-k", 2, "--logits-dtype", "float32"]
    with tmpfs(tmp_path / "disk", "80k") as disk:
        store = disk / "store"
        line = one_line(kd_main("teach", *common(data, *args, "--epochs", 10, "--out", store)))
        assert "the store needs" in line and "free" in line, line
        assert not store.exists()
        r = kd_main("teach", *common(data, *args, "--epochs", 1, "--out", store))
        assert r.returncode == 0, r.stderr
        first = (store / "epoch-001.values.npy").read_bytes()
        ballast = disk / "ballast"
        with open(ballast, "wb", buffering=0) as f:  # the disk filled by someone else
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 4096)
        import shutil

        real = shutil.disk_usage
        monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 30))
        line = one_line(kd_main("teach", *common(data, *args, "--epochs", 3, "--out", store)))
        monkeypatch.undo()
        assert "no space left on" in line.lower(), line  # (its lock file, or the store's files)
        assert kd_store.read_manifest(store)["epochs_done"] == 1
        assert (store / "epoch-001.values.npy").read_bytes() == first
        ballast.unlink()
        r = kd_main("teach", *common(data, *args, "--epochs", 3, "--out", store))
        assert r.returncode == 0, r.stderr
        assert "sound" in kd_store.verify(store) and not list(store.glob("*.partial*"))


def test_two_processes_stop_alike_on_a_batch_that_overflows(tmp_path):
    """With --nproc 2 the check is a collective: both processes stop at the same batch, one line,
    nothing of the epoch left behind."""
    from conftest import run_kd

    data = make_image_folder(tmp_path / "data", classes=4, train_per_class=4, val_per_class=2)
    grey(data / "val")
    weights = teacher_file(tmp_path / "t.pt", 3e5)
    store = tmp_path / "store"
    args = ["--teacher", "resnet18", "--teacher-weights", weights, "--logits-dtype", "float16", "--epochs", 1]
    r = run_kd("teach", *common(data, *args, "--backend", "torch_ddp", "--nproc", 2, "--out", store))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("kd: error:")]
    assert len(errors) == 1 and "epoch 1" in errors[0] and "--logits-dtype float32" in errors[0], r.stderr
    assert kd_store.read_manifest(store, "--out")["epochs_done"] == 0
    assert sorted(p.name for p in store.iterdir()) == [kd_store.MANIFEST]
