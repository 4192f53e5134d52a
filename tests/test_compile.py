"""torch.compile of a step (kd.run.sides, kd.teacher.frozen, kd.utils.taps): each method's student side
and the teacher side trace as one graph, taps included, and the compiled step equals the eager one.

A side that registers its feature hooks inside the forward (kd before taps were registered once) made
torch.compile give the whole forward back to eager without a word: ``--compile`` did nothing for AT,
FitNet, OFD, CRD, ReviewKD, SDD and CRLD; NKD's boolean-mask selection broke the graph as well.
Dynamo alone (no code generation) finds both; the equality runs AOT autograd's graphs of the forward
and backward (``aot_eager``: what inductor compiles, without the minute of C++ it takes on the CPU;
inductor itself: tests/test_train.py's compiled run).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from conftest import TEST_RESNET_PAIR, in_process_trainer, tiny_config
from torch._dynamo.backends.debugging import aot_eager

from kd import config as kd_config
from kd.data.loader import Batch
from kd.losses import LOSSES, DistillInputs, DistillLoss, MethodCard, build_loss
from kd.run.build import build_models
from kd.run.record import step_inputs
from kd.run.sides import StudentSide
from kd.teacher.frozen import TeacherSide
from kd.teacher.fuse import fuse_teacher
from kd.teacher.source import Targets

CLASSES, BATCH = 3, 4


def step_of(method: str):
    """(student side, teacher side, the step's inputs) of ``method`` on two tiny ResNets, built as kd
    train builds them."""
    options = dict(TEST_RESNET_PAIR, kd_loss=method, image_size=32, batch_size=BATCH, device="cpu", data="synthetic")
    cfg = kd_config.resolve(options=options)
    student, loss, teacher, s_layers, t_layers = build_models(cfg, CLASSES)
    if loss.card.uses_samples:
        loss.setup_samples(torch.arange(16) % CLASSES, 0, lambda t: t)
    g = torch.Generator().manual_seed(3)
    views = [torch.randn(BATCH, 3, 32, 32, generator=g) for _ in range(loss.card.views)]
    batch = Batch(views[0], torch.tensor([0, 2, 1, 0]), indices=torch.tensor([5, 1, 7, 3]))
    batch.second_images = views[1] if len(views) > 1 else None
    teacher_side = TeacherSide(teacher, t_layers)
    with torch.no_grad():
        logits, feats = teacher_side(batch.images)
        second = teacher_side(batch.second_images)[0] if batch.second_images is not None else None
    inputs = step_inputs(batch, Targets(logits, feats, second), loss, t_layers, lambda x: x, 0.5, 3)
    return StudentSide(student, loss, s_layers), teacher_side, inputs


def logit_inputs(card) -> DistillInputs:
    """A step's inputs for a method that reads logits only (both views' where it has two, both heads'
    where it reads a distillation head)."""
    g = torch.Generator().manual_seed(4)

    def logits(grad: bool = False):
        return torch.randn(BATCH, CLASSES, generator=g).requires_grad_(grad)

    two = card.views == 2
    return DistillInputs(
        student_logits=logits(True),
        labels=torch.tensor([0, 2, 1, 0]),
        teacher_logits=logits() if card.needs_teacher else None,
        second_student_logits=logits(True) if two else None,
        second_teacher_logits=logits() if two else None,
        distill_logits=logits(True) if card.reads_distill_head else None,
        progress=0.5,
        step=3,
    )


def traced(module, *args, backend="eager"):
    """The graphs torch.compile traced of ``module(*args)`` (compiled with ``backend`` after them)
    and its output: a forward dynamo gives back to eager whole traces none."""
    graphs = []

    def record(gm, example):
        graphs.append(gm)
        return gm.forward if backend == "eager" else aot_eager(gm, example)

    torch._dynamo.reset()
    out = torch.compile(module, backend=record)(*args)
    return graphs, out


def outputs(graph) -> int:
    (node,) = [node for node in graph.graph.nodes if node.op == "output"]
    return len(node.args[0])


LOGIT_ONLY = [m for m in LOSSES.names() if not (LOSSES.card(m).uses_features or LOSSES.card(m).uses_classifier)]


@pytest.mark.parametrize("method", LOGIT_ONLY)
def test_each_logit_methods_loss_compiles_as_one_graph(method):
    """The feature methods' sides, taps included: the equality test below."""
    loss = build_loss(method, CLASSES, {})
    assert len(traced(loss, logit_inputs(loss.card))[0]) == 1


