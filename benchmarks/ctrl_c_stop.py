"""A terminal's Ctrl-C to a kd command, at a chosen moment, and what came of it.

Starts ``kd ARGS`` in a process group of its own (as a shell's foreground job), sends SIGINT to
the whole group once a line containing TEXT was printed (plus DELAY seconds), or DELAY seconds
after the start when TEXT is empty, and prints one JSON line: the exit code, the seconds from the
signal to the exit, whether any traceback was printed, the last line printed, and what the run
folder (--out) holds.

    python benchmarks/ctrl_c_stop.py "first step done" 0.5 -- train --data DIR ... --out RUN
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def main() -> int:
    text, delay, args = sys.argv[1], float(sys.argv[2]), sys.argv[sys.argv.index("--") + 1 :]
    out = Path(args[args.index("--out") + 1]) if "--out" in args else None
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", *args], env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stderr is not None
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    while text and not any(text in line for line in lines) and proc.poll() is None:
        time.sleep(0.02)
    time.sleep(delay)
    sent = time.time()
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
    code = proc.wait()
    reader.join(timeout=5)
    held = sorted(p.name for p in out.iterdir()) if out is not None and out.is_dir() else None
    print(
        json.dumps(
            {
                "at_s": round(sent - started, 1),
                "exit": code,
                "exit_after_s": round(time.time() - sent, 1),
                "traceback": any("Traceback" in line for line in lines),
                "last": lines[-1].strip() if lines else "",
                "out": held,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
