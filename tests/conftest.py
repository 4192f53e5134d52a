"""Shared fixtures: small real JPEG ImageFolders, and two runners for the kd command line: in a
fresh interpreter (``run_kd``), where the process itself is under test (signals, launchers, exit
codes of the console script), and in this one (``kd_main``), where a fresh interpreter adds only
its start-up time."""

from __future__ import annotations

import collections
import contextlib
import io
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent


def make_image_folder(
    root: Path, classes: int = 3, train_per_class: int = 8, val_per_class: int = 4, size=(40, 32), seed: int = 0
) -> Path:
    """ImageNet layout with learnable JPEGs: each class has its own colour and stripe direction."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"class_{c:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                w, h = size
                base = np.zeros((h, w, 3), dtype=np.float32)
                base[..., c % 3] = 180
                stripes = (np.arange(w if c % 2 else h) // 4 % 2) * 60
                base += stripes[None, :, None] if c % 2 else stripes[:, None, None]
                base += rng.normal(0, 20, size=base.shape)
                Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).save(folder / f"{i:03d}.jpg", quality=90)
    return root


# One thread per pytest-xdist worker and per process it starts: N workers on N cores, none
# spinning in OpenMP while another process holds its core. Alone, two.
THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
if THREADS == 1:
    os.environ["OMP_NUM_THREADS"] = "1"
    # Loader workers at kd's default nice +10 would wait behind another test's training on the
    # same cores, a contention no real run has (test_loader checks the default itself).
    os.environ.setdefault("KD_WORKER_NICE", "0")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (the README's ``-n auto --dist loadfile``: a file's tests, and the runs
    its module fixtures train once for them, stay on one worker) the files with the most tests
    in real processes (``slow``) go first, so that the workers finish together instead of one
    waiting on a long file started last."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow = collections.Counter(item.module.__name__ for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.module.__name__])  # stable: a file's tests keep their order


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("data"))


#: The one time limit of the tests: a guard against a hang, far above the slowest honest run on a
#: loaded 2-core machine (a verdict never depends on the machine's speed). KD_TEST_HANG_GUARD
#: (seconds) changes it.
HANG_GUARD = float(os.environ.get("KD_TEST_HANG_GUARD", 1800))


#: a tiny teacher and student pair (timm's resnet10t at 32 px, batch 4) for runs in real processes
#: what a run with loader workers must not print: their errors, and a traceback of any kind
WORKER_ERRORS = ("can only test a child process", "can only join a child process", "Traceback", "daemonic")
TINY_PAIR = ["--teacher", "timm:resnet10t", "--teacher-weights", "none", "--student", "timm:resnet10t"]
TINY_PAIR += ["--image-size", "32", "-b", "4"]

#: timm's own test model (0.4 M parameters; BatchNorm and a ReLU after each residual sum, as resnet18): for
#: runs whose outcome does not depend on the model's size, where resnet18's checkpoints cost more than its training
TEST_RESNET = "timm:test_resnet"
#: :data:`TEST_RESNET` teaching itself from random weights, as options of the run config (:func:`cli_options`)
TEST_RESNET_PAIR = dict(teacher=TEST_RESNET, teacher_weights="none", student=TEST_RESNET)

#: a tiny run on the CPU, as options of the run config: resnet18 (random weights) teaching resnet18,
#: 32 px crops, batch 8, no loader workers, one epoch (:func:`train_args`, :func:`tiny_config`)
TINY_RUN = dict(teacher="resnet18", teacher_weights="none", student="resnet18", image_size=32, batch_size=8)
TINY_RUN.update(workers=0, device="cpu", epochs=1)


def _tiny(options: dict) -> dict:
    """:data:`TINY_RUN` with ``options`` over it; under ``no_teacher`` without its teacher."""
    base = dict(TINY_RUN)
    if options.get("no_teacher"):
        del base["teacher"], base["teacher_weights"]
    return {**base, **options}


def cli_options(**options) -> list:
    """Command-line options from keywords named as kd's long options with ``_`` for ``-``
    (``batch_size=8``: ``--batch-size 8``); True gives the bare flag (``no_progress=True``:
    ``--no-progress``), None leaves the option out."""
    args = []
    for key, value in options.items():
        if value is not None:
            flag = "--" + key.replace("_", "-")
            args += [flag] if value is True else [flag, str(value)]
    return args


def train_args(data, out, *extra, **options) -> list:
    """The arguments of ``kd train`` for a tiny run of ``data`` into ``out``: the options of
    :data:`TINY_RUN` with ``options`` over them (see :func:`cli_options`; ``teacher=None`` leaves
    the teacher to ``--teacher-weights``, ``no_teacher=True`` trains the student alone), then
    ``extra`` as given."""
    return ["train", "--data", str(data), *cli_options(**_tiny(options)), *map(str, extra), "--out", str(out)]


def tiny_config(data, out, **options):
    """The resolved run config (:func:`kd.config.resolve`) of a tiny run of ``data`` into ``out``:
    the options of :data:`TINY_RUN` with ``options`` over them (``no_teacher=True``: the student alone)."""
    from kd import config as kd_config

    return kd_config.resolve(options={**_tiny(options), "data": str(data), "out": str(out)})


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def has_apex_amp() -> bool:
    """Whether NVIDIA apex with its ``apex.amp`` imports here (25.05 or older)."""
    try:
        from apex import amp  # noqa: F401
    except Exception:
        return False
    return True


def start_kd(*args) -> subprocess.Popen:
    """``kd ARGS`` started in a fresh interpreter, not waited for (stdout and stderr piped)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "cli", *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_kd(*args, cwd=None, env=None, timeout=HANG_GUARD) -> subprocess.CompletedProcess:
    """``kd ARGS`` as a user runs it, in a fresh interpreter."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "cli", *map(str, args)],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextlib.contextmanager
def _captured_output():
    """stdout and stderr of this process, both the Python streams and file descriptors 1 and 2
    (what C++ and child processes write), into two temporary files; yields a reader of them."""
    sys.stdout.flush()
    sys.stderr.flush()
    files = {fd: tempfile.TemporaryFile() for fd in (1, 2)}
    saved_fds = {fd: os.dup(fd) for fd in files}
    saved_streams = sys.stdout, sys.stderr
    streams = {
        fd: io.TextIOWrapper(
            open(os.dup(f.fileno()), "wb", buffering=0), encoding="utf-8", errors="replace", write_through=True
        )
        for fd, f in files.items()
    }
    try:
        for fd, f in files.items():
            os.dup2(f.fileno(), fd)
        sys.stdout, sys.stderr = streams[1], streams[2]

        def read(fd):
            files[fd].seek(0)
            return files[fd].read().decode("utf-8", errors="replace")

        yield read
    finally:
        sys.stdout, sys.stderr = saved_streams
        for fd, saved in saved_fds.items():
            os.dup2(saved, fd)
            os.close(saved)
        for fd in files:
            streams[fd].close()
            files[fd].close()


def kd_main(*args, env=None, threads=None) -> subprocess.CompletedProcess:
    """``kd ARGS`` through the console script's body (``cli.main``) in this process; the same
    result as :func:`run_kd`. Environment variables kd sets (``--local_rank``, a start time) and
    ``env`` are undone afterwards; ``threads`` sets torch's thread count for the call (as
    OMP_NUM_THREADS does for a fresh interpreter). Not for multi-process runs: torch's launcher
    installs signal handlers in the process that calls it."""
    from cli import main

    argv = [str(a) for a in args]
    environ = dict(os.environ)
    before = torch.get_num_threads()
    os.environ.update(env or {})
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with _captured_output() as read:
            code = main(argv)
            sys.stdout.flush()
            sys.stderr.flush()
            out, err = read(1), read(2)
    finally:
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(before)
    return subprocess.CompletedProcess(["kd", *argv], code, out, err)


def last_checkpoint(out: Path) -> dict:
    """The state the run in ``out`` saved last: its ``checkpoints/last.pt``."""
    return torch.load(Path(out) / "checkpoints" / "last.pt", weights_only=True)


def resumes_bit_for_bit(tmp_path: Path, args: list, step: int = 4) -> subprocess.CompletedProcess:
    """``kd train ARGS`` run whole, then a copy of its folder resumed from its checkpoint of ``step``:
    both end with the same student, bit for bit. Returns the whole run's result."""
    import shutil

    whole = tmp_path / "whole"
    first = kd_main("train", *args, "--out", whole)
    assert first.returncode == 0, first.stderr
    again = tmp_path / "again"
    shutil.copytree(whole, again)
    r = kd_main("train", *args, "--out", again, "--resume", again / "checkpoints" / f"step_{step:08d}.pt")
    assert r.returncode == 0 and "resumed" in r.stderr, r.stderr
    a, b = (last_checkpoint(run)["student"] for run in (whole, again))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return first


