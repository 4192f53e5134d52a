"""Damaged bytes are detected: a checkpoint against the SHA-256 kd writes beside it (resume,
--teacher-weights, kd eval, kd export, kd verify), a sums file that lists the file in place at every
moment of a write, a prepared copy against its sealed manifest, and a file kd cannot read named as
such wherever it is given."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import kd_main, make_image_folder, train_args

from kd.checksum import file_sha256
from kd.data.prepared import FORMAT_VERSION, MANIFEST, read_manifest, sealed
from kd.data.prepared_writer import Settings, prepare
from kd.errors import KDError
from kd.utils import checkpoint_io

TINY = ["--no-teacher", "--student", "resnet18", "--image-size", 32, "-b", 8, "-j", 0, "--device", "cpu"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("verify"), classes=3, train_per_class=4, val_per_class=2)


@pytest.fixture(scope="module")
def run(data, tmp_path_factory):
    """A one-epoch run with a step copy: last.pt, best.pt and step_*.pt, each with its sums file."""
    out = tmp_path_factory.mktemp("runs") / "run"
    r = kd_main("train", "--data", data, *TINY, "-b", 4, "--epochs", 1, "--save-every-steps", 1, "--out", out)
    assert r.returncode == 0, r.stderr
    return out


def flip(path: Path, count: int = 3) -> None:
    """Flip ``count`` bytes in the middle of ``path`` (in its tensor data, for a checkpoint)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(count):
        data[middle + 97 * i] ^= 0xFF
    path.write_bytes(bytes(data))


def damaged_copy(run: Path, tmp_path: Path) -> Path:
    """A copy of ``run`` whose last.pt and best.pt have three flipped bytes."""
    copy = tmp_path / "damaged"
    shutil.copytree(run, copy)
    for name in ("last.pt", "best.pt"):
        flip(copy / "checkpoints" / name)
    return copy


class Opaque:
    """Anything beyond tensors: weights_only refuses to unpickle it."""


