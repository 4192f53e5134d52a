"""CRD against the official code (golden values), its negatives, its memory over several processes and
its state.

Golden values: HobbitLong/RepDistiller@b84f547 ``crd/criterion.py`` and ``crd/memory.py`` (mdistiller's
copy is the same), run on the CPU in float64 (``.cuda()`` of the unused sampler removed) on the
scenario below: the official ``CRDLoss`` called twice with the given contrast indices, its random
memory overwritten with ``fill`` values. The numbers are that run's, printed in full precision.
"""

from __future__ import annotations

import os
import socket
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kd.errors import KDError
from kd.losses import DistillInputs, build_loss

N_DATA, FEAT_DIM, S_DIM, T_DIM, NEGATIVES, BATCH = 12, 4, 5, 6, 5, 3
IDX = [2, 7, 10]
CONTRAST = [[2, 0, 5, 11, 3, 4], [7, 1, 2, 9, 9, 0], [10, 6, 8, 1, 3, 5]]
IDX2 = [0, 7, 4]
CONTRAST2 = [[0, 3, 3, 8, 11, 1], [7, 2, 4, 10, 0, 6], [4, 9, 1, 2, 5, 11]]

STEP1 = dict(
    loss=6.1431731440449635,
    s_loss=3.3628811259617826,
    t_loss=2.780292018083181,
    z=(44.085559805550616, 21.357838273141702),
    grad_embed_s_weight=[
        [-0.11382354689243093, -0.21758286584489994, -0.29189336463262844, -0.3266974658510054, -0.3172845976735435],
        [
            0.023357565423603812,
            0.01178090103998078,
            -0.0013902530326988416,
            -0.014373242879374257,
            -0.025410881730256896,
        ],
        [-0.002664535794188451, 0.054297288734304686, 0.1039102299527057, 0.139459409011933, 0.15613341129505778],
        [-0.1133184639621705, 0.318300587536189, 0.7068391477270836, 0.9997103452054578, 1.1572754373135101],
    ],
    grad_embed_t_weight=[
        [
            -0.9634306041416696,
            -0.9939497093731463,
            -0.88994238426984,
            -0.6654855323640645,
            -0.35095833558657386,
            0.011069425492580047,
        ],
        [
            -0.846347163190433,
            -0.8797037932508281,
            -0.7939966417717753,
            -0.6008257696355415,
            -0.3263359481802386,
            -0.007678087049879069,
        ],
        [
            -0.3367881838127913,
            -0.3317568261698594,
            -0.2818237384464638,
            -0.19374712981926234,
            -0.07944775607989749,
            0.04560449873860945,
        ],
        [
            0.01431570021899712,
            0.0394599614332727,
            0.05926350198260214,
            0.07104600555624227,
            0.0732127655697236,
            0.06547052121995242,
        ],
    ],
    memory_student=[
        [0.1970959796156367, 0.2655447783137815, 0.29805333699402475, 0.29022177474353844],
        [0.24311005677340644, 0.1630945330998265, 0.061004929482227195, -0.04934140515373062],
        [-0.5449582811378548, -0.7426478532350648, 0.3489832825635455, -0.17235227412423887],
        [-0.27085731694405496, -0.20588586122802716, -0.11304872004902247, -0.004910964946902409],
        [0.10389146622240239, 0.19863267481540528, 0.26648988270014473, 0.2982789351219734],
        [0.2896973329647832, 0.2419065558224345, 0.16137486118447317, 0.05900183612889019],
        [-0.05135681065661231, -0.1547645540454328, -0.23722564107754696, -0.2875793504656066],
        [0.2803151349122533, -0.23522206919346958, -0.9238878299220716, 0.11191640194963912],
        [-0.002866732831574216, 0.10580694304425906, 0.20016014554185915, 0.26742261133406],
        [0.29849068121837735, 0.28915943768287355, 0.24069182076523601, 0.1596476950433992],
        [0.23157754442668993, 0.45983157971747374, -0.6953608897365493, -0.5013980377271448],
        [-0.2881548409058095, -0.29883769625956025, -0.2690742713355869, -0.2028929060708108],
    ],
    memory_teacher=[
        [0.2968074739870145, 0.26093720710535995, 0.18975031335376988, 0.09288160484870746],
        [-0.016558193145322354, -0.12375691737512781, -0.21420572340815416, -0.2756627896623621],
        [-0.8078767795284704, 0.1398529877786777, -0.062177025583598645, -0.5691311521939921],
        [-0.037810360867001784, 0.07236792396773044, 0.17275154978670915, 0.2497540637562119],
        [0.2929535368455892, 0.29650312303008386, 0.2599224024714858, 0.18816240408948334],
        [0.09093550702371067, -0.018599084319973154, -0.12561637685319793, -0.21563208207240472],
        [-0.27646299655893813, -0.29987594140776513, -0.28270208436868677, -0.22726582642573584],
        [0.2352997704437192, -0.7298025550888583, 0.5537523090383085, 0.32462382668197454],
        [0.25088086725208886, 0.29338722731904543, 0.29618500251007085, 0.25889552707801655],
        [0.18656575658977373, 0.08898518616663487, -0.02063911175578071, -0.12747000272449951],
        [-0.2845634872314151, 0.3511145067735318, -0.8908197186992388, -0.046716738375929975],
        [-0.2259260234829382, -0.1392626680413324, -0.0337507637910405, 0.07632914800637833],
    ],
)
STEP2 = dict(
    loss=15.941031361536092,
    memory_student=[
        [0.725534547525818, 0.13289920568100727, -0.38802427813122653, 0.552607076553137],
        [0.24311005677340644, 0.1630945330998265, 0.061004929482227195, -0.04934140515373062],
        [-0.5449582811378548, -0.7426478532350648, 0.3489832825635455, -0.17235227412423887],
        [-0.27085731694405496, -0.20588586122802716, -0.11304872004902247, -0.004910964946902409],
        [-0.45069484141788446, -0.15423906389176667, 0.8665197504455011, 0.1490905536141246],
        [0.2896973329647832, 0.2419065558224345, 0.16137486118447317, 0.05900183612889019],
        [-0.05135681065661231, -0.1547645540454328, -0.23722564107754696, -0.2875793504656066],
        [0.31251234876453765, 0.19534285530302115, -0.9226717835019527, -0.11337539715943935],
        [-0.002866732831574216, 0.10580694304425906, 0.20016014554185915, 0.26742261133406],
        [0.29849068121837735, 0.28915943768287355, 0.24069182076523601, 0.1596476950433992],
        [0.23157754442668993, 0.45983157971747374, -0.6953608897365493, -0.5013980377271448],
        [-0.2881548409058095, -0.29883769625956025, -0.2690742713355869, -0.2028929060708108],
    ],
    memory_teacher=[
        [0.48359171006735563, -0.4205938230487394, 0.7640614839574793, 0.07382372721605976],
        [-0.016558193145322354, -0.12375691737512781, -0.21420572340815416, -0.2756627896623621],
        [-0.8078767795284704, 0.1398529877786777, -0.062177025583598645, -0.5691311521939921],
        [-0.037810360867001784, 0.07236792396773044, 0.17275154978670915, 0.2497540637562119],
        [-0.3696338260999753, 0.8408428362088467, 0.26367234278064317, -0.29467109639651223],
        [0.09093550702371067, -0.018599084319973154, -0.12561637685319793, -0.21563208207240472],
        [-0.27646299655893813, -0.29987594140776513, -0.28270208436868677, -0.22726582642573584],
        [0.4284065481544142, -0.27729700899378096, -0.17541834181909516, 0.8419041534848024],
        [0.25088086725208886, 0.29338722731904543, 0.29618500251007085, 0.25889552707801655],
        [0.18656575658977373, 0.08898518616663487, -0.02063911175578071, -0.12747000272449951],
        [-0.2845634872314151, 0.3511145067735318, -0.8908197186992388, -0.046716738375929975],
        [-0.2259260234829382, -0.1392626680413324, -0.0337507637910405, 0.07632914800637833],
    ],
)


