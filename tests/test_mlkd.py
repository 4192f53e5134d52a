"""MLKD held equal to the official code, with and without logit standardisation.

Golden values: Jin-Ying/Multi-Level-Logit-Distillation ``mdistiller/distillers/KD_ours.py``
(``KD_ours.forward_train``) at commit 5ee473fcf193dfb00a0598b64d0acfe6ad58a482, and for
``standardise`` 1 sunshangquan/logit-standardization-KD ``mdistiller/distillers/MLKD.py`` at commit
f6e5aa5172bad618e801163c3385322eea673754. A script outside this repository imported those files
unmodified, gave the distiller a student and a teacher that return the fixed float64 logits of
:func:`inputs` for each view, summed its losses as the official trainer does (``AugTrainer``) and
printed with ``repr`` each loss, the total and three probes of the gradient with respect to the
student's logits of each view (:func:`conftest.gradient_probes`).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_RUN, golden_logits, gradient_probes, kd_main, last_checkpoint, train_args

from kd.errors import KDError
from kd.losses import DistillInputs, build_loss
from kd.losses.mlkd import confidence_shares

RTOL = 1e-9

# (batch, classes, temperature, ce_weight, kd_weight, tie, standardise) -> the official values: (loss_ce, loss_kd,
# loss_cc, loss_bc), the total, the gradient probes of the weak view's and of the strong view's student logits
# fmt: off
OFFICIAL = {
    (6, 5, 1.0, 0.5, 0.5, False, False): (
        (3.5985241043769625, 13.417227409718832, 0.026202637286324555, 0.15636281796013496), 17.198316969342255,
        [0.16833655254808688, 0.14835115871948543, 1.4632992908434954],
        [-3.8958478163561114, 0.028719100029428013, 0.5975062658014809]),
    (5, 7, 4.0, 1.0, 2.0, False, False): (
        (6.426736243353217, 68.03282481502369, 0.5231616547056153, 0.3000030943941463), 75.28272580747667,
        [32.49952775969778, 0.5611695029161843, 27.507515690751497],
        [2.4867929903588095, -0.7511092343800552, 8.920761884286886]),
    (4, 5, 2.0, 0.5, 0.5, True, False): (
        (3.319487503091721, 16.662530993628497, 0.19338195312147427, 0.05281974373755621), 20.228220193579247,
        [7.087515973302713, -0.7093266003607408, 3.820144512030283],
        [-3.276971839522168, -0.4208818962312805, 1.000882056286824]),
    (6, 5, 1.0, 0.5, 0.5, False, True): (
        (3.5985241043769625, 2.8116078712150454, 0.026202637286324555, 0.15636281796013496), 6.592697430838467,
        [0.6090234988332288, 0.013690226266776656, 0.10647309311690466],
        [-0.6815708321888898, 0.020479773223013337, 0.05679459519987633]),
    (5, 7, 4.0, 1.0, 2.0, False, True): (
        (6.426736243353217, 12.089658386943992, 0.5231616547056153, 0.3000030943941463), 19.339559379396967,
        [2.340890754210091, 0.03180486089433046, 0.5668603052925315],
        [0.9998685769460733, -0.02723496153109256, 0.3586052321569976]),
}
# fmt: on


def inputs(batch, classes, tie):
    """Student weak, student strong, teacher weak, teacher strong logits and labels (float64)."""
    sw = golden_logits(batch, classes, 0.7, 0.1, 3.0)
    ss = golden_logits(batch, classes, 1.3, 0.4, 2.5)
    tw = golden_logits(batch, classes, 0.9, 0.2, 4.0)
    ts = golden_logits(batch, classes, 1.1, 0.5, 3.5)
    if tie:  # three samples the teacher is equally sure of, the median among them
        tw[1] = tw[0]
        tw[2] = tw[0]
    return sw, ss, tw, ts, torch.arange(batch) * 2 % classes


@pytest.mark.parametrize("case", list(OFFICIAL), ids=lambda c: f"b{c[0]}-c{c[1]}-T{c[2]}-tie{c[5]}-ls{c[6]}")
def test_mlkd_equals_the_official_code(case):
    batch, classes, temperature, ce_weight, kd_weight, tie, standardise = case
    (loss_ce, loss_kd, loss_cc, loss_bc), total, grad_weak, grad_strong = OFFICIAL[case]
    sw, ss, tw, ts, labels = inputs(batch, classes, tie)
    sw.requires_grad_()
    ss.requires_grad_()
    loss = build_loss(
        "mlkd",
        classes,
        dict(temperature=temperature, ce_weight=ce_weight, kd_weight=kd_weight, standardise=int(standardise)),
    )
    out = loss(DistillInputs(sw, labels, tw, second_student_logits=ss, second_teacher_logits=ts))
    assert (ce_weight * out["ce"]).item() == pytest.approx(loss_ce, rel=RTOL)
    assert out["kd"].item() == pytest.approx(loss_kd, rel=RTOL)
    assert out["cc"].item() == pytest.approx(loss_cc, rel=RTOL)
    assert out["bc"].item() == pytest.approx(loss_bc, rel=RTOL)
    assert out["loss"].item() == pytest.approx(total, rel=RTOL)
    out["loss"].backward()
    assert gradient_probes(sw.grad) == pytest.approx(grad_weak, rel=RTOL)
    assert gradient_probes(ss.grad) == pytest.approx(grad_strong, rel=RTOL)


def test_confidence_shares_take_the_median_as_numpy_does():
    """An even batch: the median lies between the two middle confidences (half the samples); ties at
    the median count every tied sample."""
    teacher = torch.tensor([[4.0, 0.0], [3.0, 0.0], [2.0, 0.0], [1.0, 0.0]])
    samples, classes = confidence_shares(teacher)
    assert samples.item() == 0.5 and classes.item() == 0.5  # two classes: the median is their mean
    samples, _ = confidence_shares(torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [4.0, 0.0]]))
    assert samples.item() == 0.75


def test_mlkd_in_float32_is_finite_and_close_to_float64():
    sw, ss, tw, ts, labels = inputs(6, 5, False)
    loss = build_loss("mlkd", 5, {})
    wide = loss(DistillInputs(sw, labels, tw, second_student_logits=ss, second_teacher_logits=ts))["loss"]
    narrow = loss(
        DistillInputs(
            sw.float(), labels, tw.float(), second_student_logits=ss.float(), second_teacher_logits=ts.float()
        )
    )["loss"]
    assert narrow.dtype == torch.float32
    assert narrow.item() == pytest.approx(wide.item(), rel=1e-5)


def test_mlkd_takes_two_views_and_refuses_unknown_settings():
    assert build_loss("mlkd", 5, {}).card.views == 2
    assert build_loss("kd", 5, {}).card.views == 1
    with pytest.raises(KDError, match="no hyper-parameter"):
        build_loss("mlkd", 5, {"alpha": 0.5})


# ---------------------------------------------------------------- the strong view in the loaders

CPU = torch.device("cpu")


def loaders(data, loader, views=2, **options):
    """The train and val loaders of a tiny run of ``data`` (batch 8, 32 px), with ``views`` views."""
    from kd import config as kd_config
    from kd.data.pipeline import build

    opts = dict(data=str(data), teacher="resnet18", student="resnet18", workers=0, image_size=32, batch_size=8)
    cfg = kd_config.resolve(options={**opts, "loader": loader, "val_cache_gb": 0, **options})
    return build(cfg, 1, 0, 8, CPU, False, views=views)


def epoch(loader, number=1, skip=0):
    loader.set_epoch(number, skip)
    return list(loader)


def test_every_randaugment_operation_and_the_cutout_keep_an_rgb_crop():
    from PIL import Image

    from kd.data.views import OPERATIONS, cutout, strong_augment

    img = Image.fromarray((torch.arange(32 * 32 * 3) % 251).reshape(32, 32, 3).numpy().astype("uint8"))
    for name, op, low, high in OPERATIONS:
        for v in (low, high):
            out = op(img, v)
            assert out.size == (32, 32) and out.mode == "RGB", name
    gen = torch.Generator().manual_seed(3)
    cut = cutout(img, gen)
    assert cut.size == img.size and (125, 123, 114) in [c for _, c in cut.getcolors(4096)]
    a = strong_augment(img, torch.Generator().manual_seed(5))
    assert a.tobytes() == strong_augment(img, torch.Generator().manual_seed(5)).tobytes()


def test_the_pil_loader_makes_a_strong_view_of_each_training_sample(image_folder):
    """Batches carry a second view of each sample, normalised as the first, other than it; the same
    each time an epoch is drawn, after a mid-epoch skip too; none in validation or with one view."""
    data = loaders(image_folder, "pil")
    full = epoch(data.train)
    assert len(full) == 3
    for b in full:
        assert b.second_images is not None and b.second_images.shape == b.images.shape == (8, 3, 32, 32)
        assert not torch.equal(b.images, b.second_images)
    again = epoch(data.train, skip=1)
    for a, b in zip(full[1:], again, strict=True):
        assert torch.equal(a.images, b.images) and torch.equal(a.second_images, b.second_images)
    other = epoch(data.train, number=2)
    assert not torch.equal(other[0].second_images, full[0].second_images)
    assert all(b.second_images is None for b in data.val)
    one = loaders(image_folder, "pil", views=1)
    first = epoch(one.train)
    assert all(b.second_images is None for b in first)
    assert all(torch.equal(a.images, b.images) for a, b in zip(full, first, strict=True))  # the first view as before


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_the_gpu_loader_makes_the_same_strong_views(image_folder, monkeypatch, share):
    """The GPU loader's workers finish each strong view with PIL: the device normalises it to the PIL
    loader's, bit for bit, in the batch's order, whatever share of the first views PIL decodes."""
    import kd.data.gpu as gpu_mod

    monkeypatch.setenv(gpu_mod.DECODER_ENV, "cpu-thread")
    gpu = loaders(image_folder, "gpu", cpu_decode_share=share)
    pil = loaders(image_folder, "pil")
    assert "strong view" in gpu.train.describe()
    for g, p in zip(epoch(gpu.train), epoch(pil.train), strict=True):
        assert torch.equal(g.labels, p.labels) and torch.equal(g.indices, p.indices)
        assert torch.equal(g.second_images, p.second_images)
        assert (g.images - p.images).abs().mean() < 0.05  # the first views: within rounding
    assert all(getattr(b, "second_images", None) is None for b in gpu.val)


@pytest.mark.parametrize("loader", ["pil", "gpu"])
def test_a_prepared_copy_gives_the_folders_strong_views(image_folder, tmp_path, monkeypatch, loader):
    """A raw-pixel copy of the (small) images holds their decoded pixels: both loaders read the same
    strong views from it as from the folder."""
    import kd.data.gpu as gpu_mod
    from kd.data.prepared_writer import Settings, prepare

    monkeypatch.setenv(gpu_mod.DECODER_ENV, "cpu-thread")
    copy = tmp_path / "copy"
    prepare(str(image_folder), str(copy), Settings(max_side=96, shard_images=16), workers=1, progress=False)
    folder, prepared = loaders(image_folder, "pil"), loaders(copy, loader)
    assert "prepared copy" in prepared.train.describe()
    for a, b in zip(epoch(folder.train), epoch(prepared.train), strict=True):
        assert torch.equal(a.labels, b.labels) and torch.equal(a.second_images, b.second_images)


# ---------------------------------------------------------------- through the engine
# (in two processes: test_feature_methods, a student beside CRD and CTKD in their two-process run)

#: the students of the one-process runs: timm's test_resnet (BatchNorm, 0.4 M parameters), taught by
#: resnet18; a resnet18 student's checkpoints, each epoch with momentum and a best copy, cost more
#: than its training
STUDENT = "timm:test_resnet"


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_student(a, b, what):
    assert a["global_step"] == b["global_step"], what
    assert a["student"].keys() == b["student"].keys()
    for key, value in a["student"].items():
        assert torch.equal(value, b["student"][key]), (what, key)


def test_mlkd_trains_and_a_resumed_run_equals_the_uninterrupted_one(image_folder, tmp_path):
    """Two epochs, and one epoch then a resume: the same weights bit for bit (the strong views drawn
    again from each sample's seed); the three levels logged."""
    options = dict(student=STUDENT, kd_loss="mlkd", lr_schedule="constant")
    r = kd_main(*train_args(image_folder, tmp_path / "full", epochs=2, **options))
    assert r.returncode == 0, r.stderr
    r = kd_main(*train_args(image_folder, tmp_path / "part", epochs=1, **options))
    assert r.returncode == 0, r.stderr
    r = kd_main("train", "--out", tmp_path / "part", "--resume", "--epochs", 2)
    assert r.returncode == 0, r.stderr
    assert_same_student(last_checkpoint(tmp_path / "full"), last_checkpoint(tmp_path / "part"), "resumed")
    last = records(tmp_path / "part")[-1]
    assert last["train_skipped_steps"] == 0
    assert all(last[f"train_{term}"] > 0 for term in ("ce", "kd", "cc", "bc")), last


def test_one_teacher_forward_per_view_for_every_student(image_folder, tmp_path):
    """kd and mlkd beside each other: per batch the teacher runs once on each view, whatever the
    students; the one-view student gets the first view's logits as alone."""
    import backends
    from kd.run.loop import Trainer
    from kd.run.students import plan

    options = {**TINY_RUN, "data": str(image_folder), "out": str(tmp_path / "run"), "kd_loss": "kd,mlkd"}
    students = plan([], options, [])
    backend = backends.get("single")(students.first)
    backend.setup()
    trainer = Trainer(students, backend)
    try:
        calls = []
        trainer.teacher.module.register_forward_hook(lambda m, args, out: calls.append(args[0].shape))
        trainer.data.train.set_epoch(0)
        batch = next(iter(trainer.data.train))
        assert batch.second_images is not None
        outs = trainer.step(batch)
        assert len(calls) == 2 and len(outs) == 2
        assert {"kd", "cc", "bc"} <= set(outs[1].parts) and "cc" not in outs[0].parts
    finally:
        trainer.close()


def test_mlkd_beside_kd_equals_their_separate_runs(image_folder, tmp_path):
    """One run of kd and mlkd (its loaders make the strong view, its teacher forwards it): each student
    bit for bit its own run; kd's batches and targets are those of a run without a second view."""
    options = dict(student=STUDENT, limit_train_batches=2)
    r = kd_main(*train_args(image_folder, tmp_path / "table", kd_loss="kd,mlkd", **options))
    assert r.returncode == 0, r.stderr
    for method in ("kd", "mlkd"):
        r = kd_main(*train_args(image_folder, tmp_path / method, kd_loss=method, **options))
        assert r.returncode == 0, r.stderr
        assert_same_student(last_checkpoint(tmp_path / "table" / method), last_checkpoint(tmp_path / method), method)


def test_soft_labels_refuse_mlkd(tmp_path):
    r = kd_main("train", "--data", "synthetic", "--student", "resnet18", "--kd-loss", "mlkd", "--soft-labels",
                tmp_path, "--out", tmp_path / "o")  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "--kd-loss mlkd also needs them on a second, strongly augmented view" in r.stderr, r.stderr


def test_mlkd_trains_on_synthetic_tensors_with_logit_standardisation(tmp_path):
    options = dict(student=STUDENT, teacher="resnet18", teacher_weights="none", image_size=32, batch_size=8)
    r = kd_main(*train_args("synthetic", tmp_path / "run", "--logit-standardisation", kd_loss="mlkd",
                            limit_train_batches=2, **options))  # fmt: skip
    assert r.returncode == 0, r.stderr
    cfg = (tmp_path / "run" / "config.yaml").read_text()
    assert "standardise: 1" in cfg or "standardise: true" in cfg, cfg
