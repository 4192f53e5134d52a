"""The paper setting a run resembles (kd.run.paper_setting): a run whose teacher weights, weight decay or
temperature depart from it says so in one line at its start (and in config.yaml), and ``kd report``
marks it: its paper_setting column, a footnote in the markdown and LaTeX tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import kd_main, train_args

from kd import config as kd_config
from kd.commands.report import method_defaults
from kd.run import paper_setting


def setting(**options):
    return kd_config.resolve(options={"data": "/imagenet", **options}).to_dict()


def test_kd_defaults_on_the_papers_pairs_are_told_apart_from_the_papers():
    name, found = paper_setting.departures(setting(teacher="resnet50", student="timm:mobilenetv1_100"), method_defaults)
    assert name == "imagenet/r50_mv1_kd"
    assert [d.words for d in found] == [
        "teacher weights pretrained = IMAGENET1K_V2 (the paper's: IMAGENET1K_V1, --teacher-weights torchvision:IMAGENET1K_V1)",
        "BatchNorm and biases not decayed (the paper decays every parameter: --wd-bn-bias)",
        "T 4 (the paper's: 1)",
    ]
    # resnet34's default weights are the papers' V1: only the decay and the temperature differ
    assert paper_setting.cell(setting(teacher="resnet34", student="resnet18"), method_defaults) == (
        "unlike imagenet/r34_r18_kd: no wd on BN/bias, T 4"
    )
    # a student of the same family, another method: that method's recipe of the pair
    assert paper_setting.cell(setting(teacher="resnet50", student="mobilenet_v2", kd_loss="dkd"), method_defaults) == (
        "unlike imagenet/r50_mv1_dkd: teacher IMAGENET1K_V2, no wd on BN/bias"
    )
    assert (
        paper_setting.cell(setting(student="resnet18", no_teacher=True), method_defaults)
        == "unlike imagenet/baseline_r18: no wd on BN/bias"
    )
    assert (
        paper_setting.cell(setting(teacher="resnet152", student="resnet18"), method_defaults) == "-"
    )  # no paper has this pair


def test_the_papers_setting_is_not_marked_and_an_override_of_a_recipe_is():
    assert paper_setting.departures(kd_config.resolve(recipe="imagenet/r50_mv1_kd").to_dict(), method_defaults) == (
        "imagenet/r50_mv1_kd",
        [],
    )
    assert paper_setting.start_line(kd_config.resolve(recipe="imagenet/r50_mv1_kd").to_dict(), method_defaults) is None
    theirs = setting(teacher="resnet34", student="resnet18", wd_bn_bias=True, temperature=1.0)
    assert paper_setting.cell(theirs, method_defaults) == "as imagenet/r34_r18_kd"
    changed = kd_config.resolve(
        recipe="imagenet/r50_mv1_kd", options={"teacher_weights": "pretrained", "temperature": 4}
    )
    assert (
        paper_setting.cell(changed.to_dict(), method_defaults)
        == "unlike imagenet/r50_mv1_kd: teacher IMAGENET1K_V2, T 4"
    )
    dropped = kd_config.resolve(recipe="imagenet/r50_mv1_kd", options={"drop_path": 0.05}).to_dict()
    assert paper_setting.cell(dropped, method_defaults) == "unlike imagenet/r50_mv1_kd: drop path 0.05"
    # a teacher from a file is not compared (its weights are not known here); none is
    assert paper_setting.cell(
        setting(teacher="resnet34", student="resnet18", teacher_weights="none", wd_bn_bias=True), method_defaults
    ) == ("unlike imagenet/r34_r18_kd: teacher none, T 4")


def test_a_run_says_at_its_start_where_it_departs_and_kd_report_marks_it(image_folder, tmp_path):
    out = tmp_path / "alone"
    # one step of synthetic tensors (an epoch of them is 100): the line and the report cell come from the config
    options = dict(no_teacher=True, no_progress=True, num_classes=1000, limit_train_batches=1)
    r = kd_main(*train_args("synthetic", out, **options))
    assert r.returncode == 0, r.stderr
    line = (
        "paper setting: unlike recipe imagenet/baseline_r18, this run has BatchNorm and biases not decayed "
        "(the paper decays every parameter: --wd-bn-bias) (kd train --recipe imagenet/baseline_r18 for the paper's)"
    )
    assert r.stderr.splitlines().count(line) == 1, r.stderr
    assert f"# {line}" in (out / "config.yaml").read_text()
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["train_set_images"] == 8  # the data's
    r = kd_main("report", out)
    header = next(row for row in r.stdout.splitlines() if row.startswith("| run"))
    assert "| diff | paper_setting | wall_time |" in header
    # and on 8 images an epoch it is not the paper's setting whatever else it keeps
    assert "| unlike imagenet/baseline_r18: not ImageNet (8 train images), no wd on BN/bias, " in r.stdout, r.stdout


def _run(root: Path, top1: float, recipe=None, **options) -> Path:
    """A run folder as kd writes it (config.yaml, metrics.jsonl), of ``recipe`` and ``options``, on ImageNet."""
    cfg = kd_config.resolve(recipe=recipe, options={"data": "/imagenet", **options})
    out = root / (recipe.split("/")[-1] if recipe else f"{cfg.kd_loss}_{len(list(root.glob('*')))}")
    out.mkdir(parents=True)
    kd_config.save(cfg, out / "config.yaml")
    record = {"epoch": cfg.epochs, "train_images": 1_281_167, "val_top1": top1, "val_top5": top1 + 20, "seconds": 1}
    (out / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    return out


@pytest.mark.parametrize("fmt", ["markdown", "latex"])
def test_the_papers_table_footnotes_a_run_unlike_the_paper(tmp_path, fmt):
    _run(tmp_path, 69.6, "imagenet/baseline_r18")
    _run(tmp_path, 71.0, "imagenet/r34_r18_dkd")
    _run(tmp_path, 70.1, teacher="resnet34", student="resnet18", epochs=100)  # kd's defaults, no recipe
    r = kd_main("report", tmp_path, "--format", fmt)
    assert r.returncode == 0, r.stderr
    if fmt == "markdown":
        rows = [line for line in r.stdout.splitlines() if line.startswith("| ")][1:]
        assert rows == [
            "| student alone (resnet18) | 69.60 | 89.60 | 69.60 | 89.60 | 69.76 | -0.16 |",
            "| KD [1] | 70.10 | 90.10 | 70.10 | 90.10 | - | - |",
            "| DKD | 71.00 | 91.00 | 71.00 | 91.00 | 71.70 | -0.70 |",
        ], r.stdout
        # kd's defaults first, then the batch of 256 where the paper's is 512
        footnote = "[1] unlike imagenet/r34_r18_kd: no wd on BN/bias, T 4, batch_size 256 (512) ..."
        assert r.stdout.rstrip().endswith(f"\n\n{footnote}"), r.stdout
    else:
        body = r.stdout.splitlines()
        assert r"KD [1] & 70.10 & 90.10 & 70.10 & 90.10 & - & - \\" in body
        footnote = r"[1] unlike imagenet/r34\_r18\_kd: no wd on BN/bias, T 4, batch\_size 256 (512) ..."
        assert body[-2:] == [rf"\multicolumn{{7}}{{l}}{{\footnotesize {footnote}}} \\", r"\end{tabular}"], r.stdout


def test_a_saved_config_keeps_the_line_as_a_comment_only(tmp_path):
    """config.yaml's notes are comments: the saved config loads as before."""
    cfg = kd_config.resolve(options={"data": "/imagenet", "teacher": "resnet34", "student": "resnet18"})
    kd_config.save(
        cfg, tmp_path / "config.yaml", notes=[paper_setting.start_line(cfg.to_dict(), method_defaults) or ""]
    )
    assert kd_config.load(tmp_path / "config.yaml") == cfg
    assert "paper_setting" not in yaml.safe_load((tmp_path / "config.yaml").read_text())


