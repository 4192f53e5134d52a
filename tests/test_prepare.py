"""kd prepare: a prepared copy holds every image (training images reduced as a plain PIL resize
would, validation images byte for byte), both loaders read it as they read the folder, a stopped
copy is finished where it stopped, and a copy that does not belong is refused in one line."""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import kd_main, make_image_folder
from PIL import Image

from kd import config as kd_config
from kd.data import build
from kd.data.layout import scan
from kd.data.prepared import MANIFEST, RAW, Prepared
from kd.data.prepared_writer import Settings, prepare, reduced_size
from kd.errors import KDError

CPU = torch.device("cpu")


def odd_folder(root: Path) -> Path:
    """Non-square JPEGs of odd sizes (and a PNG and a grey one) that a cap of 96 reduces or keeps."""
    make_image_folder(root, classes=3, train_per_class=5, val_per_class=3, size=(150, 97))
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 255, (61, 203, 3), dtype=np.uint8)).save(root / "train/class_00/wide.png")
    Image.fromarray(rng.integers(0, 255, (80, 60), dtype=np.uint8)).save(root / "train/class_01/grey.jpg")
    Image.fromarray(rng.integers(0, 255, (301, 77, 3), dtype=np.uint8)).save(root / "val/class_02/tall.jpg")
    return root


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepare")
    src = odd_folder(root / "src")
    raw = root / "raw"
    prepare(str(src), str(raw), Settings(max_side=96, shard_images=4), workers=2, progress=False)
    jpeg = root / "jpeg"
    prepare(str(src), str(jpeg), Settings(format="jpeg", max_side=96, shard_images=64), workers=1, progress=False)
    return src, raw, jpeg


def test_training_images_are_the_source_reduced_and_validation_images_its_bytes(copies):
    src, raw, jpeg = copies
    classes, train, val = scan(str(src))
    got_classes, copy_train, copy_val = scan(str(raw))
    assert got_classes == classes and isinstance(copy_train, Prepared) and len(copy_train) == len(train)
    sources = (raw / "train.paths.txt").read_text().splitlines()
    assert sources == [p for p, _ in train] and [lbl for _, lbl in copy_train] == [lbl for _, lbl in train]
    for i, (path, _) in enumerate(train):
        with Image.open(path) as im:
            reference = im.convert("RGB")
        size = reduced_size(*reference.size, 96)
        assert max(size) <= 96 and (size == reference.size) == (max(reference.size) <= 96)
        if size != reference.size:  # a plain antialiased resize of the full decode, within a few levels
            reference = reference.resize(size, Image.LANCZOS)
        stored = copy_train.image(i)
        assert copy_train.format(i) == RAW and stored.size == size
        diff = np.abs(np.asarray(stored, dtype=np.float32) - np.asarray(reference, dtype=np.float32))
        assert diff.mean() < 2.5, (path, diff.mean())
    for i, (path, _) in enumerate(val):
        assert copy_val.data(i) == Path(path).read_bytes()
    _, jpeg_train, _ = scan(str(jpeg))
    assert all(jpeg_train.data(i)[:2] == b"\xff\xd8" for i in range(len(jpeg_train)))
    assert max(jpeg_train.image(i).size) <= 96 and len(jpeg_train) == len(train)


def test_the_manifest_records_the_source_the_settings_and_each_shards_checksum(copies):
    """The manifest records the source, the settings and each shard's SHA-256; the index, each image's CRC-32."""
    src, raw, _ = copies
    manifest = json.loads((raw / MANIFEST).read_text())
    assert manifest["complete"] and manifest["source"] == str(src.resolve()) and manifest["format_version"] == 2
    assert manifest["settings"] == {"format": "raw", "max_side": 96, "quality": 90, "shard_images": 4}
    assert set(manifest["listing_sha256"]) == {"train", "val"}
    shards = manifest["splits"]["train"]["shards"]
    assert len(shards) == 5 and sum(s["images"] for s in shards) == manifest["splits"]["train"]["images"] == 17
    for shard in shards:
        data = (raw / shard["file"]).read_bytes()
        assert len(data) == shard["bytes"] and hashlib.sha256(data).hexdigest() == shard["sha256"]
    for record in np.load(raw / "train.index.npy"):
        data = (raw / shards[record["shard"]]["file"]).read_bytes()
        assert zlib.crc32(data[record["offset"] : record["offset"] + record["length"]]) == record["crc32"]
    assert not list(raw.glob("*.json.tmp")) and not list(raw.glob("*.bin.tmp")) and not list(raw.glob("*.idx.npy"))