def fill(shape, seed, scale=1.0):
    n = 1
    for s in shape:
        n *= s
    return (torch.sin(torch.arange(n, dtype=torch.float64) * 0.37 + seed) * scale).reshape(shape)


def crd64(labels=None):
    """kd's CRD in float64 with the scenario's parameters and memory."""
    loss = build_loss("crd", 3, {"feat_dim": FEAT_DIM, "negatives": NEGATIVES, "ce_weight": 0.0, "crd_weight": 1.0})
    loss.setup_features({"fc<1": torch.Size([2, S_DIM])}, {"fc<1": torch.Size([2, T_DIM])})
    labels = torch.arange(N_DATA) % 3 if labels is None else labels
    loss.setup_samples(labels, 0, lambda t: t)
    loss.double()
    with torch.no_grad():
        loss.embed_student.linear.weight.copy_(fill((4, 5), 3.0, 0.5))
        loss.embed_student.linear.bias.copy_(fill((4,), 4.0, 0.1))
        loss.embed_teacher.linear.weight.copy_(fill((4, 6), 5.0, 0.5))
        loss.embed_teacher.linear.bias.copy_(fill((4,), 6.0, 0.1))
    loss.shared["memory"] = torch.stack([fill((12, 4), 7.0, 0.3), fill((12, 4), 8.0, 0.3)])
    return loss


