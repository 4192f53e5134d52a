"""timm's training augmentations (--aa, --reprob, --color-jitter): timm's own output for the
sample's seeded draws, the same whatever the workers, and a run that resumes bit for bit."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import kd_main, one_error_line, resumes_bit_for_bit
from torch.utils.data import DataLoader

from kd.config import RunConfig
from kd.data.augment import AUGMENT_PART, ERASE_PART, TrainAugment, augment_seed
from kd.data.folder import ImageFolderPIL, collate, to_uint8_chw
from kd.data.layout import scan
from kd.data.loader import MEAN, STD, seed_worker
from kd.data.sampler import SeededSampler

AA = "rand-m9-mstd0.5-inc1"
SEED = 1234


def dataset(folder, **options) -> ImageFolderPIL:
    """The training set of ``folder`` at 32 px with the augmentations of ``options`` (RunConfig keys)."""
    cfg = RunConfig(**options)
    augment = TrainAugment(32, cfg, (MEAN, STD))
    return ImageFolderPIL(scan(str(folder))[1], 32, True, augment=augment, train_interpolation=cfg.train_interpolation)


def test_randaugment_is_timms_rand_augment_transform_for_the_samples_draws(image_folder):
    """The crop kd hands on is timm's rand_augment_transform (built as timm's create_transform
    builds it) of the plain crop, run with Python's and NumPy's generators at the sample's seed."""
    from PIL import Image
    from timm.data.auto_augment import rand_augment_transform

    data = dataset(image_folder, aa=AA)
    # timm's hparams for 32 px crops, ImageNet's mean and --train-interpolation bilinear
    hparams = dict(translate_const=int(32 * 0.45), img_mean=(124, 116, 104), interpolation=Image.BILINEAR)  # type: ignore[attr-defined]
    timm_aa = rand_augment_transform(AA, hparams)
    changed = 0
    for index in range(4):
        plain, _, _ = data.crop((index, SEED + index))
        random.seed(augment_seed(SEED + index, AUGMENT_PART))
        np.random.seed(augment_seed(SEED + index, AUGMENT_PART) % 2**32)
        expected = to_uint8_chw(timm_aa(plain))
        got = data[(index, SEED + index)][0]
        assert torch.equal(got, expected), index
        changed += not torch.equal(got, to_uint8_chw(plain))
    assert changed > 0


def test_random_erasing_is_timms_for_the_samples_draws(image_folder):
    """--reprob 1: the normalised crop erased by timm's RandomErasing (pixel fill) run with Python's
    and torch's generators at the sample's seed; the global generators as they were after."""
    from timm.data.random_erasing import RandomErasing

    data = dataset(image_folder, reprob=1.0, recount=2)
    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    for index in range(3):
        plain = (to_uint8_chw(data.crop((index, SEED))[0]).float() - mean) / std
        with torch.random.fork_rng():
            random.seed(augment_seed(SEED, ERASE_PART))
            torch.manual_seed(augment_seed(SEED, ERASE_PART))
            expected = RandomErasing(1.0, mode="pixel", max_count=2, device="cpu")(plain.clone())
        state = torch.random.get_rng_state(), random.getstate()
        got = data[(index, SEED)][0]
        assert got.dtype == torch.float32 and not torch.equal(got, plain)
        assert torch.equal(got, expected), index
        assert torch.equal(torch.random.get_rng_state(), state[0]) and random.getstate() == state[1]


def test_a_sample_augments_alike_with_0_and_2_workers(image_folder):
    """The batches of 0 and 2 forked workers (each with its own global generators, seeded per worker
    as kd's loaders seed them) are equal: every draw comes from the sample's seed."""
    data = dataset(image_folder, aa=AA, reprob=0.5, remode="pixel")

    def batches(workers: int):
        sampler = SeededSampler(len(data), 1, 0, shuffle=True, seed=3, pad=True)
        extra = dict(multiprocessing_context="fork", worker_init_fn=seed_worker) if workers else {}
        loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=workers, collate_fn=collate, **extra)
        return [b[0] for b in loader]

    random.seed(99)  # the main process's generators as a run may leave them
    alone, forked = batches(0), batches(2)
    assert len(alone) == len(forked) == 6
    assert all(torch.equal(a, b) for a, b in zip(alone, forked))


