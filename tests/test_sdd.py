"""SDD (SD-KD, SD-DKD, SD-NKD) held equal to the official code.

Golden values: shicaiwei123/SDD-CVPR2024 at commit e412036c6b7b67d8ed25418d2dedad223ab49a71, its
``sdd_kd_loss`` (``mdistiller/distillers/KD.py``), ``multi_dkd`` (``SDD_DKD.py``) and
``multi_nkd_loss`` (``SDD_nkd.py``) on the cell scores of its ImageNet models' head (``SPP`` of
``mdistiller/models/imagenet/utils.py``, then the fc on each cell, as ``ResNet_SDD.forward``). A
script outside this repository ran them unmodified (``Tensor.cuda`` made the identity) in float64
on the CPU with the inputs below and printed the numbers with ``repr``: the loss, and the gradient
of the student's map and classifier weighed by the fixed probes below.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kd.errors import KDError
from kd.losses import DistillInputs, build_loss
from kd.losses.sdd import cells, region_weights

RTOL = 1e-9
LABELS = torch.tensor([2, 1, 3])  # the teacher is right on the global cell of samples 0 and 2
SCALES = {"[1,2,4]": [1, 2, 4], "[1,2]": [1, 2]}

# (method, hyper-parameters, official M) -> (loss, map-gradient probe, fc-weight probe, fc-bias probe)
OFFICIAL = {
    ("sdkd", (("temperature", 4.0),), "[1,2,4]"): (1.498385210158468, 2.008342290612586, -0.2136295626926743, -1.581343870158748),
    ("sdkd", (("temperature", 1.0),), "[1,2,4]"): (1.256055270425396, 1.194555491183988, -0.1791486001824937, -1.1584839154730997),
    ("sddkd", (("nckd_weight", 2.0), ("temperature", 1.0)), "[1,2,4]"): (2.633881143365777, 2.0223485275658035, -0.23936164316727418, -2.798496816936214),
    ("sddkd", (("nckd_weight", 0.5), ("temperature", 2.0)), "[1,2,4]"): (1.0816659763265335, 1.2427608394244107, -0.19328391925355592, -1.0268694256673516),
    ("sdnkd", (("temperature", 1.0), ("non_target_weight", 2.0)), "[1,2,4]"): (7.285962104016744, 2.5434737129374794, -0.36121254945821835, -2.6416318416182194),
    ("sdnkd", (("temperature", 2.0), ("non_target_weight", 0.5)), "[1,2,4]"): (5.970986595994019, 0.996015207728477, -0.10577101462215256, -1.050183613552647),
    ("sdkd", (("temperature", 4.0),), "[1,2]"): (0.9506839159312271, 1.5826867832243368, 0.00671142508423625, -1.6031290304159147),
    ("sdkd", (("temperature", 1.0),), "[1,2]"): (0.8462197265482841, 1.239457261835672, 0.03399294357821017, -1.2620224895592385),
    ("sddkd", (("nckd_weight", 2.0), ("temperature", 1.0)), "[1,2]"): (1.8175945637305624, 2.524565524318932, 0.07968457624552917, -3.0018443150566085),
    ("sddkd", (("nckd_weight", 0.5), ("temperature", 2.0)), "[1,2]"): (0.6846033195870329, 1.0609295177054734, 0.008408077781812455, -1.0659412865599094),
    ("sdnkd", (("temperature", 1.0), ("non_target_weight", 2.0)), "[1,2]"): (6.597708975997603, 2.6690617011119677, 0.13632714787741806, -2.864621563949636),
    ("sdnkd", (("temperature", 2.0), ("non_target_weight", 0.5)), "[1,2]"): (5.641594521505175, 0.9108105059265156, 0.07770948414805695, -1.0931220783479068),
}  # fmt: skip
# the official SPP's cells of the student's map: the "global" cell pooled from the 4x4 map is not the map's mean
OFFICIAL_GLOBAL_CELL_SUM, MAP_MEAN_SUM = -0.38587109494883143, -0.5341939984592764
OFFICIAL_2X2_CELLS_SUM, OFFICIAL_CELL_0_0_5 = -1.5434843797953257, -1.2114328509330758


def inputs():
    """(student map, teacher map, student fc weight and bias, teacher's), in the golden run's order."""
    g = torch.Generator().manual_seed(0)
    d = dict(dtype=torch.float64, generator=g)
    return (torch.randn(3, 4, 7, 7, **d), torch.randn(3, 6, 7, 7, **d), torch.randn(5, 4, **d),
            torch.randn(5, **d), torch.randn(5, 6, **d), torch.randn(5, **d))  # fmt: skip


def scenario(method, hparams):
    s_map, t_map, ws, bs, wt, bt = inputs()
    loss = build_loss(method, 5, hparams).double()
    loss.setup_classifiers("fc", wt, bt)
    head = torch.nn.Linear(4, 5).double()
    head.weight.data, head.bias.data = ws, bs
    s_map.requires_grad_()
    x = DistillInputs(torch.zeros(3, 5, dtype=torch.float64), LABELS, torch.zeros(3, 5, dtype=torch.float64))
    x.student_feats, x.teacher_feats, x.student_classifier = {"m": s_map}, {"m": t_map}, head
    return loss, x, head


@pytest.mark.parametrize("key", list(OFFICIAL), ids=lambda k: f"{k[0]}-{dict(k[1])}-{k[2]}")
def test_equal_to_the_official_code(key):
    method, hparams, m = key
    loss, x, head = scenario(method, {**dict(hparams), "scales": SCALES[m]})
    out = loss(x)
    out["kd"].backward()
    s_map = x.student_feats["m"]
    probe = torch.arange(s_map.numel(), dtype=torch.float64).reshape(s_map.shape).remainder(7) - 3
    wprobe = torch.arange(20, dtype=torch.float64).reshape(5, 4).remainder(3) - 1
    bprobe = torch.arange(5, dtype=torch.float64) - 2
    got = (out["kd"].item(), (s_map.grad * probe).sum().item(), (head.weight.grad * wprobe).sum().item(),
           (head.bias.grad * bprobe).sum().item())  # fmt: skip
    assert got == pytest.approx(OFFICIAL[key], rel=RTOL, abs=1e-12)


def test_the_weighted_total_and_the_defaults():
    loss, x, _ = scenario("sdkd", {})
    assert (loss.hparams["ce_weight"], loss.hparams["kd_weight"], loss.hparams["temperature"]) == (0.1, 0.9, 4.0)
    official = OFFICIAL[("sdkd", (("temperature", 4.0),), "[1,2,4]")][0]
    out = loss(x)
    assert out["kd"].item() == pytest.approx(official, rel=RTOL)
    assert out["loss"].item() == pytest.approx(0.1 * out["ce"].item() + 0.9 * official, rel=1e-7)  # CE in float32


def test_cells_pool_from_the_4x4_grid_as_the_official_code_or_from_the_map():
    s_map = inputs()[0]
    official = cells(s_map, [1, 2, 4], grid=4)
    assert official.shape == (3, 4, 21)
    assert official[:, :, 0].sum().item() == pytest.approx(OFFICIAL_GLOBAL_CELL_SUM, rel=RTOL)
    assert official[:, :, 1:5].sum().item() == pytest.approx(OFFICIAL_2X2_CELLS_SUM, rel=RTOL)
    assert official[0, 0, 5].item() == pytest.approx(OFFICIAL_CELL_0_0_5, rel=RTOL)
    assert cells(s_map, [1, 2, 4], grid=0)[:, :, 0].sum().item() == pytest.approx(MAP_MEAN_SUM, rel=RTOL)


def test_complementary_cells_weigh_double():
    # two samples, three cells each (the global first): the teacher's scores' argmax against the labels
    rows = torch.eye(4)[[2, 2, 0, 1, 1, 3]]  # cell-major: cell 0 of both samples, then cell 1, then cell 2
    # sample 0 (label 2): right globally, wrong at cells 1 and 2; sample 1 (label 3): wrong, wrong, right
    weights = region_weights(rows, torch.tensor([2, 3]), 3, 2.0)
    assert weights.tolist() == [1.0, 1.0, 2.0, 1.0, 2.0, 2.0]


@pytest.mark.parametrize(
    "hparams, match",
    [({"scales": [2, 4]}, "scales"), ({"scales": [1, 1]}, "scales"), ({"scales": 4}, "scales"),
     ({"grid": 2}, "grid"), ({"grid": -1}, "grid")],
)  # fmt: skip
def test_bad_scales_are_refused(hparams, match):
    with pytest.raises(KDError, match=match):
        build_loss("sdkd", 10, hparams)


def test_soft_labels_are_refused():
    loss, x, _ = scenario("sddkd", {})
    x.labels = torch.full((3, 5), 0.2, dtype=torch.float64)
    with pytest.raises(KDError, match="class-index labels"):
        loss(x)


def engine_cfg(student, teacher, **more):
    return SimpleNamespace(feature_layers=None, student=student, teacher=teacher, image_size=32, **more)


def test_the_engine_gives_each_sides_final_map_and_classifier():
    from kd import models
    from kd.run.build import setup_feature_layers

    loss = build_loss("sdkd", 10, {})
    student, teacher = models.build("timm:test_resnet", 10), models.build("resnet18", 10)
    keys = setup_feature_layers(loss, student, teacher, engine_cfg("timm:test_resnet", "resnet18"))
    assert keys == (["global_pool<1"], ["avgpool<1"]) and loss.student_head == "fc"
    assert torch.equal(loss.teacher_weight, teacher.fc.weight) and torch.equal(loss.teacher_bias, teacher.fc.bias)
    assert "teacher_weight" not in loss.state_dict()  # copied at every start, not checkpointed


@pytest.mark.parametrize("name", ["timm:test_vit", "mobilenet_v2", "timm:mobilenetv3_small_050"])
def test_a_model_without_a_final_map_and_linear_classifier_is_refused_in_one_line(name):
    from kd import models
    from kd.run.build import setup_feature_layers

    loss = build_loss("sdnkd", 10, {})
    teacher = models.build("timm:test_resnet", 10)
    with pytest.raises(KDError, match=f"needs student {name}'s final feature map and a linear classifier") as e:
        setup_feature_layers(loss, models.build(name, 10), teacher, engine_cfg(name, "timm:test_resnet"))
    assert "\n" not in str(e.value)


def test_the_students_own_classifier_is_trained_by_the_cell_scores():
    from kd import models
    from kd.data.loader import Batch
    from kd.run.build import setup_feature_layers
    from kd.run.record import step_inputs
    from kd.run.sides import StudentSide
    from kd.teacher.source import Targets
    from kd.utils.taps import tap

    loss = build_loss("sddkd", 10, {"ce_weight": 0.0})
    torch.manual_seed(0)
    student, teacher = models.build("timm:test_resnet", 10), models.build("timm:test_resnet", 10)
    s_keys, t_keys = setup_feature_layers(loss, student, teacher, engine_cfg("timm:test_resnet", "timm:test_resnet"))
    images, labels = torch.randn(2, 3, 32, 32), torch.tensor([1, 7])
    feats = {}
    with torch.no_grad(), tap(teacher, t_keys, feats):
        teacher_logits = teacher(images)
    inputs = step_inputs(Batch(images, labels), Targets(teacher_logits, feats), loss, t_keys, lambda t: t, 0.0, 0)
    parts = StudentSide(student, loss, s_keys)(inputs)
    parts["loss"].backward()  # the distillation part alone: the classifier's gradient comes from the cells
    assert student.fc.weight.grad is not None and student.fc.weight.grad.abs().sum() > 0
