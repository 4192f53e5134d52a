"""How torch.compile takes each method's run: graphs compiled and graph breaks, on the CPU in seconds.

    python benchmarks/compile_graphs.py [--methods kd,dkd,...] [--epochs 2] [--steps 3]

Each method trains ``--epochs`` epochs of ``--steps`` steps on synthetic tensors (resnet18 -> resnet18,
32 px, batch 8) with ``--compile``, its graphs handed to a counting backend that runs them as they are
(dynamo's capture without inductor's kernels: the graphs and the breaks are inductor's too). Prints one
row per method: the graphs compiled in the run (the teacher's forward, the student's training step,
its evaluation; CRD's student step twice: its first step sets the normaliser Z) and the graph breaks
with dynamo's reasons.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402

import backends  # noqa: E402
from kd import config as kd_config  # noqa: E402
from kd.losses import LOSSES  # noqa: E402
from kd.run.log import graph_breaks  # noqa: E402
from kd.run.loop import Trainer  # noqa: E402
from kd.run.students import Students  # noqa: E402

#: methods this pair cannot run (DeiT's token needs a ViT student) or that have no teacher
LEFT_OUT = ("deit", "ce")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=",".join(m for m in LOSSES.names() if m not in LEFT_OUT))
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    graphs = []

    def counting(gm, _example_inputs):
        graphs.append(gm)
        return gm.forward

    compile_ = torch.compile
    torch.compile = lambda model, mode=None: compile_(model, backend=counting)  # type: ignore[assignment]
    print("| method | graphs | graph breaks | reasons |\n|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            torch._dynamo.reset()
            before = graph_breaks()
            graphs.clear()
            options = dict(
                data="synthetic", teacher="resnet18", teacher_weights="none", student="resnet18", kd_loss=method,
                image_size=32, batch_size=8, workers=0, device="cpu", compile=True, epochs=args.epochs,
                limit_train_batches=args.steps, limit_val_batches=1, progress_bar=False, out=f"{tmp}/{method}",
            )  # fmt: skip
            cfg = kd_config.resolve(options=options)
            backend = backends.get("single")(cfg)
            backend.setup()
            Path(cfg.out).mkdir(parents=True)
            with contextlib.redirect_stderr(io.StringIO()):
                trainer = Trainer(Students.alone(cfg), backend)
                try:
                    trainer.fit()
                finally:
                    trainer.close()
            breaks = graph_breaks() - before
            reasons = "; ".join(reason.splitlines()[0] for reason in breaks) or "-"
            print(f"| {method} | {len(graphs)} | {sum(breaks.values())} | {reasons} |", flush=True)


if __name__ == "__main__":
    main()
