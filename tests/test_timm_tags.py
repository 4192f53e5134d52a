"""timm names as timm users type them: ``timm:NAME.TAG`` for ``--teacher``, ``--student`` and
``kd eval --model``, the tag choosing the pretrained weights. Nothing is downloaded: the tag's
weights are a file placed in a temporary Hugging Face cache, read offline."""

from __future__ import annotations

import pytest
import timm
import torch
from conftest import kd_main, one_error_line, run_kd, train_args
from safetensors.torch import save_file
from test_early_answers import error_line, kd_then_torch

from kd import models
from kd.data.model_data import data_config
from kd.errors import KDError

TAGGED = "timm:resnet10t.c3_in1k"


@pytest.fixture
def hub(tmp_path):
    """The environment of an offline Hugging Face cache that holds timm's resnet10t.c3_in1k (random
    weights, 1000 classes); read by a fresh interpreter (huggingface_hub reads it as it is imported)."""
    home = tmp_path / "hf"
    repo = home / "hub" / "models--timm--resnet10t.c3_in1k"
    commit = "0" * 40
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    state = timm.create_model("resnet10t", num_classes=1000).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(repo / "snapshots" / commit / "model.safetensors"))
    return {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(tmp_path / "cache")}


def test_a_tagged_timm_name_is_a_model():
    models.check_name("timm:vit_base_patch16_224.augreg_in21k_ft_in1k")
    models.check_name(f"{TAGGED}")
    models.check_name("timm:resnet10t.")  # an empty tag is timm's default, as timm reads it
    with pytest.raises(KDError, match=r"timm has no tag 'c3_in1kk' for resnet10t \(did you mean c3_in1k\?\)"):
        models.check_name("timm:resnet10t.c3_in1kk")


def test_the_tag_chooses_the_pretrained_weights_and_their_data_config():
    assert models.timm_arch(TAGGED, "pretrained") == "resnet10t.c3_in1k"
    assert models.timm_arch(TAGGED, "timm:c3_in1k") == "resnet10t.c3_in1k"
    assert models.timm_arch("timm:resnet10t", "timm:c3_in1k") == "resnet10t.c3_in1k"
    vit = data_config("timm:vit_base_patch16_224.augreg_in21k_ft_in1k", "pretrained")
    assert vit.mean == (0.5, 0.5, 0.5) and vit.source == "timm vit_base_patch16_224.augreg_in21k_ft_in1k"


def test_kd_eval_model_with_a_tag_reads_that_tags_weights(hub, image_folder):
    r = run_kd("eval", "--model", TAGGED, "--weights", "pretrained", "--data", image_folder, env=hub)
    assert f"pretrained {TAGGED} has 1000 classes but the data has 3" in one_error_line(r)  # the file was read


def test_a_tagged_teacher_takes_its_tags_pretrained_weights(hub, image_folder, tmp_path):
    r = run_kd(*train_args(image_folder, tmp_path / "run", teacher=TAGGED, teacher_weights="pretrained"), env=hub)
    assert f"pretrained {TAGGED} has 1000 classes but the data has 3" in one_error_line(r)


def test_a_tag_and_other_timm_weights_are_refused_in_one_line_before_torch(image_folder, tmp_path):
    r = kd_then_torch(*train_args(image_folder, tmp_path / "run", teacher=TAGGED, teacher_weights="timm:a1_in1k"))
    assert error_line(r) == (
        f"kd: error: --teacher {TAGGED} asks for timm's c3_in1k weights but --teacher-weights timm:a1_in1k for "
        "a1_in1k: name them once, as --teacher timm:resnet10t.a1_in1k "
        "(or --teacher timm:resnet10t --teacher-weights timm:a1_in1k)"
    )
    assert r.stdout == "False"
    with pytest.raises(KDError, match="asks for timm's c3_in1k weights but the weights timm:a1_in1k for a1_in1k"):
        models.timm_arch(TAGGED, "timm:a1_in1k")


def test_tagged_names_train_and_a_file_for_a_tag_is_said_in_one_line(image_folder, tmp_path):
    weights = tmp_path / "teacher.pt"
    torch.save(timm.create_model("resnet10t", num_classes=3).state_dict(), weights)
    options = dict(teacher=TAGGED, teacher_weights=weights, student=TAGGED, no_progress=True)
    r = kd_main(*train_args(image_folder, tmp_path / "run", **options, limit_train_batches=1))
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stderr.splitlines() if "names timm's" in line]
    assert said == [
        f"kd: warning: --teacher {TAGGED} names timm's c3_in1k weights, but --teacher-weights {weights} "
        "are loaded into it (the tag chooses only its configuration and data config)"
    ]
