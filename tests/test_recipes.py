"""Recipes resolve into valid configs and losses; recipes list/show and report work from the CLI."""

from __future__ import annotations

import json

import pytest
from conftest import kd_main, run_kd, train_args

from kd import config as kd_config
from kd.commands import recipes
from kd.losses import build_loss
from kd.run.optim import lr_note

NAMES = recipes.names()


def test_expected_recipes_exist():
    for method in ("kd", "dkd", "dist", "lskd", "at", "crd", "ofd", "reviewkd"):
        assert f"imagenet/r34_r18_{method}" in NAMES
    for method in ("crd", "ofd", "reviewkd", "nkd"):
        assert f"imagenet/r50_mv1_{method}" in NAMES
    assert "imagenet/r34_r18_nkd" in NAMES
    assert "imagenet/r34_r18_mlkd" in NAMES
    for name in (
        "imagenet/r50_mv1_kd",
        "imagenet/r50_mv1_dkd",
        "imagenet/r101_r18_kd",
        "imagenet/baseline_r18",
        "imagenet/baseline_mv1",
    ):
        assert name in NAMES


# The published configurations, value by value, as read in each source (the recipe files name the
# commit): what a recipe must equal. A difference is allowed only where the recipe lists it under
# reference.differences (kd's choices: precision and compilation).
MDISTILLER = dict(  # megvii-research/mdistiller@a08d46f: configs/imagenet/*, engine/cfg.py, trainer.py
    batch_size=512, lr=0.2, epochs=100, lr_schedule="step", lr_milestones=[30, 60, 90], lr_gamma=0.1,
    momentum=0.9, nesterov=False, weight_decay=1e-4, wd_bn_bias=True, teacher_weights="torchvision:IMAGENET1K_V1",
    label_smoothing=None, image_size=224, min_crop_scale=0.08, dot=False,
)  # fmt: skip
PUBLISHED = {
    "imagenet/r34_r18_kd": dict(
        MDISTILLER, teacher="resnet34", student="resnet18", kd_loss="kd",
        loss={"ce_weight": 0.5, "kd_weight": 0.5, "temperature": 1.0}, top1=71.03,
    ),
    "imagenet/r34_r18_dkd": dict(
        MDISTILLER, teacher="resnet34", student="resnet18", kd_loss="dkd", top1=71.70,
        loss={"ce_weight": 1.0, "tckd_weight": 1.0, "nckd_weight": 0.5, "temperature": 1.0, "warmup": 1},
    ),
    "imagenet/r34_r18_at": dict(
        MDISTILLER, teacher="resnet34", student="resnet18", kd_loss="at", top1=70.69,
        loss={"ce_weight": 1.0, "at_weight": 1000.0, "p": 2.0}, feature_layers=["layer1", "layer2", "layer3", "layer4"],
    ),
    "imagenet/r34_r18_lskd": dict(  # sunshangquan/logit-standardization-KD@f6e5aa5 kd.yaml + its issue #9 command
        MDISTILLER, teacher="resnet34", student="resnet18", kd_loss="lskd", top1=71.42,
        loss={"ce_weight": 1.0, "kd_weight": 9.0, "temperature": 2.0},
    ),
    "imagenet/r34_r18_dist": dict(  # hunto/image_classification_sota@d9662f7 resnet_dist.yaml, args.py, optim.py
        teacher="resnet34", student="resnet18", kd_loss="dist", teacher_weights="torchvision:IMAGENET1K_V1",
        batch_size=256, lr=0.1, epochs=100, lr_schedule="step", lr_milestones=[30, 60, 90], lr_gamma=0.1,
        momentum=0.9, nesterov=True, weight_decay=1e-4, wd_bn_bias=False, label_smoothing=None, image_size=224,
        min_crop_scale=0.08, top1=72.07,
        loss={"ce_weight": 1.0, "kd_weight": 2.0, "inter_weight": 1.0, "intra_weight": 1.0, "temperature": 1.0},
    ),
    "imagenet/r50_mv1_kd": dict(
        MDISTILLER, teacher="resnet50", student="timm:mobilenetv1_100_relu", kd_loss="kd", top1=70.50,
        loss={"ce_weight": 0.5, "kd_weight": 0.5, "temperature": 1.0},
    ),
    "imagenet/r34_r18_kd_dot": dict(  # mdistiller r34_r18/dot.yaml: KD trained by DOT, DELTA 0.09 (cfg.py's 0.075)
        MDISTILLER, teacher="resnet34", student="resnet18", kd_loss="kd", dot=True, dot_delta=0.09,
        loss={"ce_weight": 0.5, "kd_weight": 0.5, "temperature": 1.0}, top1=71.72,
    ),
    "imagenet/r50_mv1_kd_dot": dict(  # mdistiller r50_mv1/dot.yaml
        MDISTILLER, teacher="resnet50", student="timm:mobilenetv1_100_relu", kd_loss="kd", dot=True, dot_delta=0.09,
        loss={"ce_weight": 0.5, "kd_weight": 0.5, "temperature": 1.0}, top1=73.09,
    ),
    "imagenet/r50_mv1_dkd": dict(
        MDISTILLER, teacher="resnet50", student="timm:mobilenetv1_100_relu", kd_loss="dkd", top1=72.05,
        loss={"ce_weight": 1.0, "tckd_weight": 1.0, "nckd_weight": 2.0, "temperature": 1.0, "warmup": 1},
    ),
    "imagenet/r34_r18_crd": dict(  # mdistiller r34_r18/crd.yaml: batch 256, lr 0.1; cfg.py's CRD block
        MDISTILLER, teacher="resnet34", student="resnet18", kd_loss="crd", batch_size=256, lr=0.1, top1=71.17,
        loss={"ce_weight": 1.0, "crd_weight": 0.8, "feat_dim": 128, "negatives": 16384, "temperature": 0.07,
              "momentum": 0.5},
    ),
    "imagenet/r50_mv1_crd": dict(
        MDISTILLER, teacher="resnet50", student="timm:mobilenetv1_100_relu", kd_loss="crd", batch_size=256, lr=0.1,
        top1=71.37, loss={"ce_weight": 1.0, "crd_weight": 0.8, "feat_dim": 128, "negatives": 16384,
                          "temperature": 0.07, "momentum": 0.5},
    ),
    "imagenet/r34_r18_reviewkd": dict(  # mdistiller r34_r18/reviewkd.yaml = dvlab-research/ReviewKD@cede6ea
        MDISTILLER, teacher="resnet34", student="resnet18", kd_loss="reviewkd", batch_size=256, lr=0.1, top1=71.61,
        loss={"ce_weight": 1.0, "reviewkd_weight": 1.0, "mid_channels": 512, "warmup": 1,
              "student_tap": "output", "teacher_tap": "output"},  # the in-place ReLU: post-ReLU stages
        feature_layers=["layer1", "layer2", "layer3", "layer4"],
    ),
    "imagenet/r50_mv1_reviewkd": dict(  # mdistiller r50_mv1/reviewkd.yaml; mid channels 256 as the official code
        MDISTILLER, teacher="resnet50", student="timm:mobilenetv1_100_relu", kd_loss="reviewkd", batch_size=256, lr=0.1,
        top1=72.56, loss={"ce_weight": 1.0, "reviewkd_weight": 8.0, "mid_channels": 256, "warmup": 1,
                    "student_tap": "pre_relu", "teacher_tap": "output"},  # MobileNet preReLU=True
    ),
    "imagenet/r50_mv1_ofd": dict(  # clovaai/overhaul-distillation@76344a8 ImageNet/train_with_distillation.py
        MDISTILLER, teacher="resnet50", student="timm:mobilenetv1_100_relu", kd_loss="ofd", batch_size=256, lr=0.1,
        nesterov=True, lr_milestones=[29, 59, 89], top1=71.25, loss={"ce_weight": 1.0, "ofd_weight": 1e-4},
    ),
    "imagenet/r34_r18_ofd": dict(  # the same official setting with this pair's models
        MDISTILLER, teacher="resnet34", student="resnet18", kd_loss="ofd", batch_size=256, lr=0.1,
        nesterov=True, lr_milestones=[29, 59, 89], top1=70.81, loss={"ce_weight": 1.0, "ofd_weight": 1e-4},
        feature_layers=["layer1", "layer2", "layer3", "layer4"],
    ),
    "imagenet/r34_r18_nkd": dict(  # yzd-v/cls_KD@1e5d48f res34_distill_res18_img.py and its mmcls bases
        MDISTILLER, teacher="resnet34", student="resnet18", kd_loss="nkd", batch_size=256, lr=0.1, top1=71.96,
        loss={"ce_weight": 1.0, "non_target_weight": 1.5, "temperature": 1.0},
    ),
    "imagenet/r50_mv1_nkd": dict(  # yzd-v/cls_KD@1e5d48f res50_distill_mv1_img.py: clip at norm 5
        MDISTILLER, teacher="resnet50", student="timm:mobilenetv1_100_relu", kd_loss="nkd", batch_size=256, lr=0.1,
        grad_clip=5.0, top1=72.58, loss={"ce_weight": 1.0, "non_target_weight": 1.5, "temperature": 1.0},
    ),
    "imagenet/r34_r18_ctkd": dict(  # zhengli97/CTKD@7d52522 scripts/run_imagenet_distill.sh
        MDISTILLER, teacher="resnet34", student="resnet18", kd_loss="ctkd", batch_size=256, lr=0.1, epochs=120,
        top1=71.32, loss={"ce_weight": 1.0, "kd_weight": 1.0, "min_temperature": 1.0, "max_temperature": 21.0,
                          "reversal_weight": 1.0, "reversal_epochs": 5},
    ),
    "imagenet/r34_r18_ctdkd": dict(  # the same script's commented DKD line (-a 0 -b 1 --dkd_alpha 1 --dkd_beta 1)
        MDISTILLER, teacher="resnet34", student="resnet18", kd_loss="ctdkd", batch_size=256, lr=0.1, epochs=120,
        top1=71.51, loss={"ce_weight": 1.0, "tckd_weight": 1.0, "nckd_weight": 1.0, "min_temperature": 1.0,
                          "max_temperature": 21.0, "reversal_weight": 1.0, "reversal_epochs": 5},
    ),
    "imagenet/r34_r18_mlkd": dict(  # Jin-Ying/Multi-Level-Logit-Distillation@5ee473f r34_r18/kd_ours.yaml: lr 0.1
        MDISTILLER, teacher="resnet34", student="resnet18", kd_loss="mlkd", lr=0.1, top1=71.90,
        loss={"ce_weight": 0.5, "kd_weight": 0.5, "temperature": 1.0},
    ),
    "imagenet/r34_r18_luminet": dict(  # ismail31416/LumiNet@8cf749b r34_r18/luminet.yaml: ALPHA 2 squared
        MDISTILLER, teacher="resnet34", student="resnet18", kd_loss="luminet", top1=72.16,
        loss={"ce_weight": 1.0, "kd_weight": 4.0, "temperature": 0.7, "warmup": 1},
    ),
    "imagenet/r50_mv1_luminet": dict(  # ismail31416/LumiNet@8cf749b r50_mv1/luminet.yaml: batch 256, lr 0.1
        MDISTILLER, teacher="resnet50", student="timm:mobilenetv1_100_relu", kd_loss="luminet", batch_size=256, lr=0.1,
        top1=72.55, loss={"ce_weight": 1.0, "kd_weight": 4.0, "temperature": 0.7, "warmup": 1},
    ),
    "imagenet/r34_r18_crld": dict(  # arcanienz/CRLD r34_r18/crld.yaml (scx-822/CRLD-main@c9d6657) + cfg.py's CRLD block
        MDISTILLER, teacher="resnet34", student="resnet18", kd_loss="crld", top1=None,
        loss={"ce_weight": 2.0, "within_weight": 2.0, "cross_weight": 0.5, "temperature": 1.0, "weak_threshold": 0.9,
              "strong_threshold": 0.2},
    ),
    "imagenet/r50_mv1_crld": dict(  # the same repository's r50_mv1/crld.yaml: the same values
        MDISTILLER, teacher="resnet50", student="timm:mobilenetv1_100_relu", kd_loss="crld", top1=None,
        loss={"ce_weight": 2.0, "within_weight": 2.0, "cross_weight": 0.5, "temperature": 1.0, "weak_threshold": 0.9,
              "strong_threshold": 0.2},
    ),
    # the logit-standardisation rows (sunshangquan/logit-standardization-KD@f6e5aa5, Table 3): each method's config
    # there with what tools/train.py's --logit-stand --base-temp 2 --kd-weight 9 makes of it (r50_mv2 names mdistiller's
    # MobileNet-V1 MobileNetV2); CTKD's from its CTKD/scripts/run_imagenet_distill.sh (-a 2, standardised KD)
    "imagenet/r34_r18_dkd_ls": dict(
        MDISTILLER, teacher="resnet34", student="resnet18", kd_loss="dkd", top1=71.88,
        loss={"ce_weight": 1.0, "tckd_weight": 9.0, "nckd_weight": 4.5, "temperature": 2.0, "warmup": 1,
              "standardise": 1},
    ),
    "imagenet/r34_r18_mlkd_ls": dict(  # MLKD's config: lr 0.1, CE 0.5
        MDISTILLER, teacher="resnet34", student="resnet18", kd_loss="mlkd", lr=0.1, top1=72.08,
        loss={"ce_weight": 0.5, "kd_weight": 9.0, "temperature": 2.0, "standardise": 1},
    ),
    "imagenet/r34_r18_ctkd_ls": dict(
        MDISTILLER, teacher="resnet34", student="resnet18", kd_loss="ctkd", batch_size=256, lr=0.1, epochs=120,
        top1=71.81, loss={"ce_weight": 1.0, "kd_weight": 2.0, "min_temperature": 1.0, "max_temperature": 21.0,
                          "reversal_weight": 1.0, "reversal_epochs": 5, "standardise": 1},
    ),
    "imagenet/r50_mv1_lskd": dict(  # r50_mv2/kd.yaml: CE 0.5
        MDISTILLER, teacher="resnet50", student="timm:mobilenetv1_100_relu", kd_loss="lskd", top1=72.18,
        loss={"ce_weight": 0.5, "kd_weight": 9.0, "temperature": 2.0},
    ),
    "imagenet/r50_mv1_dkd_ls": dict(  # r50_mv2/dkd.yaml: BETA 2
        MDISTILLER, teacher="resnet50", student="timm:mobilenetv1_100_relu", kd_loss="dkd", top1=72.85,
        loss={"ce_weight": 1.0, "tckd_weight": 9.0, "nckd_weight": 18.0, "temperature": 2.0, "warmup": 1,
              "standardise": 1},
    ),
    "imagenet/r50_mv1_mlkd_ls": dict(  # r50_mv2/mlkd.yaml: lr 0.2, CE 0.5
        MDISTILLER, teacher="resnet50", student="timm:mobilenetv1_100_relu", kd_loss="mlkd", top1=73.22,
        loss={"ce_weight": 0.5, "kd_weight": 9.0, "temperature": 2.0, "standardise": 1},
    ),
    # shicaiwei123/SDD-CVPR2024@e412036 configs/imagenet/*/sdd_*.yaml, train.py (2 processes of BATCH_SIZE, M),
    # cfg.py (SD-KD's KD defaults), trainer.py (clip at norm 40), SyncBatchNorm; its MobileNetV2_SDD is a V1
    "imagenet/r50_mv1_sdkd": dict(
        MDISTILLER, teacher="resnet50", student="timm:mobilenetv1_100_relu", kd_loss="sdkd", grad_clip=40.0,
        sync_bn=True, top1=72.24, loss={"ce_weight": 0.1, "kd_weight": 0.9, "temperature": 4.0, "scales": [1, 2, 4],
                                         "grid": 4, "complementary_weight": 2.0},
    ),
    "imagenet/r50_mv1_sddkd": dict(
        MDISTILLER, teacher="resnet50", student="timm:mobilenetv1_100_relu", kd_loss="sddkd", grad_clip=40.0,
        sync_bn=True, top1=73.08, loss={"ce_weight": 1.0, "tckd_weight": 1.0, "nckd_weight": 2.0, "temperature": 1.0,
                                         "warmup": 1, "scales": [1, 2, 4], "grid": 4, "complementary_weight": 2.0},
    ),
    "imagenet/r50_mv1_sdnkd": dict(
        MDISTILLER, teacher="resnet50", student="timm:mobilenetv1_100_relu", kd_loss="sdnkd", grad_clip=40.0,
        sync_bn=True, top1=73.12, loss={"ce_weight": 1.0, "non_target_weight": 2.0, "temperature": 1.0,
                                         "drop_target": 0, "scales": [1, 2, 4], "grid": 4, "complementary_weight": 2.0},
    ),
    "imagenet/r34_r18_sddkd": dict(  # BATCH_SIZE 4 in its config: 256 as its sibling configs (the recipe says so)
        MDISTILLER, teacher="resnet34", student="resnet18", kd_loss="sddkd", grad_clip=40.0, sync_bn=True,
        top1=72.02, loss={"ce_weight": 1.0, "tckd_weight": 1.0, "nckd_weight": 0.5, "temperature": 1.0, "warmup": 1,
                          "scales": [1, 2], "grid": 4, "complementary_weight": 2.0},
    ),
    "imagenet/baseline_r18": dict(  # pytorch/vision references/classification/train.py@017e9b9 defaults
        student="resnet18", no_teacher=True, batch_size=256, lr=0.1, epochs=90, lr_schedule="step",
        lr_milestones=[30, 60], lr_gamma=0.1, momentum=0.9, nesterov=False, weight_decay=1e-4, wd_bn_bias=True,
        label_smoothing=None, image_size=224, min_crop_scale=0.08, top1=69.76,
    ),
    "imagenet/baseline_mv1": dict(  # no published config: the pair's KD solver (mdistiller r50_mv1/kd.yaml), no teacher
        student="timm:mobilenetv1_100_relu", no_teacher=True, batch_size=512, lr=0.2, epochs=100, lr_schedule="step",
        lr_milestones=[30, 60, 90], lr_gamma=0.1, momentum=0.9, nesterov=False, weight_decay=1e-4, wd_bn_bias=True,
        label_smoothing=None, image_size=224, min_crop_scale=0.08, top1=68.87,
    ),
    "imagenet/r101_r18_kd": dict(  # kd's own pair in mdistiller's KD setting: no published number
        MDISTILLER, teacher="resnet101", student="resnet18", kd_loss="kd", top1=None,
        loss={"ce_weight": 0.5, "kd_weight": 0.5, "temperature": 1.0},
    ),
}  # fmt: skip

