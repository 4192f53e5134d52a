"""``kd demo``: a real KD experiment that runs anywhere, offline, on two CPU cores.

The data are scikit-learn's bundled handwritten digits (1,797 real 8x8 scans, shipped inside
the package), written out as an ImageNet-layout JPEG folder. Three runs go through the same
``kd train`` path: a teacher trained on every labelled training digit, then a smaller student
that sees only a few labelled digits of each class, alone and distilled from the teacher. With
few labels the teacher's soft targets carry what the labels cannot, so KD's gain is large and
stable (seed 0: 85.6 alone, 93.3 with KD; seed 1: 86.2 and 93.1; the teacher 96.9).

``OUT/demo.json`` says the folder is a demo's, of which epochs, and which runs finished: ``kd demo``
again keeps those, resumes a stopped one from its last checkpoint and starts the rest.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Dict, Optional

from kd.commands.table import markdown
from kd.errors import KDError, writing
from kd.runfolder import RunFolder
from kd.siblings import own

TEACHER = "resnet18"
STUDENT = "timm:resnet10t"
IMAGE_SIZE = 32
TEACHER_EPOCHS = 20  # a well-trained teacher on every labelled training digit ...
STUDENT_EPOCHS = 60  # ... and students that see few of them (the epochs are short)
STUDENT_PER_CLASS = 20  # labelled training digits per class the students see
RUNS = ("teacher", "student", "student_kd")
DEMO_FILE = "demo.json"  # in OUT: the demo's epochs and its finished runs
#: each run's cost per training image and epoch, against the teacher's resnet18 step (resnet10t's step
#: is about 0.6 of it; with the teacher's forward, 0.9): the shares of the progress line's estimate
STEP_COST = {"teacher": 1.0, "student": 0.6, "student_kd": 0.9}
#: the demo's seconds at its default epochs on 2 idle cores (docs/benchmarks.md), for the first estimate
IDLE_SECONDS = 149.0


def write_digits(root: Path, size: int = IMAGE_SIZE, val_fraction: float = 0.25, seed: int = 0) -> Path:
    """sklearn's digits as ``root/{train,val}/<digit>/*.jpg`` (stratified split, fixed seed)."""
    import numpy as np
    from PIL import Image

    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise KDError("kd demo needs scikit-learn: pip install 'kd[demo]' (or pip install scikit-learn)") from None
    from kd.data.folder import BILINEAR

    digits = load_digits()
    rng = np.random.default_rng(seed)
    for label in range(10):
        idx = np.flatnonzero(digits.target == label)
        rng.shuffle(idx)
        n_val = int(round(len(idx) * val_fraction))
        for split, part in (("val", idx[:n_val]), ("train", idx[n_val:])):
            folder = root / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            for i in part:
                pixels = (digits.images[i] * (255.0 / 16.0)).astype(np.uint8)
                img = Image.fromarray(pixels, mode="L").resize((size, size), BILINEAR).convert("RGB")
                img.save(folder / f"{i:04d}.jpg", quality=95)
    return root


def few_labels(data: Path, root: Path, per_class: int) -> Path:
    """``root``: the first ``per_class`` training images of each class of ``data``, and all of its val."""
    for split in ("train", "val"):
        for folder in sorted((data / split).iterdir()):
            files = sorted(folder.glob("*.jpg"))
            (root / split / folder.name).mkdir(parents=True, exist_ok=True)
            for f in files[:per_class] if split == "train" else files:
                shutil.copyfile(f, root / split / folder.name / f.name)
    return root


def keep_best(run: Path) -> None:
    """Only what a user opens: the best checkpoint, the logs and metrics (not last.pt, twice the size)."""
    last = RunFolder(run).last
    if RunFolder(run).best.is_file() and last.is_file():
        last.unlink()


def _best(run: Path) -> Dict[str, float]:
    records = RunFolder(run).records()
    return max(records, key=lambda r: r.get("val_top1", -1))


def demo_state(out: Path, epochs: Optional[int], overwrite: bool) -> Dict[str, Any]:
    """What ``out`` holds of a demo of ``epochs``: its epochs and finished runs, empty where there
    is none yet (or ``overwrite`` removed it); a folder that holds something else is refused."""
    marker = out / DEMO_FILE
    if overwrite and out.exists():
        shutil.rmtree(out)
    elif marker.is_file():
        state = json.loads(marker.read_text(encoding="utf-8"))
        if state.get("epochs") != epochs:
            given = f" --epochs {state['epochs']}" if state.get("epochs") else ""
            raise KDError(
                f"{out} holds a demo of other epochs; continue it with kd demo --out {out}{given}, "
                f"or pass --overwrite to start over"
            )
        return state
    elif out.exists() and any(out.iterdir()):
        raise KDError(f"{out} is not empty and holds no kd demo; pass --overwrite to replace it, or --out DIR")
    out.mkdir(parents=True, exist_ok=True)
    state = {"epochs": epochs, "finished": []}
    marker.write_text(json.dumps(state), encoding="utf-8")
    return state


def continue_with(out: Path, epochs: Optional[int]) -> str:
    """The command that continues the demo in ``out``."""
    return f"kd demo --out {out}" + (f" --epochs {epochs}" if epochs else "")


def run_demo(out: Path, epochs: Optional[int] = None, overwrite: bool = False) -> Dict[str, float]:
    """Teacher, student alone, student with KD; prints a table and returns the top-1 of each. A demo
    already in ``out`` continues: its finished runs are kept, a stopped one resumes."""
    from kd.utils.signals import Interrupted

    out = Path(out)
    try:
        return _run_demo(out, epochs, overwrite)
    except Interrupted as exc:  # a stop's own line names kd train; the demo continues as a whole
        done = str(exc).split("; continue with:")[0].replace("nothing was written", "the finished runs are kept")
        raise Interrupted(exc.signame, message=f"{done}; continue with: {continue_with(out, epochs)}") from None


