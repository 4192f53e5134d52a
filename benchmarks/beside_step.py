"""kd's step on synthetic tensors, alone or with a load running beside it in the same process.

    python benchmarks/beside_step.py --beside loader --data DIR --rate 8500 -- TRAIN_ARGS
    python benchmarks/beside_step.py --beside none -- TRAIN_ARGS
    python benchmarks/beside_step.py --beside burn:15 -- TRAIN_ARGS
    python benchmarks/beside_step.py --beside gil:0.2:0.5 -- TRAIN_ARGS

TRAIN_ARGS are ``kd train``'s (``--data synthetic``, ``--limit-train-batches`` and
``--set timing_warmup=N`` for the timed steps); the run's ``timed_img_per_s`` is the step's rate.
The load, started before the run and kept up until it ends:

* ``loader``: the ``--loader gpu`` training loader ``kd train`` would build over ``--data``
  (``-j``, ``--share`` for ``cpu_decode_share``, ``-b``), its batches dropped at ``--rate``
  images/s (0: as fast as it goes). The step never waits for these batches, so whatever it loses
  is what the loader's presence costs it, apart from the loader's speed;
* ``burn:N``: N processes at nice +10 keeping a core each busy in Python (CPU load without the
  interpreter lock or the GPU, as the workers are);
* ``gil:BURST:GAP``: one thread of this process running Python for BURST ms every GAP ms (the
  interpreter lock taken from the training thread, without the GPU);
* ``none``: the step alone, in the same harness.

Prints one JSON line: the load, the step's images/s and the loader's images/s while the run ran.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class Loader:
    """The ``--loader gpu`` training loader over ``data``, iterated epoch after epoch in a thread."""

    def __init__(self, data: str, workers: int, share, batch: int, rate: float):
        self.data, self.workers, self.share, self.batch, self.rate = data, workers, share, batch, rate
        self.images, self.error = 0, None
        self.stop, self.ready = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from backends.base import resolve_device
        from kd import config as kd_config
        from kd.data import build
        from kd.runtime import resolve as resolve_runtime

        try:
            options = {"teacher": "resnet18", "student": "resnet18", "data": self.data, "loader": "gpu"}
            options.update(workers=self.workers, batch_size=self.batch)
            sets = [] if self.share is None else [f"cpu_decode_share={self.share}"]
            cfg = kd_config.resolve(options=options, sets=sets)
            device = resolve_device(cfg)
            data = build(cfg, 1, 0, cfg.batch_size, device, resolve_runtime(cfg, device).channels_last)
            print(f"beside: {data.train.describe()}", file=sys.stderr, flush=True)
            epoch = 0
            while not self.stop.is_set():
                data.train.set_epoch(epoch)
                epoch += 1
                start, first = time.perf_counter(), self.images
                for batch in data.train:
                    self.ready.set()
                    self.images += len(batch)
                    if self.rate > 0:
                        time.sleep(max(0.0, start + (self.images - first) / self.rate - time.perf_counter()))
                    if self.stop.is_set():
                        break
            data.close()
        except Exception as exc:  # reported in the JSON line
            self.error = f"{type(exc).__name__}: {exc}"
            self.ready.set()


def python_bursts(stop: threading.Event, burst_s: float, gap_s: float) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < burst_s:
            sum(range(100))
        time.sleep(gap_s)


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--beside", default="none", help="loader | burn:N | gil:BURST_MS:GAP_MS | none")
    parser.add_argument("--data", help="the JPEG folder of --beside loader")
    parser.add_argument("-j", "--workers", type=int, default=15)
    parser.add_argument("-b", "--batch-size", type=int, default=256)
    parser.add_argument("--share", type=float, default=None, help="cpu_decode_share [kd's auto share]")
    parser.add_argument("--rate", type=float, default=0.0, help="images/s the loader's batches are taken at")
    args = parser.parse_args(argv[:split])
    train_args = argv[split + 1 :]
    if "--out" not in train_args:
        parser.error("give kd train's --out among TRAIN_ARGS")
    kind, _, spec = args.beside.partition(":")
    stop, loader, burners = threading.Event(), None, []
    if kind == "loader":
        if not args.data:
            parser.error("--beside loader needs --data DIR")
        loader = Loader(args.data, args.workers, args.share, args.batch_size, args.rate)
        loader.thread.start()
        loader.ready.wait(300)
        time.sleep(2)  # past the workers' first batches
    elif kind == "burn":
        spin = [sys.executable, "-c", "while True: sum(range(1000))"]
        burners = [subprocess.Popen(["nice", "-n", "10", *spin]) for _ in range(int(spec))]
    elif kind == "gil":
        burst_ms, gap_ms = (float(v) for v in spec.split(":"))
        threading.Thread(target=python_bursts, args=(stop, burst_ms / 1e3, gap_ms / 1e3), daemon=True).start()
    elif kind != "none":
        parser.error(f"unknown load {args.beside!r}")

    from cli import cli

    start, before = time.perf_counter(), loader.images if loader else 0
    try:
        cli.main(["train", *train_args], standalone_mode=False)
    finally:
        seconds = time.perf_counter() - start
        stop.set()
        for burner in burners:
            burner.kill()
        if loader:
            loader.stop.set()
    out = Path(train_args[train_args.index("--out") + 1])
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    result = {
        "beside": args.beside,
        "step_img_per_s": round(record["timed_img_per_s"], 1),
        "loader_img_per_s": round((loader.images - before) / seconds, 1) if loader else None,
        "loader_error": loader.error if loader else None,
    }
    print(json.dumps(result), flush=True)
    if loader:  # its thread closes the loader after the batch in hand: the workers end before this process
        loader.thread.join(timeout=60)
    os._exit(0)  # without waiting for the interpreter's shutdown (CUDA, the loader's threads)


if __name__ == "__main__":
    main()