# ViT students and timm's training recipes. DeiT: facebookresearch/deit@7e160fe main.py (its line numbers) and
# README_deit.md (the DeiT-S / DeiT-Ti command, lines 216 and 221: 4 processes x --batch-size 256; the hard
# distillation command, line 241: --distillation-type hard --teacher-model regnety_160, regnety_160-a5fe301d.pth).
DEIT = dict(
    batch_size=4 * 256, lr=5e-4 * 4 * 256 / 512,  # main.py:71 --lr 5e-4, scaled by main.py:350 (batch x world / 512)
    epochs=300, optimizer="adamw", opt_eps=1e-8, opt_betas=None,  # main.py:35, 56, 58, 60
    weight_decay=0.05, wd_bn_bias=False, grad_clip=None,  # main.py:66 (no decay: 1-d, no_weight_decay()), 62
    lr_schedule="timm-cosine", warmup_epochs=5, warmup_lr=1e-6, min_lr=1e-5,  # main.py:69, 86, 79, 81
    drop_path=0.1, model_ema=True, model_ema_decay=0.99996, model_ema_warmup=False,  # main.py:46, 49-52 (timm ModelEma)
    aa="rand-m9-mstd0.5-inc1", color_jitter=0.3, smoothing=0.1,  # main.py:98, 96, 101
    train_interpolation="bicubic",  # main.py:102
    reprob=0.25, remode="pixel", recount=1,  # main.py:118, 120, 122
    mixup=0.8, cutmix=1.0, mixup_prob=1.0, mixup_switch_prob=0.5,  # main.py:128, 130, 134, 136
    repeated_aug=3,  # main.py:105-107 --repeated-aug on by default, samplers.py:15 RASampler num_repeats=3
    image_size=224, min_crop_scale=0.08, label_smoothing=None,  # main.py:42; timm's create_transform scale (0.08, 1)
    val_resize=int(224 / 0.875), val_interpolation="bicubic",  # main.py:174 --eval-crop-ratio, datasets.py:101-103
    opt="O1",  # engine.py:46: torch.cuda.amp.autocast
    teacher="timm:regnety_160.deit_in1k", teacher_weights="pretrained", kd_loss="deit",
    loss={"ce_weight": 1 - 0.5, "kd_weight": 0.5, "temperature": 1.0, "hard": 1},  # main.py:145-147, losses.py
)  # fmt: skip
# yzd-v/cls_KD@1e5d48f, the setting of the TTM README's DeiT III-Small -> DeiT-Tiny row: configs/distillers/imagenet/
# deit-s3_distill_deit-t_img.py (its KD block: temp 1.0, alpha 0.5), configs/deit/deit-tiny_pt-4xb256_in1k.py and
# its bases deit-small_pt-4xb256_in1k.py ("deit-small"), _base_/schedules/imagenet_bs1024_adamw_swin.py ("schedule"),
# _base_/datasets/imagenet_bs64_swin_224.py ("datasets")
CLS_KD_DEIT = dict(
    batch_size=4 * 256, lr=5e-4 * 1024 / 512, epochs=300,  # deit-small:36 and the config's 4 GPUs; schedule:6, 35
    optimizer="adamw", opt_eps=1e-8, opt_betas=[0.9, 0.999], weight_decay=0.05, wd_bn_bias=False,  # schedule:5-17
    grad_clip=5.0,  # deit-small:47
    lr_schedule="cosine", warmup_epochs=20, min_lr=1e-5,  # schedule:21-31
    drop_path=0.0, model_ema=False,  # deit-small:1-2
    aa="rand-m9-mstd0.5-inc1", color_jitter=None, train_interpolation="bicubic",  # datasets:17-31
    reprob=0.25, remode="pixel", recount=1,  # datasets:32-39
    # no mixing: the distiller config's model dict (_delete_ = True) drops deit-small:29-32's train_cfg augments,
    # and ClassificationDistiller mixes only by its own train_cfg (distiller.py:40-42), which it is not given
    mixup=0.0, cutmix=0.0, smoothing=0.0,
    label_smoothing=0.1,  # deit-small:22-23 (LabelSmoothLoss 0.1, mode original, on the hard labels)
    image_size=224, min_crop_scale=0.08, val_resize=256, val_interpolation="bicubic",  # datasets:17-21, 43-51
    teacher="timm:deit3_small_patch16_224.fb_in22k_ft_in1k", teacher_weights="pretrained",  # distiller config:24
    student="timm:deit_tiny_patch16_224", kd_loss="kd",
    loss={"ce_weight": 1 - 0.5, "kd_weight": 0.5, "temperature": 1.0, "label_smoothing": 0.1},  # config:64-70
)  # fmt: skip
PUBLISHED.update(
    {
        "imagenet/deit_ti_distilled": dict(DEIT, student="timm:deit_tiny_distilled_patch16_224", top1=74.5),
        "imagenet/deit_s_distilled": dict(DEIT, student="timm:deit_small_distilled_patch16_224", top1=81.2),
        "imagenet/deit3s_deitti_kd": dict(CLS_KD_DEIT, top1=76.01),
        # the same file with its NKD block on (NKDLoss temp 1.0, gamma 1.0: distiller config:57-62) and the student's
        # label loss at full weight (distiller.py:121; only KDLoss scales it); published in cls_KD's nkd.md
        "imagenet/deit3s_deitti_nkd": dict(
            CLS_KD_DEIT,
            kd_loss="nkd",
            loss={"ce_weight": 1.0, "non_target_weight": 1.0, "temperature": 1.0, "label_smoothing": 0.1},
            top1=76.68,
        ),
        # README_deit.md:216, 221 without the distillation flags (main.py:145: --distillation-type none)
        **{
            f"imagenet/baseline_deit_{size}": dict(
                {k: v for k, v in DEIT.items() if k not in ("teacher", "teacher_weights", "kd_loss", "loss")},
                no_teacher=True,
                student=f"timm:deit_{model}_patch16_224",
                top1=top1,
            )
            for size, model, top1 in (("ti", "tiny", 72.2), ("s", "small", 79.8))
        },
    }
)
# Hao840/vanillaKD@a27b029 readme.md, "Training, Strategy A2" (8 processes x --batch-size 256), with train-kd.py's
# defaults (its line numbers) for what the command leaves out; timm 0.6.5's train.py beneath it
PUBLISHED["imagenet/vanillakd_r50_a2_kd"] = dict(
    teacher="timm:beitv2_base_patch16_224.in1k_ft_in22k_in1k", teacher_weights="pretrained",  # kd's choice (recipe)
    student="timm:resnet50", student_weights="none", kd_loss="kd",
    loss={"ce_weight": 1.0, "kd_weight": 1.0, "temperature": 1.0},  # train-kd.py:90, 113-114; losses/kd.py
    bce_loss=True, bce_target_thresh=None,  # --bce-loss 1; train-kd.py:247, 747-748
    batch_size=8 * 256, lr=5e-3, epochs=300, optimizer="lamb", opt_eps=None, opt_betas=None,  # :177, 179
    weight_decay=0.02, wd_bn_bias=False, grad_clip=None,  # timm's filter_bias_and_bn; --clip-grad None (:117)
    lr_schedule="timm-cosine", warmup_epochs=5, warmup_lr=1e-6, min_lr=1e-6,  # :207
    drop_path=0.05, model_ema=False, aa="rand-m7-mstd0.5", color_jitter=0.0, reprob=0.0,  # :249
    mixup=0.1, cutmix=1.0, mixup_prob=1.0, mixup_switch_prob=0.5, smoothing=0.0,  # :263, 265
    label_smoothing=None, repeated_aug=3, image_size=224, min_crop_scale=0.08,
    val_resize=235, val_interpolation="bicubic",  # --crop-pct 0.95: floor(224 / 0.95); resnet50's bicubic
    opt="O1", top1=None,  # --amp; the README publishes no top-1 of this setting
)  # fmt: skip
# Strategy A1, the same README's other command: 600 epochs, wd 0.01, smoothing 0.1, mixup 0.2
PUBLISHED["imagenet/vanillakd_r50_a1_kd"] = dict(
    PUBLISHED["imagenet/vanillakd_r50_a2_kd"], epochs=600, weight_decay=0.01, smoothing=0.1, mixup=0.2
)
#: what a recipe may list under reference.differences: kd's choices, a model of the same layers built by another
#: library, a setting kd cannot express yet (named), or what the source suggests
ALLOWED_DIFFERENCES = ("kd's choice", "for mdistiller's own", "for mmcls's own", "suggests", "each process's batch")
ALLOWED_DIFFERENCES += ("kd has no",)