@pytest.mark.parametrize("loader", ["pil", "gpu"])
def test_the_loaders_read_a_copy_as_they_read_its_folder(copies, loader):
    """Validation crops from the copy equal the folder's bit for bit; training batches come in the same
    sampler order, from the reduced images (the PIL and the device path agree on them as on files)."""
    src, raw, _ = copies

    def loaders(data, name):
        opts = dict(data=str(data), teacher="resnet18", student="resnet18", workers=0, image_size=32)
        cfg = kd_config.resolve(options={**opts, "batch_size": 8, "loader": name, "val_cache_gb": 0})
        return build(cfg, 1, 0, 8, CPU, False)

    folder, copy, copy_pil = loaders(src, loader), loaders(raw, loader), loaders(raw, "pil")
    for a, b in zip(folder.val, copy.val, strict=True):
        assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    for loader_ in (copy.train, copy_pil.train):
        loader_.set_epoch(1)
    batches = list(zip(copy.train, copy_pil.train, strict=True))
    assert len(batches) == 2
    for a, b in batches:
        assert torch.equal(a.labels, b.labels) and a.images.shape == (8, 3, 32, 32)
        assert (a.images - b.images).abs().mean() < 0.05  # normalised units: under 3 levels
    assert "from the prepared copy" in copy.train.describe() and "raw RGB pixels" in copy.train.describe()


def test_a_stopped_copy_is_finished_where_it_stopped(copies, tmp_path):
    src, raw, _ = copies
    out = tmp_path / "copy"
    settings = Settings(max_side=96, shard_images=4)
    prepare(str(src), str(out), settings, workers=1, progress=False)
    # as a stop leaves it: no complete manifest, a shard that was not committed, one half written
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["complete"] = False
    (out / MANIFEST).write_text(json.dumps(manifest))
    for shard in range(5):
        index = np.load(out / "train.index.npy")
        np.save(out / f"train-{shard:05d}.bin.idx.npy", index[index["shard"] == shard])
        paths = [p for p, _ in scan(str(src))[1]][shard * 4 : shard * 4 + 4]
        summary = {**manifest["splits"]["train"]["shards"][shard], "paths": paths, "bad": []}
        (out / f"train-{shard:05d}.bin.json").write_text(json.dumps(summary))
    (out / "train-00004.bin.json").unlink()
    (out / "train-00004.bin").rename(out / "train-00004.bin.tmp")
    (out / "train-00003.bin").write_bytes(b"half")  # a shard file whose commit says otherwise
    kept = {name: os.stat(out / name).st_mtime_ns for name in ("train-00000.bin", "train-00002.bin")}
    lines = []
    prepare(str(src), str(out), settings, workers=1, progress=False, echo=lines.append)
    assert {name: os.stat(out / name).st_mtime_ns for name in kept} == kept  # not written again
    for name in ("train.index.npy", "train-00003.bin", "train-00004.bin", "val-00000.bin"):
        assert (out / name).read_bytes() == (raw / name).read_bytes(), name
    assert json.loads((out / MANIFEST).read_text())["complete"]
    prepare(str(src), str(out), settings, workers=1, progress=False, echo=lines.append)
    assert lines[-1] == f"kd prepare: {out} is complete already (17 train images)"


def snapshot(root: Path):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_copy_that_does_not_belong_is_refused_in_one_line_and_nothing_changes(copies, tmp_path):
    src, raw, _ = copies
    other = make_image_folder(tmp_path / "other", classes=3, train_per_class=2, val_per_class=1)
    stale = odd_folder(tmp_path / "stale")
    prepare(str(stale), str(tmp_path / "stale_copy"), Settings(max_side=96, shard_images=4), progress=False)
    Image.new("RGB", (20, 20)).save(stale / "train/class_00/new.jpg")
    (tmp_path / "notacopy").mkdir()
    (tmp_path / "notacopy" / "notes.txt").write_text("mine")
    cases = [
        (["prepare", other, raw, "--max-side", "96"], "it is a copy of"),
        (["prepare", src, raw, "--max-side", "128"], "it was prepared with raw RGB pixels, longer side at most 96"),
        (["prepare", stale, tmp_path / "stale_copy", "--max-side", "96"], "changed since it was prepared"),
        (["prepare", src, tmp_path / "notacopy"], "is not a kd prepared copy"),
        (["prepare", src, src / "inside"], "cannot be inside its source"),
        (["prepare", tmp_path / "nowhere", tmp_path / "new"], "does not exist"),
        (["prepare", src, tmp_path / "new", "--max-side", "8"], "--max-side must be at least 32"),
    ]
    before = snapshot(tmp_path), snapshot(raw)
    for args, expected in cases:
        r = kd_main(*args)
        assert r.returncode == 2 and expected in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert "Traceback" not in r.stderr
    assert (snapshot(tmp_path), snapshot(raw)) == before and not (tmp_path / "new").exists()