def test_what_a_config_leaves_out_is_not_compared():
    """A config of an older kd (or written by hand) that leaves the settings out resembles its recipe
    and departs from it in nothing known."""
    partial = {"kd_loss": "kd", "teacher": "resnet34", "student": "resnet18", "epochs": 1}
    assert paper_setting.cell(partial, method_defaults) == "as imagenet/r34_r18_kd"


def test_a_run_on_other_classes_than_imagenet_resembles_no_paper(image_folder, tmp_path):
    """The recipes are ImageNet-1k's: a run on a folder of other classes (kd demo's digits, say) is
    compared with none, at its start or in kd report."""
    assert paper_setting.cell(setting(student="resnet18", no_teacher=True, num_classes=10), method_defaults) == "-"
    assert paper_setting.cell(setting(student="resnet18", no_teacher=True, num_classes=1000), method_defaults) != "-"
    out = tmp_path / "run"
    r = kd_main(*train_args(image_folder, out, no_teacher=True, no_progress=True))
    assert r.returncode == 0, r.stderr
    assert "paper setting" not in r.stderr and "paper setting" not in (out / "config.yaml").read_text()
    r = kd_main("report", out)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith(f"| {out}"))
    assert "baseline_r18" not in row, r.stdout


def test_a_dot_run_resembles_the_dot_recipe_and_departs_from_the_others():
    """--dot is part of the paper setting: a KD run with it resembles the DOT recipe of its pair, and
    the DOT recipe's setting without it (or a KD recipe with it) departs, at the start and in kd report."""
    assert paper_setting.cell(setting(teacher="resnet34", student="resnet18", dot=True), method_defaults).startswith(
        "unlike imagenet/r34_r18_kd_dot:"
    )
    assert paper_setting.cell(
        kd_config.resolve(recipe="imagenet/r34_r18_kd_dot", options={"data": "/imagenet"}).to_dict(), method_defaults
    ) == ("as imagenet/r34_r18_kd_dot")
    off = kd_config.resolve(recipe="imagenet/r34_r18_kd_dot", options={"data": "/imagenet", "dot": False}).to_dict()
    assert paper_setting.cell(off, method_defaults) == "unlike imagenet/r34_r18_kd_dot: no DOT"
    on = kd_config.resolve(recipe="imagenet/r34_r18_kd", options={"data": "/imagenet", "dot": True}).to_dict()
    assert paper_setting.cell(on, method_defaults) == "unlike imagenet/r34_r18_kd: DOT"


def test_a_standardised_run_resembles_the_logit_standardisation_recipe():
    """--logit-standardisation is part of the paper setting: a DKD run with it resembles DKD + LS of its
    pair (and departs from its T 2), one without it DKD's recipe."""
    ls = setting(teacher="resnet34", student="resnet18", kd_loss="dkd", standardise=True, wd_bn_bias=True)
    assert paper_setting.cell(ls, method_defaults) == "unlike imagenet/r34_r18_dkd_ls: T 1"
    plain = setting(teacher="resnet34", student="resnet18", kd_loss="dkd", wd_bn_bias=True)
    assert paper_setting.cell(plain, method_defaults) == "as imagenet/r34_r18_dkd"
    recipe = kd_config.resolve(recipe="imagenet/r50_mv1_mlkd_ls", options={"data": "/imagenet"}).to_dict()
    assert paper_setting.cell(recipe, method_defaults) == "as imagenet/r50_mv1_mlkd_ls"