def test_every_recipe_is_held_against_its_source():
    assert sorted(PUBLISHED) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_recipe_equals_its_published_configuration(name):
    cfg = kd_config.resolve(recipe=name)
    published = dict(PUBLISHED[name])
    loss, top1 = published.pop("loss", None), published.pop("top1")
    for key, value in published.items():
        assert getattr(cfg, key) == value, (name, key, getattr(cfg, key), value)
    if loss is not None:
        assert cfg.loss_kwargs() == loss
        build_loss(cfg.kd_loss, 1000, cfg.loss_kwargs())
    assert cfg.reference["top1"] == top1
    assert "@" in cfg.reference["config"] and cfg.reference["source"]  # the file and commit it follows
    for difference in cfg.reference["differences"]:
        assert any(allowed in difference for allowed in ALLOWED_DIFFERENCES), difference


def test_short_schedule_scales_milestones():
    cfg = kd_config.resolve(recipe="imagenet/r34_r18_dkd", sets=["epochs=20"])
    assert cfg.epochs == 20 and cfg.lr_milestones == [6, 12, 18]
    assert cfg.schedule_note == (
        "the lr schedule is scaled from 100 to 20 epochs: milestones 30/60/90 -> 6/12/18 "
        "(--lr-milestones and --warmup-epochs set them)"
    )
    given = kd_config.resolve(recipe="imagenet/r34_r18_dkd", options={"epochs": 20, "lr_milestones": [10]})
    assert given.lr_milestones == [10] and given.schedule_note is None  # the user's own: nothing to say
    assert kd_config.resolve(recipe="imagenet/r34_r18_dkd").schedule_note is None