def test_the_teacher_side_compiles_as_one_graph_with_its_taps():
    """Output taps (AT's stages) and input taps of an in-place ReLU's call (OFD's pre-ReLU sums), by
    hooks or returned by the fused teacher (kd.teacher.fuse): one graph whose outputs are the logits
    and every tapped tensor, equal to the unfused teacher's in eager."""
    for method in ("at", "ofd"):
        _, teacher, inputs = step_of(method)
        fused_model = fuse_teacher(copy.deepcopy(teacher.teacher), taps=teacher.layers)[0]
        fused = TeacherSide(copy.deepcopy(fused_model), teacher.layers)  # as the teacher's precision copies it
        assert fused.returns_taps and not teacher.returns_taps
        with torch.no_grad():
            logits, feats = teacher(inputs.images)
            for side in (teacher, fused):
                graphs, (got, got_feats) = traced(side, inputs.images)
                assert len(graphs) == 1 and outputs(graphs[0]) == 1 + len(teacher.layers) == 5, method
                torch.testing.assert_close(got, logits, rtol=1e-4, atol=1e-4)
                assert list(got_feats) == teacher.layers
                for key in feats:
                    torch.testing.assert_close(got_feats[key], feats[key], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["at", "ofd", "crd", "reviewkd", "sdnkd"])
def test_the_compiled_step_equals_the_eager_one(method):
    """The student side in one graph, taps included; its loss parts and every trained parameter's
    gradient, compiled against eager, on the same inputs from the same weights (float32 on the CPU:
    equal to rounding)."""
    side, _, inputs = step_of(method)
    twin = copy.deepcopy(side)
    results = []
    for compiled in (False, True):
        if compiled:
            graphs, parts = traced(twin, inputs, backend="aot_eager")
            assert len(graphs) == 1
        else:
            parts = side(inputs)
        parts["loss"].backward()
        params = twin if compiled else side
        grads = {n: p.grad for n, p in params.named_parameters() if p.requires_grad}
        results.append(({k: v.detach() for k, v in parts.items()}, grads))
    (eager, eager_grads), (got, got_grads) = results
    assert eager.keys() == got.keys() and eager_grads.keys() == got_grads.keys()
    for key in eager:
        torch.testing.assert_close(got[key], eager[key], rtol=1e-5, atol=1e-6)
    assert any(g is not None and bool(g.abs().sum() > 0) for g in eager_grads.values())
    for name in eager_grads:
        if eager_grads[name] is None:
            assert got_grads[name] is None, name
        else:
            torch.testing.assert_close(got_grads[name], eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)


class Untouchable(float):
    """A number any arithmetic, comparison or conversion of refuses: stored, it is never read."""

    def _refuse(self, *args, **kwargs):
        raise AssertionError("read a number its card does not say it reads")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __floordiv__ = __rfloordiv__ = __mod__ = __pow__ = __neg__ = __floor__ = __ceil__ = __round__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = __float__ = __int__ = __bool__ = _refuse
    __hash__ = float.__hash__


class UntouchableStep(int):
    _refuse = Untouchable._refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __xor__ = __rxor__ = __mod__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = __float__ = __int__ = __index__ = __bool__ = _refuse
    __hash__ = int.__hash__


