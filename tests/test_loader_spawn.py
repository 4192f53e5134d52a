"""DataLoader workers under the spawn start method (macOS's and Windows' default), where every
worker imports torch: the companion of test_loader.py's fork and forkserver runs."""

from __future__ import annotations

import pytest
from conftest import make_image_folder
from test_loader import train_two_epochs_with_two_workers


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("workers"), classes=2, train_per_class=8, val_per_class=3)


@pytest.mark.slow
def test_two_workers_with_spawn(data, tmp_path):
    """The single process (macOS's and Windows' usual run). Not a rank of torch_ddp: it starts its
    spawned workers as this process does (its ``__main__`` is cli too, which each worker imports
    again), and its dataset pickles as under forkserver, which test_launch's run of kd's launcher
    with workers covers."""
    train_two_epochs_with_two_workers(data, tmp_path, "single", "spawn")