def one_line(r, expected: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert expected in r.stderr and lines[-1].startswith("kd: error:") and "Traceback" not in r.stderr, r.stderr
    assert sum(line.startswith("kd: error:") for line in lines) == 1, r.stderr


def test_every_checkpoint_has_its_sha256_beside_it_as_sha256sum_writes_it(run):
    folder = run / "checkpoints"
    written = sorted(p.name for p in folder.glob("*.pt"))
    assert {"last.pt", "best.pt"} <= set(written) and any(n.startswith("step_") for n in written), written
    for name in written:
        assert checkpoint_io.listed_sums(folder / name) == [checkpoint_io.file_sha256(folder / name)]
    r = subprocess.run(["sha256sum", "-c", *[f"{n}.sha256" for n in written]], cwd=folder, capture_output=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_damaged_checkpoint_is_refused_by_eval_export_resume_and_either_weights(run, data, tmp_path):
    copy = damaged_copy(run, tmp_path)
    best = copy / "checkpoints" / "best.pt"
    calls = {
        "eval": ("eval", "--weights", best, "--data", data, "-j", 0, "--device", "cpu"),
        "export": ("export", copy, "-o", tmp_path / "w.pt"),
        "resume": ("train", "--data", data, *TINY, "--epochs", 2, "--out", copy, "--resume"),
        "teacher": ("train", "--data", data, *TINY[1:], "--teacher", "resnet18", "--teacher-weights", best),
        "student": ("train", "--data", data, *TINY, "--student-weights", best),
    }
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    for name, args in calls.items():
        r = kd_main(*args, *(("--epochs", 1, "--out", tmp_path / "student") if name in ("teacher", "student") else ()))
        one_line(r, "is damaged: its bytes do not match the SHA-256")
        assert ("last.pt" if name == "resume" else "best.pt") in r.stderr.splitlines()[-1], (name, r.stderr)
    assert not (tmp_path / "w.pt").exists() and not (tmp_path / "student" / "checkpoints").exists()
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before


def test_a_checkpoint_from_elsewhere_has_no_sums_and_loads_as_before(run, data, tmp_path):
    plain = tmp_path / "plain.pt"
    shutil.copyfile(run / "checkpoints" / "best.pt", plain)  # no plain.pt.sha256
    assert checkpoint_io.verify(plain) is None
    r = kd_main("eval", "--weights", plain, "--data", data, "-j", 0, "--device", "cpu")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("older_kd", [False, True], ids=["sums", "no-sums-yet"])
def test_a_kill_between_any_two_steps_of_a_write_leaves_a_file_that_verifies(tmp_path, monkeypatch, older_kd):
    """Each of save_atomic's renames (sums with both, the file, sums with the new alone) is the place of
    a kill: before it, the file in place (old or new) must verify and load; then the next write too."""
    import kd.utils.checkpoint_io as ck

    class Killed(BaseException):
        pass

    real_replace = os.replace
    for step in range(3):
        path = tmp_path / f"k{step}" / "last.pt"
        path.parent.mkdir()
        if older_kd:  # a file an older kd wrote, with no sums beside it
            torch.save({"v": torch.zeros(4)}, path)
        else:
            ck.save_atomic({"v": torch.zeros(4)}, path)
        calls = []

        def replace(src, dst, _calls=calls, _step=step):
            if len(_calls) == _step:
                raise Killed
            _calls.append(dst)
            real_replace(src, dst)

        monkeypatch.setattr(ck.os, "replace", replace)
        with pytest.raises(Killed):
            ck.save_atomic({"v": torch.ones(4)}, path)
        monkeypatch.setattr(ck.os, "replace", real_replace)
        ck._verified.clear()
        expected = torch.ones(4) if step == 2 else torch.zeros(4)
        if step == 0 and older_kd:
            assert ck.verify(path) is None  # still the older kd's file, unchecked
        else:
            assert ck.verify(path) is True, (step, path.read_bytes()[:0], ck.listed_sums(path))
        assert torch.equal(torch.load(path, weights_only=True)["v"], expected), step
        ck.save_atomic({"v": torch.full((4,), 2.0)}, path)  # the next write after the kill
        assert ck.listed_sums(path) == [ck.file_sha256(path)]
        flip(path, 1)
        ck._verified.clear()
        with pytest.raises(KDError, match="is damaged"):
            ck.verify(path)


@pytest.mark.parametrize("kind", ["empty", "truncated", "refused pickle"])
def test_a_file_kd_cannot_read_is_named_by_eval_resume_and_teacher_weights(run, data, tmp_path, kind):
    bad = tmp_path / "bad" / "checkpoints" / "last.pt"
    bad.parent.mkdir(parents=True)
    good = (run / "checkpoints" / "best.pt").read_bytes()

    if kind == "empty":
        bad.write_bytes(b"")
        expected = "it is not a PyTorch file"
    elif kind == "truncated":
        bad.write_bytes(good[: len(good) // 3])
        expected = "the PyTorch archive is damaged or truncated"
    else:
        torch.save({"student": Opaque()}, bad)
        expected = "which would need code to be unpickled"
    teacher = ["--teacher", "resnet18", "--teacher-weights", bad, *TINY[1:], "--out", tmp_path / "student"]
    for args in (
        ("eval", "--weights", bad, "--data", data, "-j", 0, "--device", "cpu"),
        ("train", "--data", data, *TINY, "--epochs", 1, "--out", bad.parent.parent, "--resume"),
        ("train", "--data", data, *teacher, "--epochs", 1),
    ):
        r = kd_main(*args)
        one_line(r, expected)
        assert str(bad) in r.stderr and "--model NAME is required" not in r.stderr, r.stderr
    assert not (tmp_path / "student" / "checkpoints").exists()


def test_a_broken_weights_file_is_named_for_what_it_is(data, tmp_path):
    """One complete sentence: random bytes are no PyTorch file (not an unpickling matter), a cut
    archive is damaged, a pickle of objects is refused for what it holds."""
    import pickle

    (tmp_path / "random.pt").write_bytes(os.urandom(4096).replace(b"PK", b"pk").lstrip(b"\x80") or b"x")
    torch.save({"w": torch.ones(8)}, tmp_path / "whole.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "whole.pt").read_bytes()[:300])
    with open(tmp_path / "objects.pt", "wb") as fh:
        pickle.dump({"w": torch.nn.Linear(2, 2)}, fh, protocol=2)
    expected = {
        "random.pt": "it is not a PyTorch file (torch.save writes a zip archive or a pickle, and this file is neither)",
        "cut.pt": "the PyTorch archive is damaged or truncated (RuntimeError); copy or save it again",
        "objects.pt": "it is a pickle of Python objects other than tensors, which would need code to be unpickled, "
        "and kd refuses that (weights_only=True); save the model's state_dict() with torch.save instead",
    }
    for name, why in expected.items():
        path = tmp_path / name
        r = kd_main(*train_args(data, tmp_path / "out", teacher_weights=path, no_progress=True))
        lines = [line for line in r.stderr.splitlines() if "Warning" not in line and not line.startswith("  ")]
        assert r.returncode == 2 and lines[-1] == f"kd: error: cannot read weights file {path}: {why}", r.stderr


def test_kd_verify_names_each_checkpoint_of_a_run_and_each_damaged_one(run, tmp_path):
    r = kd_main("verify", run)
    assert r.returncode == 0, r.stderr
    files = sorted((run / "checkpoints").glob("*.pt"))
    assert [line for line in r.stdout.splitlines() if line.endswith(": OK")] == [f"{p}: OK" for p in files]
    assert r.stdout.splitlines()[-1] == f"run {run}: sound ({len(files)} files)"
    copy = damaged_copy(run, tmp_path)
    r = kd_main("verify", copy)
    one_line(r, "are damaged: resume or evaluate from a sound one (step_")
    assert f"{copy / 'checkpoints' / 'best.pt'}: DAMAGED: its bytes do not match" in r.stdout
    assert f"{copy / 'checkpoints' / 'last.pt'}: DAMAGED" in r.stdout
    r = kd_main("verify", copy / "checkpoints" / "last.pt")
    one_line(r, "last.pt is damaged")
    # a checkpoint deleted from beside its checksum is not sound (kd verify said so)
    (copy / "checkpoints" / "best.pt").unlink()
    r = kd_main("verify", copy)
    assert f"{copy / 'checkpoints' / 'best.pt'}: DAMAGED: missing, though best.pt.sha256 is here" in r.stdout, r.stdout
    one_line(r, "best.pt, ")
    (tmp_path / "empty").mkdir()
    for nothing in (tmp_path / "nowhere", tmp_path / "empty"):
        one_line(kd_main("verify", nothing), "does not exist" if nothing.name == "nowhere" else "nothing kd verifies")
    # a folder of runs (kd report's RUNS): each run's checkpoints
    shutil.copytree(run, tmp_path / "runs" / "a")
    shutil.copytree(run, tmp_path / "runs" / "b")
    r = kd_main("verify", tmp_path / "runs")
    assert (
        r.returncode == 0
        and r.stdout.splitlines()[-1] == f"2 runs in {tmp_path / 'runs'}: sound ({2 * len(files)} files)"
    )


@pytest.fixture(scope="module")
def copy(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "copy"
    prepare(str(data), str(out), Settings(max_side=48, shard_images=4), workers=1, progress=False, echo=lambda s: None)
    return out


def spoiled(copy: Path, tmp_path: Path, spoil) -> Path:
    target = tmp_path / "spoiled"
    shutil.copytree(copy, target)
    spoil(target)
    return target


def edit_manifest(change):
    def spoil(root: Path) -> None:
        manifest = json.loads((root / MANIFEST).read_text())
        change(manifest)
        (root / MANIFEST).write_text(json.dumps(manifest, indent=1))

    return spoil


def test_a_prepared_copy_is_sound_to_kd_verify(copy):
    r = kd_main("verify", copy)
    assert r.returncode == 0, r.stderr
    shards = sorted(copy.glob("*.bin"))
    assert all(f"{p}: OK" in r.stdout.splitlines() for p in shards), r.stdout
    assert r.stdout.splitlines()[-1].startswith(f"prepared copy {copy}: sound ({len(shards)} shards")


def test_a_manifest_edited_by_hand_is_refused_at_the_start_and_by_kd_verify(copy, data, tmp_path):
    def rename(m):
        m["classes"][0] = "cat"

    bad = spoiled(copy, tmp_path, edit_manifest(rename))
    train = kd_main("train", "--data", bad, *TINY, "--epochs", 1, "--out", tmp_path / "r")
    one_line(train, "was changed after kd prepare wrote it")
    assert not (tmp_path / "r" / "checkpoints").exists()
    one_line(kd_main("verify", bad), "was changed after kd prepare wrote it")
    (tmp_path / "unsealed").mkdir()
    unsealed = spoiled(copy, tmp_path / "unsealed", edit_manifest(lambda m: (rename(m), m.pop("contents_sha256"))))
    one_line(kd_main("verify", unsealed), "its seal removed")  # not taken for an older kd's copy
    rewrite(data, bad)  # what the line advises (kd prepare SRC COPY --overwrite) repairs it
    assert kd_main("verify", bad).returncode == 0


def test_flipped_bytes_in_a_shard_are_found_by_kd_verify(copy, data, tmp_path):
    shard = spoiled(copy, tmp_path, lambda root: flip(root / "train-00001.bin", 3))
    r = kd_main("verify", shard)
    one_line(r, "is damaged: train-00001.bin: its bytes do not match its SHA-256")
    assert f"{shard / 'train-00000.bin'}: OK" in r.stdout and f"{shard / 'train-00001.bin'}: DAMAGED" in r.stdout
    rewrite(data, shard)  # what the line advises (kd prepare SRC COPY --overwrite) repairs it
    assert kd_main("verify", shard).returncode == 0


def rewrite(data: Path, copy: Path, overwrite: bool = True) -> None:
    """kd prepare (--overwrite unless told), with the settings of the ``copy`` fixture."""
    settings = Settings(max_side=48, shard_images=4)
    prepare(str(data), str(copy), settings, workers=1, overwrite=overwrite, progress=False, echo=lambda s: None)


def test_flipped_bytes_in_a_train_shard_stop_a_run_in_one_line(copy, data, tmp_path):
    """Raw pixels decode whatever their bytes, so a flipped byte trained unnoticed: each image's
    CRC-32, checked as a loader worker reads it, stops the run naming the shard and the image."""
    shard = spoiled(copy, tmp_path, lambda root: flip(root / "train-00001.bin", 3))  # image 6's pixels
    r = kd_main("train", "--data", shard, *TINY, *SMALL, "-j", 1, "-b", 4, "--epochs", 1, "--out", tmp_path / "r")
    image = data.resolve() / "train" / "class_01" / "002.jpg"
    one_line(r, f"is damaged: train-00001.bin, image 6 ({image}): its bytes do not match their CRC-32")
    assert f"kd prepare {data.resolve()} {shard} --overwrite" in r.stderr


#: a student of 0.4 M parameters in place of TINY's resnet18, where what is tested is the data
SMALL = ["--student", "timm:test_resnet"]


def as_format_1(root: Path) -> None:
    """The copy in ``root`` as kd prepare wrote it before each image had its CRC-32: index records
    without one, and a sealed manifest of format 1."""
    manifest = json.loads((root / MANIFEST).read_text())
    for split in ("train", "val"):
        path = root / f"{split}.index.npy"
        records = np.load(path)
        old = np.empty(len(records), dtype=[(n, records.dtype[n]) for n in records.dtype.names if n != "crc32"])
        for name in old.dtype.names:
            old[name] = records[name]
        np.save(path, old)
        manifest["splits"][split]["index_sha256"] = file_sha256(path)
    (root / MANIFEST).write_text(json.dumps(sealed({**manifest, "format_version": 1})))


def test_a_copy_of_format_1_trains_with_a_note_and_kd_prepare_adds_the_check(copy, data, tmp_path):
    old = spoiled(copy, tmp_path, as_format_1)
    r = kd_main("train", "--data", old, *TINY, *SMALL, "--epochs", 1, "--out", tmp_path / "r")
    assert r.returncode == 0, r.stderr
    note = f"format 1: its images are not checked as they are read; kd prepare {data.resolve()} {old} adds the check"
    assert note in r.stderr, r.stderr
    assert "its images are not checked as a run reads them" in kd_main("verify", old).stdout
    rewrite(data, old, overwrite=False)  # what the note advises
    assert read_manifest(old)["format_version"] == FORMAT_VERSION > 1
    assert "crc32" in np.load(old / "train.index.npy").dtype.names
    assert kd_main("verify", old).returncode == 0


def test_a_flipped_byte_in_an_index_is_refused_at_the_start(copy, data, tmp_path):
    def relabel(root: Path) -> None:  # the last record's label (its 21st byte of 37) changed
        data = bytearray((root / "val.index.npy").read_bytes())
        data[-17] ^= 0x01
        (root / "val.index.npy").write_bytes(bytes(data))

    index = spoiled(copy, tmp_path, relabel)
    r = kd_main("train", "--data", index, *TINY, "--epochs", 1, "--out", tmp_path / "r")
    one_line(r, "val.index.npy does not match its SHA-256 in the manifest")
    assert not (tmp_path / "r" / "checkpoints").exists()
    one_line(kd_main("verify", index), "val.index.npy")


def test_a_copy_missing_its_val_index_is_refused_in_one_line(copy, data, tmp_path):
    missing = spoiled(copy, tmp_path, lambda root: (root / "val.index.npy").unlink())
    r = kd_main("train", "--data", missing, *TINY, "--epochs", 1, "--out", tmp_path / "r")
    one_line(r, "val.index.npy is missing")
    assert not (tmp_path / "r").exists()
    one_line(kd_main("verify", missing), "val.index.npy")


def test_kd_verify_reads_each_student_of_a_run_of_several(data, tmp_path):
    teacher = ["--teacher", "resnet18", "--teacher-weights", "none", *TINY[1:]]
    out = tmp_path / "several"
    r = kd_main("train", "--data", data, *teacher, "--kd-loss", "kd,dkd", "--epochs", 1, "--out", out)
    assert r.returncode == 0, r.stderr
    r = kd_main("verify", out)
    assert r.returncode == 0, r.stderr
    for name in ("kd", "dkd"):
        assert f"{out / name / 'checkpoints' / 'last.pt'}: OK" in r.stdout.splitlines(), r.stdout
    flip(out / "dkd" / "checkpoints" / "best.pt")
    one_line(kd_main("verify", out), "dkd/checkpoints/best.pt is damaged")


def test_a_reader_beside_a_run_writing_its_checkpoint_never_calls_it_damaged(tmp_path, monkeypatch):
    """kd verify or kd eval of last.pt while the run replaces it: the reader has read the sums file,
    the run then writes its next checkpoint whole, and the reader hashes the new file."""
    from kd.utils.checkpoint_io import save_atomic

    path = tmp_path / "last.pt"
    save_atomic({"w": torch.zeros(8)}, path)
    real, raced = checkpoint_io.file_sha256, []

    def file_sha256(p):
        if not raced:  # between the reader's reading of the sums file and its hashing of the file
            raced.append(p)
            save_atomic({"w": torch.ones(8)}, path)
        return real(p)

    monkeypatch.setattr(checkpoint_io, "file_sha256", file_sha256)
    assert checkpoint_io.verify(path) and raced


def test_a_file_that_cannot_be_read_to_check_it_is_one_line(tmp_path):
    """An I/O error while hashing (here: a folder where the file should be) is one line, not a traceback."""
    path = tmp_path / "last.pt"
    path.mkdir()
    (tmp_path / "last.pt.sha256").write_text(f"{'0' * 64}  last.pt\n")
    with pytest.raises(KDError, match=f"cannot read {path} to check it"):
        checkpoint_io.verify(path)


def test_a_sums_file_in_bsd_form_beside_weights_is_read(tmp_path):
    """``sha256sum --tag`` writes ``SHA256 (NAME) = HEX``: such a file beside weights checks them."""
    import subprocess

    path = tmp_path / "w.pt"
    torch.save({"fc.weight": torch.ones(2)}, path)
    tagged = subprocess.run(["sha256sum", "--tag", path.name], cwd=tmp_path, capture_output=True, text=True).stdout
    (tmp_path / "w.pt.sha256").write_text(tagged)
    assert tagged.startswith("SHA256 (w.pt) = ") and checkpoint_io.verify(path)
    flip(path)
    checkpoint_io._verified.clear()
    with pytest.raises(KDError, match="is damaged"):
        checkpoint_io.verify(path)
