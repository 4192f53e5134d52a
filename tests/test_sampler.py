"""The training sampler (kd.data.sampler) with repeated augmentation: each rank's samples of an epoch
are those of timm's RepeatAugSampler (DeiT's RASampler for sets of 256 samples or more), each repeat
draws from a seed of its own, one process and several see the same global batches, and a mid-epoch
skip resumes the same sequence; --repeated-aug is refused where it cannot serve."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import kd_main, one_error_line, tiny_config
from timm.data.distributed_sampler import RepeatAugSampler

from kd.data.sampler import SeededSampler, sample_seed
from kd.errors import KDError


def repeated(size: int, replicas: int, rank: int, seed: int, epoch: int, repeats: int = 3, skip: int = 0):
    sampler = SeededSampler(size, replicas, rank, shuffle=True, seed=seed, pad=True, repeats=repeats)
    sampler.set_epoch(epoch, skip)
    return list(sampler)


@pytest.mark.parametrize("size", [10, 25, 100, 300, 1000])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_each_rank_gets_the_samples_of_timms_repeat_aug_sampler(size, replicas):
    """kd's order is torch's DistributedSampler's (shuffled by seed + epoch); timm's and DeiT's are
    shuffled by the epoch alone: kd at --seed S, epoch E deals as they do at epoch S + E."""
    for seed, epoch, repeats in ((0, 0, 3), (0, 4, 3), (5, 2, 3), (1, 1, 2)):
        for rank in range(replicas):
            timm = RepeatAugSampler(range(size), replicas, rank, num_repeats=repeats)
            timm.set_epoch(seed + epoch)
            ours = SeededSampler(size, replicas, rank, shuffle=True, seed=seed, pad=True, repeats=repeats)
            ours.set_epoch(epoch)
            assert [i for i, _ in ours] == list(timm), (seed, epoch, repeats, rank)
            assert len(ours) == ours.total() == len(timm)


def test_the_epoch_keeps_deits_length_and_a_samples_repeats_meet_on_different_ranks():
    """1,000 samples on 4 processes: DeiT's floor(1000 // 256 * 256 / 4) = 192 each, 768 in all, so
    a third of the set is met per epoch, three times; the repeats of a sample go to three ranks."""
    ranks = [repeated(1000, 4, rank, seed=7, epoch=2) for rank in range(4)]
    assert [len(r) for r in ranks] == [192] * 4
    met = Counter(index for r in ranks for index, _ in r)
    assert len(met) == 256 and set(met.values()) == {3}
    where = {}
    for rank, pairs in enumerate(ranks):
        for index, _ in pairs:
            where.setdefault(index, set()).add(rank)
    assert all(len(where[i]) == met[i] for i in met)  # never twice on one rank


def test_each_repeat_draws_from_its_own_seed():
    """Every (sample, repeat) of an epoch has its own seed, sample_seed(seed, epoch, index, repeat);
    repeat 0 draws as the sample does without --repeated-aug, and the next epoch draws anew."""
    pairs = repeated(300, 1, 0, seed=3, epoch=1)
    seeds = [s for _, s in pairs]
    assert len(set(seeds)) == len(seeds) == 256
    plain = SeededSampler(300, 1, 0, shuffle=True, seed=3, pad=True)
    plain.set_epoch(1)
    unrepeated = dict(plain)
    seen: Counter = Counter()
    for index, s in pairs:
        assert s == sample_seed(3, 1, index, seen[index])
        assert (s == unrepeated[index]) == (seen[index] == 0)
        seen[index] += 1
    assert Counter(seen.values()) == {3: 85, 1: 1}  # 256 draws: 85 samples three times, then one
    assert not set(seeds) & {s for _, s in repeated(300, 1, 0, seed=3, epoch=2)}
    # a tiny set dealt past its end (timm's padding) still gives each draw a seed of its own
    tiny = [s for r in range(4) for _, s in repeated(2, 4, r, seed=0, epoch=0, repeats=2)]
    assert len(set(tiny)) == len(tiny) == 4


@pytest.mark.parametrize("size, batch", [(300, 8), (1000, 16), (40, 8)])
def test_one_process_and_several_see_the_same_global_batches(size, batch):
    """Global batch k of N processes (each rank's k-th batch of batch / N) holds the same (sample,
    seed) pairs as batch k of one process, for every full batch both have; DeiT's epoch (256 samples
    or more) has as many full batches under any N that divides the batch."""
    one = repeated(size, 1, 0, seed=11, epoch=3)
    for replicas in (2, 4):
        local = batch // replicas
        ranks = [repeated(size, replicas, rank, seed=11, epoch=3) for rank in range(replicas)]
        steps = min(len(r) for r in ranks) // local
        if size >= 256:
            assert steps == len(one) // batch
        for k in range(steps):
            together = [pair for r in ranks for pair in r[k * local : (k + 1) * local]]
            assert Counter(together) == Counter(one[k * batch : (k + 1) * batch]), (replicas, k)


def test_the_order_is_a_pure_function_of_seed_and_epoch_and_a_skip_resumes_it():
    whole = repeated(300, 2, 1, seed=4, epoch=5)
    assert repeated(300, 2, 1, seed=4, epoch=5) == whole
    assert repeated(300, 2, 1, seed=4, epoch=6) != whole and repeated(300, 2, 1, seed=5, epoch=5) != whole
    sampler = SeededSampler(300, 2, 1, shuffle=True, seed=4, pad=True, repeats=3)
    sampler.set_epoch(5, skip=40)
    assert list(sampler) == whole[40:] and len(sampler) == len(whole) - 40


def test_the_training_loader_repeats_each_sample_with_other_crops(image_folder, tmp_path):
    """--repeated-aug 3 reaches the run's training loader: a batch holds each sample three times in a
    row, as three different crops; its val loader is as without."""
    from kd.data import build

    cfg = tiny_config(image_folder, tmp_path / "r", repeated_aug=3, batch_size=6)
    data = build(cfg, 1, 0, 6, torch.device("cpu"), False)
    try:
        data.train.set_epoch(0)
        batch = next(iter(data.train))
        first = batch.indices[:3]
        assert torch.equal(first, first[:1].expand(3)) and batch.indices[3] != first[0]
        assert torch.equal(batch.labels[:3], batch.labels[:1].expand(3))
        assert not torch.equal(batch.images[0], batch.images[1]) and not torch.equal(batch.images[1], batch.images[2])
        plain = build(tiny_config(image_folder, tmp_path / "p", batch_size=6), 1, 0, 6, torch.device("cpu"), False)
        try:
            assert len(data.val) == len(plain.val)
            assert all(torch.equal(a.images, b.images) for a, b in zip(data.val, plain.val))
        finally:
            plain.close()
    finally:
        data.close()


@pytest.mark.parametrize(
    "options, words",
    [
        (dict(repeated_aug=1), "2 or more"),
        (dict(repeated_aug=-3), "2 or more"),
        (dict(repeated_aug=3, kd_loss="crd"), "crd"),
        (dict(repeated_aug=3, soft_labels="store"), "--soft-labels"),
    ],
)
def test_what_cannot_repeat_is_refused(tmp_path, image_folder, options, words):
    with pytest.raises(KDError, match=words):
        tiny_config(image_folder, tmp_path / "r", **options)


def test_kd_teach_refuses_it_in_one_line_and_leaves_no_store(tmp_path, image_folder):
    out = tmp_path / "store"
    r = kd_main("teach", "--data", image_folder, "--teacher", "resnet18", "--teacher-weights", "none",
                "--repeated-aug", "3", "--out", out)  # fmt: skip
    line = one_error_line(r)
    assert "kd teach" in line and "--repeated-aug 0" in line, line
    assert not out.exists()