def test_training_refuses_an_unfinished_damaged_or_newer_copy(copies, tmp_path):
    src, raw, _ = copies
    cases = {
        "unfinished": (lambda m, d: m.update(complete=False), "unfinished prepared copy"),
        "damaged": (lambda m, d: (d / "train-00001.bin").write_bytes(b"x"), "is damaged: train-00001.bin is 1 bytes"),
        "newer": (lambda m, d: m.update(format_version=3), "in format 3; this kd reads format 1 or 2"),
    }
    for name, (spoil, expected) in cases.items():
        copy = tmp_path / name
        copy.mkdir()
        for f in raw.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        manifest = json.loads((copy / MANIFEST).read_text())
        spoil(manifest, copy)
        (copy / MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(KDError, match=expected):
            scan(str(copy))
    r = kd_main("train", "--data", tmp_path / "newer", "--student", "resnet18", "--no-teacher", "--device", "cpu")
    assert r.returncode == 2 and "in format 3" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
def test_kd_train_and_eval_on_a_prepared_copy(copies, tmp_path):
    src, raw, _ = copies
    r = kd_main("prepare", src, tmp_path / "copy", "--max-side", "64", "-j", "2", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith("kd prepare: 17 train images -> raw RGB pixels, longer side at most 64")
    assert "KB an image" in r.stdout.splitlines()[0] and f"kd train --data {tmp_path / 'copy'}" in r.stdout
    out = tmp_path / "run"
    common = ["--student", "resnet18", "--no-teacher", "--device", "cpu", "--image-size", "32", "-b", "8", "-j", "1"]
    r = kd_main("train", "--data", tmp_path / "copy", *common, "--epochs", "1", "--out", out)
    assert r.returncode == 0, r.stderr
    assert "from the prepared copy" in r.stderr
    on_copy = kd_main("eval", "--weights", out / "checkpoints" / "best.pt", "--data", tmp_path / "copy", "-j", "0")
    on_folder = kd_main("eval", "--weights", out / "checkpoints" / "best.pt", "--data", src, "-j", "0")
    assert on_copy.returncode == on_folder.returncode == 0, on_copy.stderr + on_folder.stderr
    assert on_copy.stdout.splitlines()[-1] == on_folder.stdout.splitlines()[-1]  # the same val images, bytes and all


def test_an_unreadable_source_image_is_left_out_and_named(tmp_path):
    src = make_image_folder(tmp_path / "src", classes=2, train_per_class=3, val_per_class=1)
    broken = src / "train/class_01/001.jpg"
    broken.write_bytes(broken.read_bytes()[:40])
    lines = []
    manifest = prepare(str(src), str(tmp_path / "copy"), Settings(max_side=32), progress=False, echo=lines.append)
    assert manifest["splits"]["train"]["images"] == 5 and len(manifest["splits"]["train"]["bad"]) == 1
    assert manifest["splits"]["train"]["bad"][0].startswith(f"{broken}: ")
    assert "; 1 unreadable train image(s) left out; train with" in lines[-1]
    _, train, _ = scan(str(tmp_path / "copy"))
    assert str(broken) not in (tmp_path / "copy" / "train.paths.txt").read_text() and len(train) == 5


def test_a_copy_of_many_shards_keeps_few_files_open(copies, monkeypatch):
    """ImageNet's copy has over a thousand shards, more than a process may open: the reader keeps
    a few open and closes the least recently read (a failed open was counted as an unreadable image)."""
    import kd.data.prepared

    src, raw, _ = copies
    monkeypatch.setattr(kd.data.prepared, "MAX_OPEN_SHARDS", 2)
    _, train, _ = scan(str(raw))
    expected = [train.data(i) for i in range(len(train))]
    order = [16, 0, 4, 8, 12, 1, 5, 9, 13, 2, 16]  # every shard, again and again
    for i in order:
        assert train.data(i) == expected[i]
        assert len(train._files) <= 2
    open_now = set(train._files.values())
    train.close()
    for fd in open_now:
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(fd)
