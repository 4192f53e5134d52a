"""The methods that need more than logits and module outputs, through the engine as a user runs them:
pre-ReLU stages and pooled features tapped on real models, CRD's memory, CTKD's temperature and MLKD's
second view over several processes, beside other students and across a resume."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import kd_main, last_checkpoint, run_kd, train_args

NEW_METHODS = ["crd", "ofd", "reviewkd", "sddkd"]
#: the logged term of each method where it is not named after the method
TERM = {"sddkd": "kd"}
#: a few negatives: CRD's 16,384 would be drawn from the same 16 samples again and again here
SMALL = {"crd": {"negatives": 64}}
#: the students of the one-process runs: timm's test_resnet (BatchNorm and a ReLU after each stage's
#: residual sum, as resnet18, whose checkpoints, written each epoch with their momentum and a best
#: copy, cost more than its training), taught by resnet18, tapped as torchvision's BasicBlocks are
STUDENT = "timm:test_resnet"


def recipes(root, methods):
    """``--recipe`` arguments of one recipe file per method (the method and its small settings)."""
    args = []
    for method in methods:
        recipe = root / f"{method}.yaml"
        recipe.write_text(yaml.safe_dump({"kd_loss": method, "loss_args": SMALL.get(method, {})}))
        args += ["--recipe", recipe]
    return args


def test_resumed_students_equal_the_uninterrupted_ones(image_folder, tmp_path):
    """The new methods' students together, stopped after an epoch and resumed: their weights,
    connectors, CRD's memory and Z equal those of the run that was not stopped."""
    students = recipes(tmp_path, NEW_METHODS)
    options = dict(student=STUDENT, lr_schedule="constant")
    r = kd_main(*train_args(image_folder, tmp_path / "full", *students, epochs=2, **options))
    assert r.returncode == 0, r.stderr
    r = kd_main(*train_args(image_folder, tmp_path / "part", *students, epochs=1, **options))
    assert r.returncode == 0, r.stderr
    r = kd_main("train", "--out", tmp_path / "part", "--resume", "--epochs", 2)
    assert r.returncode == 0, r.stderr
    for method in NEW_METHODS:
        a, b = last_checkpoint(tmp_path / "full" / method), last_checkpoint(tmp_path / "part" / method)
        assert a["global_step"] == b["global_step"] == 6
        for part in ("student", "loss"):
            assert a[part].keys() == b[part].keys() and (a[part] or method == "sddkd")  # SDD: no loss parameters
            for key, value in a[part].items():
                assert torch.equal(value, b[part][key]), (method, part, key)
        records = [json.loads(x) for x in (tmp_path / "part" / method / "metrics.jsonl").read_text().splitlines()]
        assert all(r["train_skipped_steps"] == 0 for r in records), records
        assert records[-1][f"train_{TERM.get(method, method)}"] > 0


#: the two-process runs' students that equal one process's: CRD (its memory and negatives) and CTKD
#: (its temperature), of ConvNeXt, whose LayerNorms keep no batch statistics
TOGETHER = ["crd", "ctkd"]
TOGETHER_RUN = dict(student="timm:convnext_atto", lr_schedule="constant", workers=0)
#: the students of those runs: :data:`TOGETHER`, and MLKD beside them, whose strong views the
#: processes shard with the first views (its lane leaves the others' batches and targets as they
#: were: test_mlkd)
TWO_PROCESS_STUDENTS = [*TOGETHER, "mlkd"]


@pytest.fixture(scope="module")
def two_processes(image_folder, tmp_path_factory):
    """One epoch of the :data:`TWO_PROCESS_STUDENTS` under torch_ddp in two processes: its folder."""
    root = tmp_path_factory.mktemp("two_processes")
    out = root / "two"
    ddp = ("--backend", "torch_ddp", "--nproc", 2)
    r = run_kd(*train_args(image_folder, out, *recipes(root, TWO_PROCESS_STUDENTS), *ddp, **TOGETHER_RUN))
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.slow
def test_crd_memory_takes_every_process_samples(two_processes):
    """Two processes of one epoch (the CRD student of :func:`two_processes`): every training sample's
    row in rank 0's memory (the checkpoint's) moved, the half rank 1 trained included; each row is a
    unit vector, and Z was set."""
    state = last_checkpoint(two_processes / "crd")["loss"]["_extra_state"]
    n = 3 * 8  # image_folder: 3 classes of 8 training images
    memory, z = state[:-2].view(2, n, 128), state[-2:]
    assert torch.isfinite(z).all() and (z > 0).all()
    torch.testing.assert_close(memory.norm(dim=2), torch.ones(2, n))


def test_soft_labels_refuse_crd(tmp_path):
    r = kd_main(
        "train",
        "--data",
        "synthetic",
        "--student",
        "resnet18",
        "--kd-loss",
        "crd",
        "--soft-labels",
        tmp_path,
        "--out",
        tmp_path / "o",
    )
    assert r.returncode == 2 and "--kd-loss crd needs the teacher's features" in r.stderr, r.stderr