def inputs(f_s, f_t, idx, step=0):
    return DistillInputs(
        student_logits=torch.zeros(len(idx), 3, dtype=torch.float64),
        labels=torch.zeros(len(idx), dtype=torch.long),
        teacher_logits=torch.zeros(len(idx), 3, dtype=torch.float64),
        student_feats={"fc<1": f_s},
        teacher_feats={"fc<1": f_t},
        indices=torch.tensor(idx),
        step=step,
    )


def close(a, b, rtol=1e-10):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), rtol=rtol, atol=1e-12
    )


def test_crd_equals_the_official_code_over_two_steps():
    loss = crd64()
    contrasts = iter([torch.tensor(CONTRAST), torch.tensor(CONTRAST2)])
    loss.contrast_indices = lambda indices, step: next(contrasts)  # the official run's draws
    out = loss(inputs(fill((3, 5), 1.0), fill((3, 6), 2.0), IDX))
    out["loss"].backward()
    close(out["crd"], STEP1["loss"])
    close(loss.shared["z"], STEP1["z"])
    close(loss.embed_student.linear.weight.grad, STEP1["grad_embed_s_weight"])
    close(loss.embed_teacher.linear.weight.grad, STEP1["grad_embed_t_weight"])
    loss.after_step()
    close(loss.shared["memory"][0], STEP1["memory_student"])
    close(loss.shared["memory"][1], STEP1["memory_teacher"])
    out = loss(inputs(fill((3, 5), 9.0), fill((3, 6), 10.0), IDX2, step=1))
    loss.after_step()
    close(out["crd"], STEP2["loss"])
    close(loss.shared["z"], STEP1["z"])  # fixed at the first step
    close(loss.shared["memory"][0], STEP2["memory_student"])
    close(loss.shared["memory"][1], STEP2["memory_teacher"])


def test_negatives_are_other_classes_drawn_evenly_and_fixed_by_sample_and_step():
    labels = torch.tensor([0] * 30 + [1] * 50 + [2] * 20)
    loss = build_loss("crd", 3, {"negatives": 4000})
    loss.setup_features({"p": torch.Size([2, 5])}, {"p": torch.Size([2, 6])})
    # more negatives than the 50 samples outside class 1: said, with what draws fewer
    assert loss.setup_samples(labels, 7, lambda t: t) == (
        "crd: 4,000 negatives a sample from 50 samples of other classes (the fewest of a class): drawn with "
        "replacement, so each recurs; --loss-arg negatives=N draws fewer"
    )
    assert build_loss("crd", 3, {"negatives": 50}).setup_samples(labels, 7, lambda t: t) is None
    idx = torch.tensor([3, 40, 95])
    drawn = loss.contrast_indices(idx, step=5)
    assert drawn.shape == (3, 4001) and drawn[:, 0].tolist() == idx.tolist()
    for row, i in zip(drawn, idx):
        negatives = row[1:]
        assert not (labels[negatives] == labels[i]).any()
        others = (labels != labels[i]).nonzero().flatten()
        counts = torch.bincount(negatives, minlength=100)[others].double()
        expected = 4000 / len(others)
        assert ((counts - expected).abs() < 5 * expected**0.5).all()  # every other sample, evenly (5 sigma)
    # a sample's draws depend on the seed, the step and its index only: not on its batch or place in it
    again = loss.contrast_indices(torch.tensor([95, 3]), step=5)
    assert torch.equal(again[0], drawn[2]) and torch.equal(again[1], drawn[0])
    assert not torch.equal(loss.contrast_indices(idx, step=6), drawn)


