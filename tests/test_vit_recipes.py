"""The ViT recipes (DeiT's hard distillation, cls_KD's DeiT III -> DeiT-Ti KD): their teachers' weights and
students are the sources', what kd cannot run of those sources is refused as the recipes say, and their
reference rows reach ``kd recipes list`` and ``kd report --format latex``. The recipes' other fields are held
against the sources in tests/test_recipes.py (PUBLISHED)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import kd_main

from kd import config as kd_config
from kd.errors import KDError

DEIT = ("imagenet/deit_ti_distilled", "imagenet/deit_s_distilled")
DEIT3 = "imagenet/deit3s_deitti_kd"
DEIT3_NKD = "imagenet/deit3s_deitti_nkd"
ALONE = ("imagenet/baseline_deit_ti", "imagenet/baseline_deit_s")  # DeiT's recipe without distillation
#: the weights each teacher was trained with, as the sources name them
TEACHER_FILES = {
    # facebookresearch/deit@7e160fe README_deit.md:241 --teacher-path
    "imagenet/deit_ti_distilled": "https://dl.fbaipublicfiles.com/deit/regnety_160-a5fe301d.pth",
    "imagenet/deit_s_distilled": "https://dl.fbaipublicfiles.com/deit/regnety_160-a5fe301d.pth",
    # yzd-v/cls_KD@1e5d48f deit-s3_distill_deit-t_img.py:24 is mmcls's deit3-small-p16_in21k-pre_3rdparty_in1k,
    # converted from this file (configs/deit3/metafile.yml:72-74)
    DEIT3: "https://dl.fbaipublicfiles.com/deit/deit_3_small_224_21k.pth",
    DEIT3_NKD: "https://dl.fbaipublicfiles.com/deit/deit_3_small_224_21k.pth",
}


@pytest.mark.parametrize("name", sorted(TEACHER_FILES))
def test_the_teacher_tag_holds_the_sources_weights(name):
    from timm.models import get_pretrained_cfg

    cfg = kd_config.resolve(recipe=name)
    assert cfg.teacher_weights == "pretrained"  # the tag's weights
    tag = cfg.teacher.split(":", 1)[1]
    assert get_pretrained_cfg(tag).url == TEACHER_FILES[name]


def _meta_student(cfg):
    from kd.models import construct

    with torch.device("meta"):
        return construct(cfg.student, 1000, "none", drop_path=cfg.drop_path)


@pytest.mark.parametrize("name", DEIT)
def test_deit_students_train_both_heads_with_deits_stochastic_depth(name):
    """The distilled DeiT's distillation token and head train (kd's deit method switches them on), its
    stochastic depth rises to --drop-path over the blocks as DeiT's does (linspace(0, 0.1, depth)), and the
    distillation token is not decayed (DeiT's no_weight_decay)."""
    from kd.models import drop_path_rates, train_both_heads

    cfg = kd_config.resolve(recipe=name)
    student = _meta_student(cfg)
    train_both_heads(student, cfg.student, cfg.kd_loss)
    assert student.distilled_training
    # timm's blocks: DropPath after attention and after the MLP, Identity in the first block (its rate 0)
    deit = [0.1 * i / 11 for i in range(12)]  # DeiT's torch.linspace(0, drop_path, depth 12)
    assert sorted(drop_path_rates(student)) == pytest.approx(sorted(deit[1:] * 2))
    assert {"pos_embed", "cls_token", "dist_token"} <= set(student.no_weight_decay())


def test_the_deit3_row_trains_the_plain_deit_tiny_without_stochastic_depth():
    from kd.models import drop_path_rates, train_both_heads

    cfg = kd_config.resolve(recipe=DEIT3)
    student = _meta_student(cfg)
    assert not any(drop_path_rates(student))
    with pytest.raises(KDError, match="distillation token"):
        train_both_heads(student, cfg.student, "deit")


@pytest.mark.parametrize("name", [DEIT3, DEIT3_NKD])
def test_the_deit3_rows_train_unmixed_as_cls_kds_distiller_does(name):
    """cls_KD's distiller config replaces the model dict (``_delete_``) and with it the DeiT config's Mixup and
    CutMix, which ClassificationDistiller would take only from its own ``train_cfg``: its labels stay class
    indices, label-smoothed by 0.1. Were they mixed, NKD would take each mixed sample's larger part."""
    cfg = kd_config.resolve(recipe=name)
    assert (cfg.mixup, cfg.cutmix, cfg.smoothing, cfg.label_smoothing) == (0.0, 0.0, 0.0, 0.1)
    mixed = kd_config.resolve(recipe=name, options={"mixup": 0.8, "label_smoothing": 0.0, "smoothing": 0.1})
    assert mixed.mixup == 0.8  # each row's method takes mixed targets where a user mixes


@pytest.mark.parametrize("name", DEIT + ALONE)
def test_deit_recipes_repeat_each_sample_as_deits_rasampler(name):
    """DeiT's RASampler repeats each sample 3 times (main.py:105-107 on by default, samplers.py:15)."""
    assert kd_config.resolve(recipe=name).repeated_aug == 3
    assert not any("repeated" in d for d in kd_config.resolve(recipe=name).reference["differences"])


def test_recipes_list_shows_the_vit_rows():
    from kd.commands.recipes import table

    rows = {line.split(" | ")[0][2:]: line for line in table().splitlines()[2:]}
    assert rows["imagenet/deit_ti_distilled"].endswith("| 4 GPUs x 256 | 74.50 |"), rows["imagenet/deit_ti_distilled"]
    assert rows["imagenet/deit_s_distilled"].endswith("| 4 GPUs x 256 | 81.20 |")
    assert rows[DEIT3].endswith("| 4 GPUs x 256 | 76.01 |")
    assert rows[DEIT3_NKD].endswith("| nkd | 300 | 1024 | 0.001 | 4 GPUs x 256 | 76.68 |"), rows[DEIT3_NKD]
    assert rows["imagenet/baseline_deit_ti"].endswith("| ce | 300 | 1024 | 0.001 | 4 GPUs x 256 | 72.20 |")
    assert rows["imagenet/baseline_deit_s"].endswith("| 4 GPUs x 256 | 79.80 |")
    assert (
        "| timm:regnety_160.deit_in1k | timm:deit_tiny_distilled_patch16_224 | deit | 300 | 1024 | 0.001 |"
        in (rows["imagenet/deit_ti_distilled"])
    )


def _run(root, recipe, top1):
    """A run folder of ``recipe`` as kd writes it, on ImageNet-1k's training images: two evaluated epochs."""
    out = root / recipe.split("/")[-1]
    out.mkdir(parents=True)
    kd_config.save(kd_config.resolve(recipe=recipe), out / "config.yaml")
    records = [
        {"epoch": e, "train_images": 1_281_167, "val_top1": v, "val_top5": v + 18, "seconds": 60}
        for e, v in ((1, top1 - 3), (2, top1))
    ]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return out


def test_report_latex_puts_each_vit_recipe_beside_its_reference(tmp_path):
    _run(tmp_path, "imagenet/deit_ti_distilled", 74.2)
    _run(tmp_path, "imagenet/deit_s_distilled", 81.3)
    _run(tmp_path, DEIT3, 75.9)
    _run(tmp_path, DEIT3_NKD, 76.5)
    _run(tmp_path, "imagenet/baseline_deit_ti", 72.0)  # the student alone of the DeiT III -> DeiT-Ti table
    r = kd_main("report", tmp_path, "--format", "latex", "--epoch", "best")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    tables = [  # each pair's table (its header line names teacher and student) holds the method's row
        ("timm:regnety_160.deit_in1k", "timm:deit_tiny_distilled_patch16_224", "DeiT & 74.20 & 92.20 & 74.50 & -0.30"),
        ("timm:regnety_160.deit_in1k", "timm:deit_small_distilled_patch16_224", "DeiT & 81.30 & 99.30 & 81.20 & +0.10"),
        (
            "timm:deit3_small_patch16_224.fb_in22k_ft_in1k",
            "timm:deit_tiny_patch16_224",
            "KD & 75.90 & 93.90 & 76.01 & -0.11",
        ),
        (
            "timm:deit3_small_patch16_224.fb_in22k_ft_in1k",
            "timm:deit_tiny_patch16_224",
            "NKD & 76.50 & 94.50 & 76.68 & -0.18",
        ),
        (
            "timm:deit3_small_patch16_224.fb_in22k_ft_in1k",
            "timm:deit_tiny_patch16_224",
            r"student alone (timm:deit\_tiny\_patch16\_224) & 72.00 & 90.00 & 72.20 & -0.20",
        ),
    ]
    for teacher, student, row in tables:
        header = f"% {teacher} -> {student}:".replace("_", r"\_")
        start = next(i for i, line in enumerate(lines) if line.startswith(header))
        assert row + r" \\" in lines[start : lines.index(r"\end{tabular}", start)], r.stdout