def test_another_image_size_scales_the_recipes_val_resize():
    """A recipe's val resize (DeiT's 256 for 224) keeps its ratio at the user's --image-size, floored, as the
    default does (timm's floor(size / crop_pct) for DeiT's exact 0.875); a --val-resize given stays."""
    cfg = kd_config.resolve(recipe="imagenet/deit3s_deitti_nkd", options={"image_size": 64})
    assert cfg.val_resize == 73  # floor(64 / 0.875)
    assert kd_config.resolve(recipe="imagenet/deit3s_deitti_nkd", sets=["image_size=448"]).val_resize == 512
    given = kd_config.resolve(recipe="imagenet/deit3s_deitti_nkd", options={"image_size": 64, "val_resize": 64})
    assert given.val_resize == 64
    assert kd_config.resolve(recipe="imagenet/deit3s_deitti_nkd").val_resize == 256
    assert kd_config.resolve(recipe="imagenet/r34_r18_dkd", options={"image_size": 64}).val_resize is None


def test_a_scaled_schedule_is_said_at_the_start(image_folder, tmp_path):
    """--epochs that rescales the planned milestones and warm-up says so in the run's log and config.yaml."""
    recipe = tmp_path / "plan.yaml"
    recipe.write_text("epochs: 4\nlr_milestones: [2, 3]\nwarmup_epochs: 2\n")
    tiny = dict(no_teacher=True, student="timm:resnet10t", limit_train_batches=1, limit_val_batches=1)
    r = kd_main(*train_args(image_folder, tmp_path / "run", "--recipe", recipe, no_progress=True, **tiny))
    assert r.returncode == 0, r.stderr
    line = (
        "the lr schedule is scaled from 4 to 1 epochs: milestones 2/3 -> 1; warm-up 2 -> 0.5 epochs "
        "(--lr-milestones and --warmup-epochs set them)"
    )
    assert r.stderr.count(line) == 1, r.stderr
    assert f"# {line}\n" in (tmp_path / "run" / "config.yaml").read_text()