@pytest.mark.parametrize(
    "options, words",
    [
        (["--aa", "rand-x9"], ["--aa rand-x9", "Unknown RandAugment config section"]),
        (["--aa", "randaugment"], ["--aa randaugment is no augmentation string timm reads (rand-m9-mstd0.5-inc1, "]),
        (["--reprob", "1.5"], ["--reprob must be between 0 and 1"]),
        (["--aa", AA, "--loader", "gpu"], ["--loader gpu", "--loader pil"]),
    ],
)
def test_bad_augmentations_are_refused_in_one_line_before_any_work(tmp_path, image_folder, options, words):
    args = ["--data", image_folder, "--student", "timm:test_resnet", "--no-teacher", "--device", "cpu"]
    r = kd_main("train", *args, "--out", tmp_path / "r", *options)
    line = one_error_line(r)
    assert all(w in line for w in words), line
    assert not line.rstrip().endswith(":"), line  # a reason that says nothing is left out
    assert not (tmp_path / "r").exists()


def test_a_run_with_randaugment_and_erasing_resumes_bit_for_bit(tmp_path, image_folder):
    """kd train --aa rand-m9-mstd0.5-inc1 --reprob 0.25 as a user types it trains, says where the
    augmentations run, and resumed from a checkpoint of its fourth step (mid-epoch) ends bit for bit
    where it ended."""
    args = ["--data", image_folder, "--student", "timm:test_resnet", "--no-teacher", "--image-size", "32", "-b", "8"]
    args += ["--device", "cpu", "--workers", "0", "--aa", AA, "--reprob", "0.25", "--lr", "0.01"]
    args += ["--epochs", "2", "--save-every-steps", "2", "--keep-last", "9"]
    r = resumes_bit_for_bit(tmp_path, args, 4)
    assert f"timm's --aa {AA}, --reprob 0.25 on the crops there" in r.stderr, r.stderr


def test_a_soft_label_store_pins_the_augmentations():
    """A store's logits are the teacher's on its crops: a run with other augmentations is refused
    with the reason; a store written without them (no key in its manifest) serves a run without them."""
    from kd.teacher.store import mismatch, wanted_manifest

    samples = [("train/a/0.jpg", 0)]
    plain = wanted_manifest(RunConfig(), samples, 1)
    augmented = wanted_manifest(RunConfig(aa=AA, reprob=0.25), samples, 1)
    reason = mismatch(plain, augmented)
    assert reason is not None and "timm's augmentations" in reason and f"aa={AA}" in reason
    assert mismatch({k: v for k, v in plain.items() if k != "augment"}, plain) is None
    assert mismatch(augmented, wanted_manifest(RunConfig(aa=AA, reprob=0.25), samples, 1)) is None


def test_colour_jitter_is_torchvisions_for_the_samples_draws_and_two_views_are_normalised(image_folder):
    """--color-jitter 0.4: torchvision's ColorJitter(0.4, 0.4, 0.4) (timm's) run with torch's
    generator at the sample's seed; with --reprob, a two-view sample has both views normalised."""
    from torchvision.transforms import ColorJitter

    data = dataset(image_folder, color_jitter=0.4)
    plain, _, _ = data.crop((0, SEED))
    with torch.random.fork_rng():
        torch.manual_seed(augment_seed(SEED, AUGMENT_PART))
        expected = to_uint8_chw(ColorJitter(0.4, 0.4, 0.4)(plain))
    assert torch.equal(data[(0, SEED)][0], expected) and not torch.equal(expected, to_uint8_chw(plain))
    two = dataset(image_folder, aa=AA, reprob=0.5)
    two.views = 2
    pair = two[(0, SEED)][0]
    assert pair.shape == (2, 3, 32, 32) and pair.dtype == torch.float32
    assert torch.equal(pair[0], dataset(image_folder, aa=AA, reprob=0.5)[(0, SEED)][0])