def test_crd_needs_two_classes_and_the_pooled_feature_only():
    loss = build_loss("crd", 3, {})
    with pytest.raises(KDError, match="two classes or more"):
        loss.setup_samples(torch.zeros(5, dtype=torch.long), 0, lambda t: t)
    with pytest.raises(KDError, match="leave out --feature-layers"):
        loss.setup_features(
            {"a": torch.Size([2, 3, 4, 4]), "b": torch.Size([2, 5])},
            {"a": torch.Size([2, 3, 4, 4]), "b": torch.Size([2, 5])},
        )


def test_memory_and_z_travel_in_the_state_dict():
    loss = crd64()
    loss(inputs(fill((3, 5), 1.0), fill((3, 6), 2.0), IDX))
    loss.after_step()
    state = loss.state_dict()
    fresh = crd64()
    assert fresh.shared["z"] is None
    fresh.load_state_dict(state)
    assert torch.equal(fresh.shared["memory"], loss.shared["memory"])
    assert torch.equal(fresh.shared["z"], loss.shared["z"])
    small = build_loss("crd", 3, {"feat_dim": FEAT_DIM})
    small.setup_features({"p": torch.Size([2, 5])}, {"p": torch.Size([2, 6])})
    small.setup_samples(torch.arange(6) % 2, 0, lambda t: t)
    with pytest.raises(KDError, match="holds 12 samples, this training set 6"):
        small.load_state_dict(state)


def test_the_memory_moves_to_the_device_last():
    """DataParallel's replicas share the banks; a replica that finds the memory on the device takes every
    other shared tensor to be there too, so the memory is the last to move (it marks the move done)."""
    rest = ("labels", "order", "counts", "starts", "draw_keys")

    class Watched(dict):
        def __setitem__(self, key, value):
            if key == "memory" and value.device.type == "meta":
                behind = [k for k in rest if self[k].device.type != "meta"]
                assert not behind, f"the memory moved before {behind}"
            super().__setitem__(key, value)

    loss = crd64()
    loss.shared = Watched(loss.shared)
    assert loss._on(torch.device("meta")).type == "meta"
    assert all(loss.shared[k].device.type == "meta" for k in ("memory", *rest))


def test_a_non_finite_embedding_leaves_its_memory_row():
    loss = crd64()
    before = loss.shared["memory"].clone()
    f_s = fill((3, 5), 1.0)
    f_s[1] = float("nan")
    loss(inputs(f_s, fill((3, 6), 2.0), IDX))
    loss.after_step()
    assert torch.equal(loss.shared["memory"][0][7], before[0][7])
    assert not torch.equal(loss.shared["memory"][0][2], before[0][2])
    assert torch.isfinite(loss.shared["memory"]).all()


# ------------------------------------------------------------------ two real processes (gloo)
GLOBAL_IDX = [2, 7, 10, 4, 0, 9]


def _step_results(loss, f_s, f_t, idx, steps=3):
    """Loss, embedding-head gradients, Z and memory over a few steps of the same features."""
    losses, grads = [], []
    for step in range(steps):
        for p in loss.parameters():
            p.grad = None
        out = loss(inputs(f_s + step, f_t - step, idx, step))
        out["loss"].backward()
        losses.append(out["crd"].detach())
        grads.append(loss.embed_student.linear.weight.grad.clone())
        loss.after_step()
    return torch.stack(losses), torch.stack(grads), loss.shared["z"], loss.shared["memory"]


def _rank(rank: int, port: int, out: str):
    from backends.process_group import ProcessGroupBackend

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        backend = types.SimpleNamespace(rank=rank, world_size=2)
        loss = crd64()
        loss.gather = lambda t: ProcessGroupBackend.all_gather(backend, t)
        f_s, f_t = fill((6, 5), 1.0), fill((6, 6), 2.0)
        mine = slice(3 * rank, 3 * rank + 3)
        losses, grads, z, memory = _step_results(loss, f_s[mine], f_t[mine], GLOBAL_IDX[mine])
        for g in grads:  # what DDP does with the gradients: their mean over the processes
            dist.all_reduce(g)
            g /= 2
        dist.all_reduce(losses)
        torch.save({"loss": losses / 2, "grad": grads, "z": z, "memory": memory}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_processes_equal_one_process_of_the_same_global_batch(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.get_context("spawn").Process  # noqa: B018  (spawn: a fresh interpreter per rank)
    mp.start_processes(_rank, args=(port, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    losses, grads, z, memory = _step_results(crd64(), fill((6, 5), 1.0), fill((6, 6), 2.0), GLOBAL_IDX)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        close(got["loss"], losses)
        close(got["grad"], grads)
        close(got["z"], z)
        close(got["memory"], memory)
