"""The cost of the checks a resume makes before any work (kd/run/resume.py): the checkpoint read
and checked against its SHA-256 for the config it trained with, config.yaml compared with it, and
the class names compared with the data's; on a resnet18 checkpoint of 1,000 classes with SGD's
momentum (about 90 MB), as a run writes it.

Usage: python benchmarks/resume_checks.py [--repeat N] [--dir DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torchvision

from kd import config as kd_config
from kd.run.resume import ran_config, resumed_config, with_last_part
from kd.utils.checkpoint_io import read, save_atomic
from kd.utils.weight_files import check_classes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/kd-resume-checks"))
    args = parser.parse_args()
    run = args.dir
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    student = torchvision.models.resnet18().state_dict()
    classes = [f"n{i:08d}" for i in range(1000)]
    cfg = kd_config.resolve(
        options={"data": "synthetic", "teacher": "resnet34", "student": "resnet18", "out": str(run)}
    )
    state = {
        "format": 1, "kd_version": "bench", "student": student, "state_dict": student,
        "optimizer": {"state": {i: {"momentum_buffer": v.clone()} for i, v in enumerate(student.values())}},
        "epoch": 1, "classes": classes, "config": cfg.to_dict(),
    }  # fmt: skip
    last = run / "checkpoints" / "last.pt"
    save_atomic(state, last)
    kd_config.save(cfg, run / "config.yaml")
    size = last.stat().st_size / 1e6
    for name, fn in [
        ("the checkpoint read and checked (SHA-256), its config resolved", lambda: resumed_config(run, last, {}, ())),
        (
            "config.yaml compared with it",
            lambda: with_last_part(ran_config(state, last, run), run / "config.yaml", last),
        ),
        (
            "1,000 class names compared",
            lambda: check_classes(read(last, "x", mmap=True)["classes"], classes, last, run),
        ),
    ]:
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        # the first call is what a resume pays (a file's SHA-256 is kept in the process after it)
        print(f"{name}: {times[0] * 1e3:.1f} ms first, {min(times) * 1e3:.1f} ms again (checkpoint {size:.0f} MB)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
