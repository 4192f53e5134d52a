"""DataLoader workers under the spawn start method (macOS's and Windows' default), where every
worker imports torch: the companion of test_loader.py's fork and forkserver runs."""

from __future__ import annotations

import pytest
from conftest import make_image_folder
from test_loader import START_METHOD_BACKENDS, train_two_epochs_with_two_workers


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("workers"), classes=2, train_per_class=8, val_per_class=3)


@pytest.mark.slow
@pytest.mark.parametrize("backend", START_METHOD_BACKENDS)
def test_two_workers_under_every_backend_with_spawn(data, tmp_path, backend):
    train_two_epochs_with_two_workers(data, tmp_path, backend, "spawn")
