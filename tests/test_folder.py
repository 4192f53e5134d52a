"""ImageNet-layout folders (kd.data.folder): a class folder without images is named, by the scan
and by kd train in one error line."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import kd_main, make_image_folder, one_error_line, train_args

from kd.errors import KDError


def _without_images(folder: Path) -> None:
    for f in folder.iterdir():
        f.unlink()


def test_scan_names_class_folders_without_images(tmp_path):
    from kd.data.layout import scan

    data = make_image_folder(tmp_path / "d", classes=3, train_per_class=2, val_per_class=1)
    for split in ("train", "val"):
        (data / split / "class_09").mkdir()
    (data / "val" / "class_09" / "notes.txt").write_text("not an image")
    with pytest.raises(KDError) as err:
        scan(str(data))
    assert "train/class_09" in str(err.value) and "val/class_09" in str(err.value), err.value
    assert "no image" in str(err.value)


def test_scan_names_an_empty_train_class_with_val_images(tmp_path):
    from kd.data.layout import scan

    data = make_image_folder(tmp_path / "d", classes=3, train_per_class=2, val_per_class=1)
    _without_images(data / "train" / "class_01")
    with pytest.raises(KDError, match="train/class_01") as err:
        scan(str(data))
    assert "val/class" not in str(err.value)


def test_train_with_an_empty_class_folder_is_one_clear_error(tmp_path):
    data = make_image_folder(tmp_path / "d", classes=3, train_per_class=2, val_per_class=1)
    for split in ("train", "val"):
        (data / split / "class_03").mkdir()
    r = kd_main(*train_args(data, tmp_path / "run", no_teacher=True, batch_size=4))
    line = one_error_line(r)
    assert "class_03" in line, line
