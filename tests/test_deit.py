"""DeiT's distillation token held equal to the official code.

Golden values: facebookresearch/deit ``losses.py`` (``DistillationLoss``) at commit
ae4dba9b453b9e18faa781edbc13039aaeca9b68. A script outside this repository ran that class, copied
verbatim, in float64 on the CPU: the student's output the tuple (class head's, distillation head's)
logits below, its teacher a module that returns the fixed logits below, its base criterion plain
``torch.nn.CrossEntropyLoss`` (timm's ``LabelSmoothingCrossEntropy`` where smoothing is given; DeiT's
own runs use mixup's soft-target cross-entropy), and printed the loss and the gradients with respect
to both heads with ``repr``. The soft term divides by the number of logits, not the batch, as the
official code does.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from kd.errors import KDError
from kd.losses import DistillInputs, build_loss

BATCH, CLASSES = 3, 5
LABELS = torch.tensor([0, 3, 4])
ZERO = [[0.0] * CLASSES] * BATCH

# (distillation type, tau, alpha, label smoothing) -> the official loss and its gradients
OFFICIAL = {
    ("hard", 1.0, 1.0, 0.0): {
        "loss": 1.1635120131263892,
        "cls_grad": ZERO,
        "dist_grad": [
            [-0.1518294292898076, 0.0960835473281584, 0.03832257773786187, 0.013041636905556844, 0.004381667318230511],
            [0.11680857201009173, 0.05848637329108478, 0.041881844629803044, 0.04487629799333122, -0.2620530879243108],
            [
                0.0037009608951514062,
                0.010236160696318502,
                0.03085094739944537,
                -0.2460642251419285,
                0.20127615615101324,
            ],
        ],
    },
    ("soft", 1.0, 1.0, 0.0): {
        "loss": 0.08187146310091944,
        "cls_grad": ZERO,
        "dist_grad": [
            [
                -0.014117283884908974,
                0.007626468847410972,
                0.004652647895739986,
                0.0015465628881023512,
                0.0002916042536556682,
            ],
            [
                0.02257581182251212,
                0.010444161906508237,
                0.0051694799921976385,
                -0.0026236308283683497,
                -0.03556582289284965,
            ],
            [
                -0.001369367000509129,
                -0.005048618239531359,
                -0.010097568109596314,
                -0.005265396467243642,
                0.021780949816880446,
            ],
        ],
    },
    ("soft", 3.0, 1.0, 0.0): {
        "loss": 0.11956453361564748,
        "cls_grad": ZERO,
        "dist_grad": [
            [
                -0.015482092309539374,
                0.003146935256390019,
                0.00710564464519628,
                0.004703379106851803,
                0.0005261333011012797,
            ],
            [
                0.029428333031200706,
                0.01603582987216375,
                0.003514549159644791,
                -0.012427181971958455,
                -0.03655153009105082,
            ],
            [
                -0.004835855473719888,
                -0.008952408609524775,
                -0.00861688131787164,
                0.0012120855532868548,
                0.021193059847829498,
            ],
        ],
    },
    ("hard", 1.0, 0.5, 0.1): {
        "loss": 1.5395699204603017,
        "cls_grad": [
            [-0.12364298733963146, 0.04164285367092573, 0.04243381389630328, 0.027877413232813987, 0.01168890653958842],
            [
                0.10616837557145171,
                0.03321095916957254,
                0.00925680040124166,
                -0.14816096313358484,
                -0.0004751720086810563,
            ],
            [
                0.0035520282866119334,
                0.00498914628174515,
                0.011381722673132082,
                0.03190010980164862,
                -0.05182300704313777,
            ],
        ],
        "dist_grad": [
            [
                -0.0759147146449038,
                0.0480417736640792,
                0.019161288868930936,
                0.006520818452778422,
                0.0021908336591152555,
            ],
            [0.058404286005045866, 0.02924318664554239, 0.020940922314901522, 0.02243814899666561, -0.1310265439621554],
            [
                0.0018504804475757031,
                0.005118080348159251,
                0.015425473699722685,
                -0.12303211257096425,
                0.10063807807550662,
            ],
        ],
    },
    ("soft", 3.0, 0.3, 0.0): {
        "loss": 1.3643932749448597,
        "cls_grad": [
            [-0.19176684894215068, 0.06296666180596269, 0.06407400612149126, 0.04369504519260625, 0.021031135822090454],
            [0.15330239246669905, 0.05116200950406822, 0.01762618722840499, -0.22609201505368545, 0.004001425854513187],
            [
                0.009639506267923374,
                0.011651471461109874,
                0.02060107840905158,
                0.04932682038897473,
                -0.09121887652705955,
            ],
        ],
        "dist_grad": [
            [
                -0.004644627692861811,
                0.0009440805769170071,
                0.0021316933935588843,
                0.0014110137320555403,
                0.00015783999033038368,
            ],
            [
                0.008828499909360212,
                0.004810748961649124,
                0.001054364747893437,
                -0.0037281545915875364,
                -0.010965459027315244,
            ],
            [
                -0.0014507566421159666,
                -0.0026857225828574327,
                -0.002585064395361494,
                0.0003636256659860578,
                0.00635791795434885,
            ],
        ],
    },
}


def fill(shape, seed, scale=1.0):
    """A deterministic tensor: sin(0.37 k + seed) * scale over the flat index k, float64."""
    return torch.sin(torch.arange(math.prod(shape), dtype=torch.float64) * 0.37 + seed).reshape(shape) * scale


def golden_inputs() -> DistillInputs:
    x = DistillInputs(fill((BATCH, CLASSES), 1, 3.0).requires_grad_(), LABELS, fill((BATCH, CLASSES), 3, 4.0))
    x.distill_logits = fill((BATCH, CLASSES), 2, 3.0).requires_grad_()
    return x


def deit_args(kind: str, tau: float, alpha: float, smoothing: float):
    return {
        "hard": int(kind == "hard"),
        "temperature": tau,
        "ce_weight": 1 - alpha,
        "kd_weight": alpha,
        "label_smoothing": smoothing,
    }


def test_defaults_are_the_official_command_line():
    loss = build_loss("deit", 1000, {})
    assert loss.hparams == {"ce_weight": 0.5, "label_smoothing": 0.0, "kd_weight": 0.5, "temperature": 1.0, "hard": 1}


@pytest.mark.parametrize("case", sorted(OFFICIAL))
def test_equal_to_the_official_code(case):
    golden = OFFICIAL[case]
    x = golden_inputs()
    out = build_loss("deit", CLASSES, deit_args(*case))(x)
    # the distillation part alone (alpha 1) is float64 throughout; kd's label term is float32
    rtol = 1e-12 if case[2] == 1.0 else 1e-6
    assert out["loss"].item() == pytest.approx(golden["loss"], rel=rtol)
    out["loss"].backward()
    assert x.student_logits.grad is not None and x.distill_logits is not None and x.distill_logits.grad is not None
    for got, key in ((x.student_logits.grad, "cls_grad"), (x.distill_logits.grad, "dist_grad")):
        torch.testing.assert_close(got, torch.tensor(golden[key], dtype=torch.float64), rtol=rtol, atol=1e-9)


def test_deits_alpha_and_tau_are_accepted():
    loss = build_loss("deit", CLASSES, {"alpha": 0.3, "tau": 3.0, "hard": 0})
    assert (loss.hparams["ce_weight"], loss.hparams["kd_weight"], loss.hparams["temperature"]) == (0.7, 0.3, 3.0)
    assert loss(golden_inputs())["loss"].item() == pytest.approx(OFFICIAL[("soft", 3.0, 0.3, 0.0)]["loss"], rel=1e-6)


def test_the_soft_term_is_the_batch_mean_kl_over_the_classes():
    from kd.losses.base import kd_divergence

    x = golden_inputs()
    out = build_loss("deit", CLASSES, {"hard": 0, "temperature": 3.0, "ce_weight": 0.0, "kd_weight": 1.0})(x)
    assert x.distill_logits is not None and x.teacher_logits is not None
    batch_mean = kd_divergence(x.distill_logits, x.teacher_logits, 3.0)
    assert out["kd"].item() == pytest.approx(batch_mean.item() / CLASSES, rel=1e-12)


@pytest.mark.parametrize(
    "args, says", [({"hard": 2}, "hard must be 1 .hard. or 0 .soft."), ({"alpha": 1.5}, "alpha must be")]
)
def test_bad_settings_are_one_line(args, says):
    with pytest.raises(KDError, match=f"KD loss 'deit': {says}"):
        build_loss("deit", CLASSES, args)


# ---------------------------------------------------------------- a distilled DeiT student in a run

DEIT = "timm:deit_tiny_distilled_patch16_224"


def student_and_loss(image_folder, tmp_path, **options):
    from conftest import tiny_config

    from kd.run.build import build_models

    cfg = tiny_config(image_folder, tmp_path, **{"student": DEIT, "teacher": "timm:test_vit", **options})
    student, loss, _, _, _ = build_models(cfg, 3)
    return student, loss


def test_both_heads_reach_the_loss_and_eval_is_their_average(image_folder, tmp_path):
    from kd.losses.deit import deit_distillation
    from kd.run.record import StepInputs
    from kd.run.sides import StudentSide

    student, loss = student_and_loss(image_folder, tmp_path, kd_loss="deit")
    side = StudentSide(student, loss, []).train()
    images, labels, teacher = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 0]), torch.randn(4, 3)
    parts = side(StepInputs(images, {"labels": labels, "teacher_logits": teacher}))
    parts["loss"].backward()
    assert student.head.weight.grad.abs().sum() > 0 and student.head_dist.weight.grad.abs().sum() > 0
    with torch.no_grad():
        heads = student(images)
        assert isinstance(heads, tuple)
        assert parts["kd"].item() == pytest.approx(deit_distillation(heads[1], teacher, True, 1.0).item(), rel=1e-6)
        assert parts["ce"].item() == pytest.approx(torch.nn.functional.cross_entropy(heads[0], labels).item(), rel=1e-6)
        torch.testing.assert_close(student.eval()(images), (heads[0] + heads[1]) / 2)


@pytest.mark.parametrize("method", ["kd", "dkd", "nkd", "dist", "mlkd", "ctkd", "lskd"])
def test_the_logit_methods_train_a_distilled_deit_through_the_heads_average(image_folder, tmp_path, method):
    from kd.run.record import StepInputs
    from kd.run.sides import StudentSide

    student, loss = student_and_loss(image_folder, tmp_path, kd_loss=method)
    images, teacher = torch.randn(2, 3, 32, 32), torch.randn(2, 3)
    assert isinstance(student.train()(images), torch.Tensor)
    seen = {"labels": torch.tensor([0, 2]), "teacher_logits": teacher}
    inputs = StepInputs(images, seen)
    if loss.card.views == 2:
        inputs = StepInputs(images, {**seen, "second_teacher_logits": teacher}, images.flip(3))
    StudentSide(student, loss, [])(inputs)["loss"].backward()
    assert student.head.weight.grad.abs().sum() > 0 and student.head_dist.weight.grad.abs().sum() > 0


def test_a_student_without_a_distillation_token_is_refused(image_folder, tmp_path):
    with pytest.raises(
        KDError, match=r"KD loss 'deit' needs a student with a distillation token .*timm:test_vit has none"
    ):
        student_and_loss(image_folder, tmp_path, kd_loss="deit", student="timm:test_vit")


def test_a_run_of_a_distilled_deit_at_32_px_exports_what_timm_loads(image_folder, tmp_path):
    """A ViT teacher with random weights at 32 px (a traceback before) teaching a distilled DeiT."""
    import timm
    from conftest import kd_main, train_args

    run = tmp_path / "run"
    options = dict(student=DEIT, teacher="timm:test_vit", kd_loss="deit", batch_size=4, limit_train_batches=2)
    r = kd_main(*train_args(image_folder, run, no_progress=True, **options))
    assert r.returncode == 0, r.stderr
    log = r.stdout + r.stderr
    assert f"student {DEIT} is a 224 px model: built with timm's dynamic_img_size" in log
    assert "teacher timm:test_vit is a 160 px model: built with timm's dynamic_img_size" in log
    assert kd_main("export", run, "-o", tmp_path / "w.pt").returncode == 0
    model = timm.create_model(DEIT[len("timm:") :], num_classes=3, dynamic_img_size=True)
    model.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True))
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["student"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert model.eval()(torch.randn(1, 3, 32, 32)).shape == (1, 3)
    r = kd_main(
        "eval", "--weights", run / "checkpoints" / "last.pt", "--data", image_folder, "-j", 0, "--device", "cpu"
    )
    assert r.returncode == 0, r.stderr
    # kd eval of the checkpoint (the heads' average, built at 32 px) gives the run's own validation loss
    val_loss = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["val_loss"]
    assert f"loss {val_loss:.4f}" in r.stdout