def fake_run(out, recipe, options, train_images):
    """A run folder as kd writes it for ``recipe`` with ``options``: its config.yaml, and three
    evaluated epochs of ``train_images`` images each (1.5 h in all)."""
    out.mkdir(parents=True)
    cfg = kd_config.resolve(recipe=recipe, options=options)
    kd_config.save(cfg, out / "config.yaml")
    rows = [
        {"epoch": e, "train_images": train_images, "val_top1": v, "val_top5": v + 20, "seconds": 1800}
        for e, v in ((1, 60.0), (2, 70.5), (3, 70.1))
    ]
    (out / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    return out


def test_a_paper_reference_is_shown_for_the_recipes_setting_only(tmp_path):
    """The recipe's top-1 is the paper's for its models, method, hyper-parameters and epochs on
    ImageNet: another student, more epochs, or a small folder get none, and a note says why."""
    same = fake_run(tmp_path / "same", "imagenet/r34_r18_kd", {}, train_images=1_281_024)
    student = fake_run(tmp_path / "student", "imagenet/r34_r18_kd", {"student": "resnet34"}, 1_281_024)
    small = fake_run(tmp_path / "small", "imagenet/r34_r18_kd", {}, train_images=12_000)
    r = kd_main("report", same, student, small)
    assert r.returncode == 0, r.stderr
    rows = {line.split("|")[1].strip(): line.split("|") for line in r.stdout.splitlines() if "|" in line}
    assert rows[str(same)][11].strip() == "71.03" and rows[str(same)][12].strip() == "-0.53"
    assert rows[str(student)][11].strip() == "-" and rows[str(small)][11].strip() == "-"
    assert (
        f"kd report: {student}: no paper reference shown, not the setting of recipe imagenet/r34_r18_kd: " in r.stderr
    )
    assert "student 'resnet34' (recipe: 'resnet18')" in r.stderr
    assert f"{small}: no paper reference shown, trained on 12,000 images an epoch, not ImageNet-1k's 1,281,167" in (
        r.stderr
    )


def test_recipes_cli_and_report(tmp_path):
    r = kd_main("recipes", "list")
    assert r.returncode == 0 and "imagenet/r34_r18_dkd" in r.stdout and "71.7" in r.stdout
    r = kd_main("recipes", "show", "imagenet/r34_r18_dist")
    assert r.returncode == 0 and "kd_loss: dist" in r.stdout
    run = fake_run(tmp_path / "run", "imagenet/r34_r18_dkd", {}, train_images=1_281_024)
    r = kd_main("report", run, "--csv", tmp_path / "t.csv")
    assert r.returncode == 0, r.stderr
    # wall_time "-": a run without wall.jsonl (this one is made by hand); train_time its epochs' seconds
    row = (
        "| dkd | resnet34 | resnet18 | 3/100 | 70.5 | 90.5 | 70.1 | 90.1 | - | 71.7 | -1.2 | as imagenet/r34_r18_dkd |"
    )
    assert row + " - | 1.5h |" in r.stdout
    assert (tmp_path / "t.csv").read_text().startswith("run,method")
    r = kd_main("report", tmp_path / "nothing")
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_recipes_list_prints_dash_and_the_papers_decimals():
    from kd.commands.recipes import table

    rows = {line.split(" | ")[0][2:]: line for line in table().splitlines()[2:]}
    assert rows["imagenet/r101_r18_kd"].endswith("| - |"), rows["imagenet/r101_r18_kd"]
    assert rows["imagenet/r34_r18_dkd"].endswith("| 71.70 |")
    assert rows["imagenet/r50_mv1_kd"].endswith("| 70.50 |")
    assert "None" not in table()


# ---------------------------------------------------------------- KD hyper-parameter names

# What each recipe said before the names were made consistent (issue 16): the loss keys only.
FORMER = {
    "imagenet/r101_r18_kd": {"alpha": 0.5, "temperature": 1.0},
    "imagenet/r34_r18_kd": {"alpha": 0.5, "temperature": 1.0},
    "imagenet/r50_mv1_kd": {"alpha": 0.5, "temperature": 1.0},
    "imagenet/r34_r18_at": {"loss_args": {"ce_weight": 1.0, "beta": 1000.0, "p": 2.0}},
    "imagenet/r34_r18_dist": {"loss_args": {"ce_weight": 1.0, "kd_weight": 2.0, "beta": 1.0, "gamma": 1.0, "tau": 1.0}},
    "imagenet/r34_r18_dkd": {
        "loss_args": {"ce_weight": 1.0, "alpha": 1.0, "beta": 0.5, "temperature": 1.0, "warmup": 1}
    },
    "imagenet/r50_mv1_dkd": {
        "loss_args": {"ce_weight": 1.0, "alpha": 1.0, "beta": 2.0, "temperature": 1.0, "warmup": 1}
    },
    "imagenet/r34_r18_lskd": {"loss_args": {"ce_weight": 1.0, "kd_weight": 9.0, "temperature": 2.0}},
}


def loss_outputs(cfg):
    """The recipe's loss on fixed tensors (features where the method needs them)."""
    import torch

    from kd.losses import DistillInputs

    loss = build_loss(cfg.kd_loss, 10, cfg.loss_kwargs())
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(6, 10, generator=g) * 3, torch.randn(6, 10, generator=g) * 3
    y = torch.randint(0, 10, (6,), generator=g)
    feats = {}, {}
    if loss.card.uses_features:
        feats = {"a": torch.randn(6, 4, 8, 8, generator=g)}, {"a": torch.randn(6, 8, 4, 4, generator=g)}
        loss.setup_features({"a": feats[0]["a"].shape}, {"a": feats[1]["a"].shape})
        torch.manual_seed(1)
        for p in loss.parameters():
            p.data.normal_()
    return loss(DistillInputs(s, y, t, feats[0], feats[1], progress=0.5))


#: the methods whose recipes came before the renaming (a method added since never had other names)
NAMED_BEFORE = {"kd", "dkd", "dist", "lskd", "at", "fitnet"}
#: recipes of earlier methods added after the renaming (DOT's)
RECIPES_SINCE = {
    "imagenet/r34_r18_kd_dot", "imagenet/r50_mv1_kd_dot", "imagenet/r34_r18_dkd_ls", "imagenet/r50_mv1_lskd",
    "imagenet/r50_mv1_dkd_ls", "imagenet/deit3s_deitti_kd", "imagenet/vanillakd_r50_a2_kd",
    "imagenet/vanillakd_r50_a1_kd",
}  # fmt: skip


def test_every_kd_recipe_has_its_former_settings_listed():
    cfgs = {n: kd_config.resolve(recipe=n) for n in NAMES}
    since = {n for n, c in cfgs.items() if c.no_teacher or c.kd_loss not in NAMED_BEFORE} | RECIPES_SINCE
    assert sorted(FORMER) == sorted(set(cfgs) - since)


@pytest.mark.parametrize("name", sorted(FORMER))
def test_recipe_loss_equals_its_former_names(name, tmp_path, caplog):
    import yaml

    new = kd_config.resolve(recipe=name)
    data = kd_config.load_yaml(kd_config.find_recipe(name))
    for key in ("loss_args", "ce_weight", "temperature", "alpha"):
        data.pop(key, None)
    data.update(FORMER[name])
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(data))
    with caplog.at_level("WARNING"):
        old = kd_config.resolve(recipe=str(tmp_path / "old.yaml"))
    assert old.loss_kwargs() == new.loss_kwargs()
    a, b = loss_outputs(new), loss_outputs(old)
    assert set(a) == set(b) and all(a[k].item() == b[k].item() for k in a)
    renamed = sum(
        1 for k in {**FORMER[name], **FORMER[name].get("loss_args", {})} if k in ("alpha", "beta", "gamma", "tau")
    )
    assert len([r for r in caplog.records if "deprecated" in r.getMessage()]) == renamed