def one_error_line(r) -> str:
    """The one ``kd: error:`` line of a run that failed as a user error should (exit code 2, no
    traceback; warnings aside)."""
    lines = [line for line in r.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("kd: error: "), r.stderr
    return lines[0]


@pytest.fixture(scope="session")
def teacher_run(image_folder, tmp_path_factory):
    """One finished ``kd train`` of timm's resnet10t alone (one epoch of :func:`image_folder` at
    32 px, val resize 32), in this process: (its result, its folder). Tests only read it: a teacher
    for other runs, a run to evaluate, report or resume."""
    out = tmp_path_factory.mktemp("teacher") / "run"
    options = dict(no_teacher=True, student="timm:resnet10t", val_resize=32, no_progress=True)
    r = kd_main(*train_args(image_folder, out, **options))
    assert r.returncode == 0, r.stderr
    return r, out


@pytest.fixture(autouse=True)
def _few_threads():
    torch.set_num_threads(THREADS)
    yield


@pytest.fixture
def no_matplotlib(monkeypatch):
    """An environment where ``import matplotlib`` fails, as in an install without it."""
    import builtins

    real = builtins.__import__

    def refuse(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refuse)


def in_process_trainer(cfg, precision=None):
    """A :class:`kd.run.loop.Trainer` for ``cfg`` on the single backend, in this process; ``precision``
    replaces the one kd would choose (levels the CLI does not offer, float16 on the CPU)."""
    import unittest.mock

    import backends
    import kd.run.build
    from kd.run.loop import Trainer
    from kd.run.students import Students

    backend = backends.get("single")(cfg)
    backend.setup()
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    if precision is None:
        return Trainer(Students.alone(cfg), backend)
    with unittest.mock.patch.object(kd.run.build, "make_precision", lambda *args, **kwargs: precision):
        return Trainer(Students.alone(cfg), backend)


# ---------------------------------------------------------------- golden values of the official code


def golden_logits(batch, classes, a, b, scale):
    """Deterministic float64 logits, sin(a k + b) * scale over the flat index k: the inputs the scripts
    that computed the official golden values fed the official code."""
    i = torch.arange(batch * classes, dtype=torch.float64)
    return (torch.sin(i * a + b) * scale).reshape(batch, classes)


def gradient_probes(grad):
    """Three numbers of a gradient that the golden values keep: two weighted sums and the squared norm."""
    n = grad.numel()
    w1 = torch.arange(1, n + 1, dtype=torch.float64).reshape(grad.shape)
    w2 = torch.cos(torch.arange(n, dtype=torch.float64) * 0.37).reshape(grad.shape)
    return [(grad * w1).sum().item(), (grad * w2).sum().item(), (grad**2).sum().item()]


class Float32Copies(TorchDispatchMode):
    """Records each op that makes a float32 tensor of at least ``numel`` elements (a float32 copy of a
    reduced-dtype feature map, or a pass over one): ``with Float32Copies(x.numel()) as seen: ...; seen.ops``."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in [] if func.is_view else out if isinstance(out, (tuple, list)) else [out]:  # a view copies nothing
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= self.numel:
                self.ops.append(str(func))
        return out


#: a ``device`` parameter that runs on the GPU (``pytest -m gpu``) and skips itself without CUDA
CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)