def _count(folder: Path) -> int:
    return sum(1 for _ in folder.rglob("*.jpg"))


def progress_line(index: int, left: float, done: float, seconds: float, idle: float) -> str:
    """``kd demo: run 2 of 3, about 1.5m left ...``: the time the runs not finished will take, at this
    command's pace where it has trained (``seconds`` for ``done`` work), else at an idle machine's
    (``idle`` seconds per unit of work)."""
    from kd.commands.report import duration

    if done:
        return (
            f"kd demo: run {index} of {len(RUNS)}, about {duration(left * seconds / done)} left at this machine's pace"
        )
    return (
        f"kd demo: run {index} of {len(RUNS)}, about {duration(left * idle)} left on 2 idle cores "
        "(longer while other work shares them; the next runs' line says at this machine's pace)"
    )


def _run_demo(out: Path, epochs: Optional[int], overwrite: bool) -> Dict[str, float]:
    from kd.config import RunConfig, validate
    from kd.run.jobs import TrainJob
    from kd.run.launch import train
    from kd.run.students import Students
    from kd.utils.signals import before_next_run

    own("backends")  # which the runs import: another package's is one line here
    again = f"run {continue_with(out, epochs)} again"
    with writing(out, again):
        state = demo_state(out, epochs, overwrite)
        data = write_digits(out / "data")  # the same files again where a demo continues
        few = few_labels(data, out / f"data_{STUDENT_PER_CLASS}_per_class", STUDENT_PER_CLASS)
    teacher_epochs = epochs or TEACHER_EPOCHS
    student_epochs = epochs or STUDENT_EPOCHS
    common: Dict[str, Any] = dict(
        image_size=IMAGE_SIZE,
        val_resize=IMAGE_SIZE,
        min_crop_scale=0.8,
        batch_size=32,
        lr=0.1,
        lr_schedule="cosine",
        warmup_epochs=1,
        weight_decay=5e-4,
        device="cpu",
        workers=1,
        log_every=5,
        seed=0,
    )
    runs = {
        "teacher": RunConfig(
            **{**common, "batch_size": 64},
            data=str(data),
            epochs=teacher_epochs,
            student=TEACHER,
            no_teacher=True,
            out=str(out / "teacher"),
        ),
        "student": RunConfig(
            **common, data=str(few), epochs=student_epochs, student=STUDENT, no_teacher=True, out=str(out / "student")
        ),
    }
    started = time.perf_counter()
    images = {"teacher": _count(data / "train"), "student": _count(few / "train"), "student_kd": _count(few / "train")}
    epochs_of = {"teacher": teacher_epochs, "student": student_epochs, "student_kd": student_epochs}
    work = {name: images[name] * epochs_of[name] * STEP_COST[name] for name in RUNS}
    idle = IDLE_SECONDS / sum(
        images[n] * (TEACHER_EPOCHS if n == "teacher" else STUDENT_EPOCHS) * STEP_COST[n] for n in RUNS
    )
    done = 0.0  # the work this command has trained
    results = {}
    for index, name in enumerate(RUNS, 1):
        if name == "student_kd":
            runs[name] = RunConfig(
                **common,
                data=str(few),
                epochs=student_epochs,
                student=STUDENT,
                teacher=TEACHER,
                teacher_weights=str(RunFolder(out / "teacher").best),
                kd_loss="kd",
                ce_weight=0.5,
                temperature=4.0,
                loss_args={"kd_weight": 0.5},
                out=str(out / "student_kd"),
            )
        run = RunFolder(runs[name].out)
        if name not in state["finished"]:
            before_next_run()
            stopped = run.last if run.last.is_file() else None  # else nothing of it is kept: it starts over
            print(f"== kd demo: {name}{' (continued)' if stopped else ''} ==", flush=True)
            left = sum(work[n] for n in RUNS[index - 1 :] if n not in state["finished"])
            print(progress_line(index, left, done, time.perf_counter() - started, idle), flush=True)
            train(TrainJob(Students.alone(validate(runs[name]), stopped)), overwrite=stopped is None)
            keep_best(run.root)
            state["finished"].append(name)
            done += work[name]
            with writing(out / DEMO_FILE, again):
                (out / DEMO_FILE).write_text(json.dumps(state), encoding="utf-8")
        results[name] = _best(run.root)
    minutes = (time.perf_counter() - started) / 60
    n_train = images["teacher"]
    rows = [
        (f"teacher {TEACHER}, {n_train} labelled digits", "teacher"),
        (f"student {STUDENT} alone, {STUDENT_PER_CLASS * 10} labelled digits", "student"),
        (f"student {STUDENT} with KD from the teacher, the same {STUDENT_PER_CLASS * 10}", "student_kd"),
    ]
    gain = results["student_kd"]["val_top1"] - results["student"]["val_top1"]
    print(
        f"\nkd demo: sklearn digits ({IMAGE_SIZE}px); teacher {teacher_epochs} epochs, students {student_epochs} "
        f"epochs; {minutes:.1f} min on the CPU; KD's gain over the student alone: {gain:+.1f} points top-1\n"
    )
    print(
        markdown(
            [
                {
                    "run": label,
                    "top-1": f"{results[key]['val_top1']:.2f}",
                    "top-5": f"{results[key]['val_top5']:.2f}",
                    "folder": out / key,
                }
                for label, key in rows
            ],
            ["run", "top-1", "top-5", "folder"],
            pad=True,
        )
    )
    print(f"\nTensorBoard: tensorboard --logdir {out}")
    return {k: v["val_top1"] for k, v in results.items()}