def test_shipped_recipes_use_current_names_only(caplog):
    with caplog.at_level("WARNING"):
        for name in NAMES:
            kd_config.resolve(recipe=name)
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()]


def test_options_and_loss_args_later_source_wins():
    cfg = kd_config.resolve(recipe="imagenet/r34_r18_dkd", options={"temperature": 4.0})
    assert cfg.loss_kwargs()["temperature"] == 4.0  # the command line over the recipe's loss_args
    cfg = kd_config.resolve(recipe="imagenet/r34_r18_dist", options={"temperature": 4.0, "ce_weight": 0.5})
    assert cfg.loss_kwargs() == {
        "ce_weight": 0.5,
        "kd_weight": 2.0,
        "inter_weight": 1.0,
        "intra_weight": 1.0,
        "temperature": 4.0,
    }
    cfg = kd_config.resolve(
        recipe="imagenet/r34_r18_kd", options={"temperature": 4.0}, sets=["loss_args.temperature=3"]
    )
    assert cfg.loss_kwargs()["temperature"] == 3 and cfg.temperature is None
    with pytest.raises(kd_config.KDError, match="temperature twice"):
        kd_config.resolve(recipe="imagenet/r34_r18_kd", options={"temperature": 4.0, "loss_args": {"temperature": 2}})


