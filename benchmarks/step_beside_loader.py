"""kd's step on synthetic tensors, alone or with a load running beside it in the same process.

    python benchmarks/step_beside_loader.py --beside loader --data DIR --rate 8500 -- TRAIN_ARGS
    python benchmarks/step_beside_loader.py --beside none -- TRAIN_ARGS
    python benchmarks/step_beside_loader.py --beside burn:15 -- TRAIN_ARGS
    python benchmarks/step_beside_loader.py --beside gil:0.2:0.5 -- TRAIN_ARGS

TRAIN_ARGS, after ``--``, are ``kd train``'s: ``--data synthetic``, ``--out DIR`` (required),
``--limit-train-batches`` and ``--timed-after N`` for the timed steps; the run's
``timed_img_per_s`` is the step's rate. The load, started before the run and kept up until it ends:

* ``loader``: the ``--loader gpu`` training loader ``kd train`` would build over ``--data`` with
  TRAIN_ARGS' batch size and image size (``-j`` workers, ``--share`` for ``cpu_decode_share``), its
  batches dropped, taken at most at ``--rate`` images/s (0: as fast as it goes). The step never
  waits for these batches, so whatever it loses is what the loader's presence costs it, apart
  from the loader's speed. The loader's own consumer is one more thread of the process here (in
  ``kd train`` the training thread takes the batches), which adds to what the step loses;
* ``burn:N``: N processes at nice +10 keeping a core each busy in Python (CPU load without the
  interpreter lock or the GPU, as the workers are);
* ``gil:BURST:GAP``: one thread of this process running Python for BURST ms, then sleeping GAP ms
  (the interpreter lock taken from the training thread, without the GPU);
* ``none``: the step alone, in the same harness.

Prints one JSON line: the load, the step's images/s (null where the load failed) and the
loader's images/s while the run ran; exits 1 where the run or the load failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def train_value(train_args: List[str], *flags: str) -> Optional[str]:
    """The value TRAIN_ARGS give to any of ``flags`` (``--flag V`` or ``--flag=V``; the last wins)."""
    value = None
    for i, arg in enumerate(train_args):
        name, eq, given = arg.partition("=")
        if name in flags:
            value = given if eq else (train_args[i + 1] if i + 1 < len(train_args) else None)
    return value


class Loader:
    """The ``--loader gpu`` training loader over ``data``, iterated epoch after epoch in a thread."""

    def __init__(self, data: str, workers: int, share, batch: int, image_size: int, rate: float):
        self.options = {"data": data, "loader": "gpu", "workers": workers, "cpu_decode_share": share}
        self.options.update(batch_size=batch, image_size=image_size)
        self.rate = rate
        self.images, self.error = 0, None
        self.stop, self.ready = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from kd.commands.bench import build_loaders

        try:
            data, _ = build_loaders(self.options)  # the loaders of kd train and kd bench data
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
    parser = argparse.ArgumentParser(
        usage="%(prog)s [--beside LOAD] [options] -- TRAIN_ARGS",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--beside", default="none", help="loader | burn:N | gil:BURST_MS:GAP_MS | none")
    parser.add_argument("--data", help="the JPEG folder of --beside loader")
    parser.add_argument("-j", "--workers", type=int, default=15)
    parser.add_argument("--share", type=float, default=None, help="cpu_decode_share [kd's auto share]")
    parser.add_argument("--rate", type=float, default=0.0, help="at most this many images/s taken from the loader")
    args = parser.parse_args(argv[:split])
    train_args = argv[split + 1 :]
    out = train_value(train_args, "--out", "-o")
    if out is None:
        parser.error("give kd train's --out DIR among TRAIN_ARGS (after --)")
    kind, _, spec = args.beside.partition(":")
    try:
        numbers = [float(v) for v in spec.split(":")] if spec else []
    except ValueError:
        numbers = []
    if kind == "loader" and not args.data:
        parser.error("--beside loader needs --data DIR")
    if (kind == "burn" and len(numbers) != 1) or (kind == "gil" and len(numbers) != 2):
        parser.error(f"--beside {args.beside}: give burn:N or gil:BURST_MS:GAP_MS")
    if kind not in ("loader", "burn", "gil", "none"):
        parser.error(f"unknown load {args.beside!r}: loader, burn:N, gil:BURST_MS:GAP_MS or none")

    stop, loader, burners, failed = threading.Event(), None, [], None
    if kind == "loader":
        batch = int(train_value(train_args, "--batch-size", "-b") or 256)
        image_size = int(train_value(train_args, "--image-size") or 224)
        loader = Loader(args.data, args.workers, args.share, batch, image_size, args.rate)
        loader.thread.start()
        if not loader.ready.wait(300):
            failed = "the loader gave no batch in 300 s"
        failed = failed or loader.error
        time.sleep(0 if failed else 2)  # past the workers' first batches
    elif kind == "burn":
        spin = [sys.executable, "-c", "while True: sum(range(1000))"]
        burners = [subprocess.Popen(["nice", "-n", "10", *spin]) for _ in range(int(numbers[0]))]
    elif kind == "gil":
        burst_ms, gap_ms = numbers
        threading.Thread(target=python_bursts, args=(stop, burst_ms / 1e3, gap_ms / 1e3), daemon=True).start()

    from cli import cli

    start, before, rate = time.perf_counter(), loader.images if loader else 0, None
    try:
        if not failed:
            cli.main(["train", *train_args], standalone_mode=False)
            record = json.loads((Path(out) / "metrics.jsonl").read_text().splitlines()[-1])
            rate = round(record["timed_img_per_s"], 1)
    except BaseException as exc:  # noqa: BLE001 - reported in the JSON line, then a hard exit
        traceback.print_exc()
        failed = f"kd train: {type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - start
    stop.set()
    for burner in burners:
        burner.kill()
    if loader:
        loader.stop.set()
        failed = failed or loader.error
    result = {
        "beside": args.beside,
        "step_img_per_s": None if failed else rate,
        "loader_img_per_s": round((loader.images - before) / seconds, 1) if loader else None,
        "error": failed,
    }
    print(json.dumps(result), flush=True)
    if loader:  # its thread closes the loader after the batch in hand: the workers end before this process
        loader.thread.join(timeout=60)
    os._exit(1 if failed else 0)  # without waiting for the interpreter's shutdown (CUDA, the loader's threads)


if __name__ == "__main__":
    main()
