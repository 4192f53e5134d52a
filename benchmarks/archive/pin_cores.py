"""Run a command with its processes kept apart on the CPU: every process but the loader's workers
on the last RESERVED cores (whole physical cores where the machine shows hyper-threads), the
workers (and any process they start) on the others.

    python benchmarks/archive/pin_cores.py 3 -- python -m cli bench ... --data DIR --loader gpu -j 15

Tells whether the training process's threads (the step, the GPU loader's decode thread, the
pinning thread) lose time to the workers on shared cores. A worker is a descendant process
started by multiprocessing (spawn or forkserver), a torch.compile worker, or a forked copy of
its parent; the placement is re-applied every half second, so processes and threads started
later are placed too. Linux only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional


def physical_cores() -> List[List[int]]:
    """The CPUs this process may use, grouped by physical core."""
    groups: Dict[str, List[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        groups.setdefault(siblings.read_text().strip() if siblings.exists() else str(cpu), []).append(cpu)
    return list(groups.values())


def tasks(pid: int) -> List[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def children(pid: int) -> List[int]:
    out: List[int] = []
    for tid in tasks(pid):
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            pass
    return out


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def is_worker(pid: int, parent: Optional[int]) -> bool:
    if parent is None:
        return False
    line = cmdline(pid)
    return any(tag in line for tag in (b"spawn_main", b"forkserver", b"compile_worker")) or line == cmdline(parent)


def place(pid: int, cpus: List[int]) -> None:
    for tid in tasks(pid):
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # the thread has ended
            pass


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit(__doc__)
    reserved_count, command = int(sys.argv[1]), sys.argv[3:]
    reserved: List[int] = []
    for group in reversed(physical_cores()):
        if len(reserved) >= reserved_count:
            break
        reserved += group
    workers = sorted(os.sched_getaffinity(0) - set(reserved))
    print(f"pin_cores: training process on CPUs {reserved}, workers on {workers}", flush=True)
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        stack: List[tuple] = [(proc.pid, None)]
        while stack:
            pid, parent = stack.pop()
            stack += [(child, pid) for child in children(pid)]
            place(pid, workers if is_worker(pid, parent) else reserved)
        time.sleep(0.5)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