def test_former_names_on_the_command_line_over_a_recipe(caplog):
    with caplog.at_level("WARNING"):
        cfg = kd_config.resolve(recipe="imagenet/r34_r18_dkd", options={"loss_args": {"beta": 8.0}})
    assert cfg.loss_kwargs()["nckd_weight"] == 8.0 and "beta" not in cfg.loss_kwargs()
    assert len(caplog.records) == 1 and "'beta' is deprecated, use nckd_weight" in caplog.records[0].getMessage()
    # a former name in the recipe, the current one on the command line: the later one wins
    cfg = kd_config.resolve(
        options={
            "kd_loss": "dkd",
            "loss_args": {"beta": 8.0},
            "teacher": "resnet34",
            "student": "resnet18",
            "data": "synthetic",
        },
        sets=["loss_args.nckd_weight=2"],
    )
    assert cfg.loss_kwargs()["nckd_weight"] == 2


def test_former_alpha_is_kd_only():
    base = dict(teacher="resnet34", student="resnet18", data="synthetic")
    cfg = kd_config.resolve(options={**base, "alpha": 0.3})
    assert cfg.loss_kwargs() == {"ce_weight": 0.3, "kd_weight": 0.7}
    for method, hint in (("dkd", "tckd_weight"), ("dist", "--ce-weight")):
        with pytest.raises(kd_config.KDError, match=hint):
            kd_config.resolve(options={**base, "kd_loss": method, "alpha": 0.3})
    with pytest.raises(kd_config.KDError, match="not both"):
        kd_config.resolve(options={**base, "alpha": 0.3, "ce_weight": 0.5})
    saved = kd_config.RunConfig(**base).to_dict()  # a config.yaml of an older run has alpha: null
    assert kd_config.apply(kd_config.RunConfig(), {**saved, "kd_loss": "dkd", "alpha": None}, "x").kd_loss == "dkd"


def test_config_yaml_of_an_older_run_loads(tmp_path):
    import yaml

    saved = {
        k: v
        for k, v in kd_config.RunConfig(teacher="resnet34", student="resnet18").to_dict().items()
        if k not in ("ce_weight", "label_smoothing")
    }
    (tmp_path / "kd.yaml").write_text(yaml.safe_dump({**saved, "alpha": 0.5, "temperature": 1.0}))
    assert kd_config.load(tmp_path / "kd.yaml").loss_kwargs() == {
        "ce_weight": 0.5,
        "kd_weight": 0.5,
        "temperature": 1.0,
    }
    loss_args = {"ce_weight": 1.0, "alpha": 1.0, "beta": 0.5, "temperature": 1.0, "warmup": 1}
    (tmp_path / "dkd.yaml").write_text(
        yaml.safe_dump({**saved, "kd_loss": "dkd", "alpha": None, "temperature": None, "loss_args": loss_args})
    )
    assert (
        kd_config.load(tmp_path / "dkd.yaml").loss_kwargs()
        == kd_config.resolve(recipe="imagenet/r34_r18_dkd").loss_kwargs()
    )
    assert kd_config.coerce("alpha", "0.3") == 0.3  # kd bench checks its --set items with coerce


def test_temperature_is_refused_where_there_is_none():
    base = dict(teacher="resnet34", student="resnet18", data="synthetic", temperature=2.0)
    for method in ("kd", "dkd", "dist", "lskd", "fitnet"):
        assert kd_config.resolve(options={**base, "kd_loss": method}).loss_kwargs()["temperature"] == 2.0
    with pytest.raises(kd_config.KDError, match="KD loss 'at' has no temperature"):
        kd_config.resolve(options={**base, "kd_loss": "at"})


def test_logit_standardisation_is_one_switch_on_the_methods_that_have_it():
    """--logit-standardisation reaches each student's method as its standardise switch, a recipe's
    loss_args stay as they were; --no-logit-standardisation turns off a recipe's."""
    base = dict(teacher="resnet34", student="resnet18", data="synthetic", standardise=True)
    for method in ("kd", "dkd", "ctkd", "ctdkd"):
        args = kd_config.resolve(options={**base, "kd_loss": method}).loss_kwargs()
        assert args["standardise"] is True and build_loss(method, 10, args).standardise
    cfg = kd_config.resolve(recipe="imagenet/r34_r18_dkd", options={"standardise": True})
    assert cfg.loss_kwargs() == {**kd_config.resolve(recipe="imagenet/r34_r18_dkd").loss_kwargs(), "standardise": True}
    off = kd_config.resolve(options={**base, "kd_loss": "kd", "standardise": False}).loss_kwargs()
    assert not build_loss("kd", 10, off).standardise