def test_the_new_methods_beside_others_equal_their_separate_runs(image_folder, tmp_path):
    """One teacher forward with the union of every student's taps (pre-ReLU stages, pooled features),
    each student bit for bit its own run."""
    options = dict(student=STUDENT, limit_train_batches=2)
    r = kd_main(*train_args(image_folder, tmp_path / "table", *recipes(tmp_path, ["kd", *NEW_METHODS]), **options))
    assert r.returncode == 0, r.stderr
    for method in NEW_METHODS:
        r = kd_main(*train_args(image_folder, tmp_path / method, *recipes(tmp_path, [method]), **options))
        assert r.returncode == 0, r.stderr
        together, alone = last_checkpoint(tmp_path / "table" / method), last_checkpoint(tmp_path / method)
        assert together["global_step"] == alone["global_step"] == 2
        for part in ("student", "loss"):
            assert together[part].keys() == alone[part].keys()
            for key, value in alone[part].items():
                assert torch.equal(together[part][key], value), (method, part, key)


def test_crd_trains_on_synthetic_tensors(tmp_path):
    """kd bench times on synthetic tensors: their listing names classes for CRD to draw negatives by
    (not class 0 for every sample, which CRD refuses)."""
    options = dict(student=STUDENT, teacher="resnet18", teacher_weights="none", image_size=32, batch_size=8)
    r = kd_main(*train_args("synthetic", tmp_path / "run", "--loss-arg", "negatives=64", kd_loss="crd",
                            limit_train_batches=2, **options))  # fmt: skip
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_two_processes_equal_one_process_of_the_same_global_batch(image_folder, tmp_path, two_processes):
    """Students without batch statistics (ConvNeXt's LayerNorms), so that what two processes train
    can equal one process: the same global batches; CRD's negatives, Z and every memory update;
    CTKD's one temperature, its gradient all-reduced with the student's. Both methods are students
    of one run (each its own wrapper and reductions), so one run of each kind proves both; the
    one-process run trains in this process (the processes under test are the two), with the same
    students."""
    r = kd_main(*train_args(image_folder, tmp_path / "one", *recipes(tmp_path, TWO_PROCESS_STUDENTS), **TOGETHER_RUN))
    assert r.returncode == 0, r.stderr
    for method in TOGETHER:
        one, two = last_checkpoint(tmp_path / "one" / method), last_checkpoint(two_processes / method)
        assert one["global_step"] == two["global_step"] == 3
        assert one["loss"], method  # CRD's memory and embeddings, CTKD's temperature
        for part in ("student", "loss"):
            for key, value in one[part].items():
                torch.testing.assert_close(two[part][key], value, rtol=1e-4, atol=1e-5, msg=f"{method} {part} {key}")


@pytest.mark.slow
def test_two_processes_train_mlkd(two_processes):
    """Two processes (the strong views sharded with the first, the teacher's and the student's second
    forward under DDP) train as one process does (the MLKD student of :func:`two_processes`). Not
    equal to one process of the same global batch, by design: the median masks and the class- and
    batch-level Gram matrices are taken over each process's batch, as the official DataParallel
    replicas take them over each GPU's share."""
    assert last_checkpoint(two_processes / "mlkd")["global_step"] == 3
    last = json.loads((two_processes / "mlkd" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["train_skipped_steps"] == 0 and all(last[f"train_{t}"] > 0 for t in ("kd", "cc", "bc")), last


def test_crd_reads_each_sample_index_from_a_prepared_copy(image_folder, tmp_path):
    """A kd prepare copy carries every sample's index to the loss as the folder does: after one epoch
    every memory row was written (a unit vector; the initial rows are not)."""
    copy = tmp_path / "copy"
    r = kd_main("prepare", image_folder, copy, "--max-side", 48)
    assert r.returncode == 0, r.stderr
    r = kd_main(*train_args(copy, tmp_path / "run", "--loss-arg", "negatives=64", kd_loss="crd", student=STUDENT))
    assert r.returncode == 0, r.stderr
    state = last_checkpoint(tmp_path / "run")["loss"]["_extra_state"]
    memory = state[:-2].view(2, 24, 128)
    torch.testing.assert_close(memory.norm(dim=2), torch.ones(2, 24))


@pytest.mark.parametrize(
    "method, layers, says",
    [("at", None, "has no default feature layers"), ("fitnet", "blocks.0", "needs \\(N, C, H, W\\) feature maps")],
)
def test_a_feature_method_on_a_vit_it_cannot_tap_names_the_method_and_the_models(
    image_folder, tmp_path, method, layers, says
):
    from conftest import tiny_config

    from kd.errors import KDError
    from kd.run.build import build_models

    options = dict(kd_loss=method, student="timm:test_vit", teacher="timm:test_vit", feature_layers=layers)
    cfg = tiny_config(image_folder, tmp_path, **{k: v for k, v in options.items() if v})
    with pytest.raises(
        KDError, match=f"KD loss '{method}' {says}.*\\(student timm:test_vit, teacher timm:test_vit\\)$"
    ):
        build_models(cfg, 3)