@pytest.mark.parametrize("method", [m for m in LOSSES.names() if m != "ce"])
def test_a_method_reads_the_progress_and_the_step_only_where_its_card_says(method):
    """The record hands the progress and the step only to the methods whose card says they read them
    (kd.run.record.step_inputs), so a compiled step of any other does not depend on them; a method
    that read them without saying so would train with 0.0 and 0 for them."""
    card = LOSSES.card(method)
    given = dict(
        progress=1.5 if card.reads_progress else Untouchable(), step=7 if card.reads_step else UntouchableStep()
    )
    if method in LOGIT_ONLY:
        x = logit_inputs(card)
        x.progress, x.step = given["progress"], given["step"]
        build_loss(method, CLASSES, {})(x)
    else:
        side, _, inputs = step_of(method)
        side(inputs._replace(loss_inputs={**inputs.loss_inputs, **given}))


@pytest.mark.parametrize("method", [m for m in LOSSES.names() if LOSSES.card(m).reads_progress])
def test_a_method_whose_card_says_it_reads_the_progress_does(method):
    """The other way round: a card that says it reads the progress is handed it (and its compiled step
    depends on it) only where the method reads it: its loss or a logged term changes with the epoch."""
    outputs = []
    for progress in (0, 50):
        if method in LOGIT_ONLY:
            x = logit_inputs(LOSSES.card(method))
            x.progress = progress
            loss = build_loss(method, CLASSES, {})
            loss.hparams.update({"warmup": 5.0} if "warmup" in loss.hparams else {})  # a ramp over epochs 1-5
            out = loss(x)
        else:
            side, _, inputs = step_of(method)
            side.loss.hparams.update({"warmup": 5.0} if "warmup" in side.loss.hparams else {})
            out = side(inputs._replace(loss_inputs={**inputs.loss_inputs, "progress": progress}))
        outputs.append({k: v.detach() for k, v in out.items()})
    assert any(not torch.equal(outputs[0][k], outputs[1][k]) for k in outputs[0]), method


def test_a_step_compiles_once_whatever_its_progress_and_step():
    """Each step's record differs in its progress and step: KD's compiled step, which reads neither,
    is one graph over several steps (it was two: a second compilation at the second step)."""
    side, _, inputs = step_of("kd")
    graphs = []

    def record(gm, _example):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(side, backend=record)
    for step in range(3):
        batch = Batch(inputs.images, inputs.loss_inputs["labels"])
        targets = Targets(inputs.loss_inputs["teacher_logits"], {})
        compiled(step_inputs(batch, targets, side.loss, [], lambda x: x, 0.37 * step, step))
    assert len(graphs) == 1


@pytest.mark.parametrize("method", ["dkd", "ctkd"])
def test_a_step_that_reads_the_progress_compiles_once_across_epochs(method):
    """DKD's warm-up and CTKD's curriculum read the epoch: their compiled step is one graph over steps of
    two epochs and past the warm-up's end (it was two: the progress, a float, was specialised at the first
    step, then compiled symbolic at the second), and gives the loss eager gives."""
    from kd.run.record import compile_numbers_dynamic

    side, _, inputs = step_of(method)
    side.loss.hparams["warmup"] = 3.0  # DKD's ramp (1/3, 2/3, 1 over the epochs below) ends within the steps
    graphs = []

    def record(gm, _example):
        graphs.append(gm)
        return gm.forward

    if not hasattr(torch.compiler.config, "dynamic_sources"):
        pytest.skip("this torch has no torch.compiler.config.dynamic_sources: a reader's step compiles twice")
    torch._dynamo.reset()
    given = torch.compiler.config.dynamic_sources
    torch.compiler.config.dynamic_sources = ""  # as a fresh process has it; restored after
    try:
        compile_numbers_dynamic()
        compiled = torch.compile(side, backend=record)
        for step in range(6):
            batch = Batch(inputs.images, inputs.loss_inputs["labels"])
            targets = Targets(inputs.loss_inputs["teacher_logits"], {})
            record_ = step_inputs(batch, targets, side.loss, [], lambda x: x, 0.45 * step, step)
            torch.testing.assert_close(compiled(record_)["loss"], side(record_)["loss"])
    finally:
        torch.compiler.config.dynamic_sources = given
    assert len(graphs) == 1