def test_no_teacher_keeps_only_the_label_smoothing():
    cfg = kd_config.resolve(recipe="imagenet/r34_r18_kd", options={"no_teacher": True, "label_smoothing": 0.1})
    assert cfg.loss_kwargs() == {"label_smoothing": 0.1}


def test_cli_former_and_current_name_together_is_one_line_exit_2():
    r = kd_main("train", "--recipe", "imagenet/r34_r18_dkd", "--loss-arg", "beta=1", "--loss-arg", "nckd_weight=1")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("kd: error: ") and "'beta' is the former name of nckd_weight" in lines[0]
    assert "not both" in lines[0]


def test_cli_former_name_gives_one_deprecation_line():
    # --student missing on purpose: the run stops at validation, after the names were read
    r = run_kd(
        "train",
        "--kd-loss",
        "dist",
        "--teacher",
        "resnet34",
        "--data",
        "synthetic",
        "-T",
        "2",
        "--loss-arg",
        "gamma=2",
        "--set",
        "loss_args.beta=3",
    )
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, r.stderr
    assert lines[-1] == "kd: error: --student is required (a torchvision model name or timm:NAME)"
    warnings = lines[:-1]
    assert len(warnings) == 2, r.stderr  # one per former name
    assert (
        "'gamma' is deprecated, use intra_weight" in warnings[0]
        and "'beta' is deprecated, use inter_weight" in warnings[1]
    )
    r = run_kd("train", "--kd-loss", "kd", "--teacher", "resnet34", "--data", "synthetic", "--alpha", "0.3")
    assert [line for line in r.stderr.splitlines() if "deprecated" in line] == [
        "kd: warning: KD loss 'kd': 'alpha' is deprecated, use ce_weight and kd_weight (alpha=0.3 -> ce_weight=0.3, kd_weight=0.7)"
    ]
    r = run_kd(
        "train", "--kd-loss", "at", "--teacher", "resnet34", "--student", "resnet18", "--data", "synthetic", "-T", "2"
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "kd: error: --temperature: KD loss 'at' has no temperature; its hyper-parameters: ce_weight, label_smoothing, at_weight, p"
    ]


# ----------------------------------------------------------------------------- a recipe's lr at another batch
def _lr_lines(stderr: str):
    return [line for line in stderr.splitlines() if "the linear rule gives" in line]


def test_a_recipe_lr_kept_at_another_batch_is_said_once(image_folder, tmp_path):
    """kd keeps a recipe's lr at another batch and says so in one line (stderr and config.yaml);
    nothing where the user gave the lr or the batch is the recipe's."""
    recipe = tmp_path / "fast.yaml"
    recipe.write_text("lr: 0.2\nbatch_size: 16\n")
    tiny = dict(no_teacher=True, student="timm:resnet10t", limit_train_batches=1, limit_val_batches=1)
    tiny.update(no_progress=True)
    r = kd_main(*train_args(image_folder, tmp_path / "b8", "--recipe", recipe, **tiny))
    assert r.returncode == 0, r.stderr
    line = (
        f"lr 0.2 is recipe {recipe}'s for batch 16; this run's batch is 8 and kd keeps lr 0.2 "
        f"(the linear rule gives --lr 0.1)"
    )
    assert _lr_lines(r.stderr) == [line], r.stderr
    assert f"# {line}\n" in (tmp_path / "b8" / "config.yaml").read_text()
    for name, given in (("lr", ["--lr", "0.2"]), ("same", ["-b", "16"])):
        r = kd_main(*train_args(image_folder, tmp_path / name, "--recipe", recipe, *given, **tiny))
        assert r.returncode == 0 and not _lr_lines(r.stderr), (name, r.stderr)


def test_each_student_says_its_own_recipe_lr(image_folder, tmp_path):
    """Several students: each one's line, in its own log (its prefix) and its own config.yaml."""
    recipes = {"a": "lr: 0.2\nbatch_size: 16\n", "b": "lr: 0.1\nbatch_size: 8\n"}
    for name, text in recipes.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    tiny = dict(teacher="timm:resnet10t", student="timm:resnet10t", limit_train_batches=1, limit_val_batches=1)
    tiny.update(no_progress=True, batch_size=4)
    given = [a for name in recipes for a in ("--recipe", tmp_path / f"{name}.yaml")]
    r = kd_main(*train_args(image_folder, tmp_path / "run", *given, **tiny))
    assert r.returncode == 0, r.stderr
    assert _lr_lines(r.stderr) == [
        f"[a] lr 0.2 is recipe {tmp_path / 'a.yaml'}'s for batch 16; this run's batch is 4 and kd keeps lr 0.2 "
        f"(the linear rule gives --lr 0.05)",
        f"[b] lr 0.1 is recipe {tmp_path / 'b.yaml'}'s for batch 8; this run's batch is 4 and kd keeps lr 0.1 "
        f"(the linear rule gives --lr 0.05)",
    ], r.stderr
    assert "the linear rule gives --lr 0.05" in (tmp_path / "run" / "b" / "config.yaml").read_text()


def test_only_a_recipe_lr_the_user_left_is_measured_against_its_batch(tmp_path):
    recipe = tmp_path / "fast.yaml"
    recipe.write_text("lr: 0.2\nbatch_size: 16\n")
    base = dict(teacher="resnet34", student="resnet18", data="synthetic", batch_size=8)
    kept = kd_config.resolve(recipe=str(recipe), options=base)
    assert kept.lr_for_batch == 16 and "the linear rule gives --lr 0.1)" in lr_note(kept)
    resumed = kd_config.resolve(options={"epochs": 5}, base=kept)  # a resume keeps what the recipe's lr is for
    assert lr_note(resumed) == lr_note(kept)
    for cfg in (
        kd_config.resolve(recipe=str(recipe), options=base, sets=["lr=0.05"]),
        kd_config.resolve(options={"lr": 0.1}, base=kept),
        kd_config.resolve(recipe="imagenet/r34_r18_kd"),  # its own batch
    ):
        assert lr_note(cfg) is None
    recipe.write_text("lr: 0.2\n")  # an lr without the batch it is for: nothing to measure it against
    assert kd_config.resolve(recipe=str(recipe), options=base).lr_for_batch is None