def test_a_graph_break_is_said_in_one_line_with_dynamos_reason():
    """A step torch.compile cuts into graphs (here a host read, ``.item()``) runs the code between them
    eager: the first step's log says so in one line, with dynamo's reason, counted from the run's start."""
    from kd.run.log import graph_break_note, graph_breaks

    def step(x):
        y = x * 2
        return y + 1 if y.sum().item() > 0 else y - 1

    torch._dynamo.reset()
    before = graph_breaks()
    torch.compile(step, backend="eager")(torch.ones(4))
    broken = graph_breaks()
    broken.subtract(before)
    note = graph_break_note(+broken)
    assert note.startswith("torch.compile: 1 graph break(s) in the first step, the code between the graphs ran eager: ")
    assert "Tensor.item()" in note and "\n" not in note and note.endswith("(TORCH_LOGS=graph_breaks says where)")


class HostRead(DistillLoss):
    """Cross-entropy read back by the host inside the step (a graph break). Not registered."""

    card = MethodCard(needs_teacher=False)
    name = "host_read"

    def forward(self, x: DistillInputs):
        ce = torch.nn.functional.cross_entropy(x.student_logits.float(), x.labels)
        return {"loss": ce * 1.0 if ce.item() > -1 else ce}


def test_a_run_whose_step_breaks_says_so_once(image_folder, tmp_path, monkeypatch, capsys):
    """The run's own path: the first step's log names the break (dynamo's eager backend stands in for
    inductor, the same graphs without their kernels)."""
    import kd.run.build

    monkeypatch.setattr(kd.run.build, "build_loss", lambda name, num_classes, args: HostRead(num_classes))
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, mode=None: compile_(model, backend="eager"))
    torch._dynamo.reset()
    cfg = tiny_config(image_folder, tmp_path / "run", no_teacher=True, compile=True, limit_train_batches=2)
    trainer = in_process_trainer(cfg)
    trainer.fit()
    trainer.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if "graph break" in line]
    assert len(lines) == 1 and " graph break(s) in the first step" in lines[0] and "Tensor.item()" in lines[0]


def on(device: str, inputs):
    """A step's record with its tensors (and those of its dicts) on ``device``."""

    def move(v):
        if isinstance(v, torch.Tensor):
            return v.to(device)
        return {k: move(x) for k, x in v.items()} if isinstance(v, dict) else v

    return inputs._replace(images=move(inputs.images), loss_inputs=move(inputs.loss_inputs))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["at", "ofd", "crd", "reviewkd", "sdkd"])
def test_on_cuda_inductors_step_equals_the_eager_one(method, monkeypatch):
    """The feature methods compiled by inductor (Triton kernels) on the GPU, in float32: the loss and
    every gradient as eager computes them, to float32 rounding. TensorFloat-32 off: with it (cuDNN's
    default), eager and compiled convolutions of other layouts or algorithms round their inputs to 10-bit
    mantissas apart, and AT's and ReviewKD's first-layer gradients differed by more than 1e-3. Each
    gradient is held to 1e-3 of its largest element: ReviewKD's first-layer gradient sums every path of the
    step in another order (and its atomic adds vary from run to run): 23 of its 432 elements were 2.2e-4
    apart with TensorFloat-32 off, outside a fixed 1e-5."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    side, _, inputs = step_of(method)
    side, inputs = side.cuda(), on("cuda", inputs)
    twin = copy.deepcopy(side)
    torch._dynamo.reset()
    eager = side(inputs)
    eager["loss"].backward()
    got = torch.compile(twin)(inputs)
    got["loss"].backward()
    torch.testing.assert_close(got["loss"], eager["loss"], rtol=1e-4, atol=1e-5)
    for (name, a), b in zip(side.named_parameters(), twin.parameters()):
        if a.grad is not None:
            scale = float(a.grad.abs().max())
            torch.testing.assert_close(
                b.grad, a.grad, rtol=1e-3, atol=max(1e-5, 1e-3 * scale), msg=lambda m, name=name: f"{name}: {m}"
            )
