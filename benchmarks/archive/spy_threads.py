"""Which thread of a process runs, and in what, from py-spy samples (``--threads``, raw format).

    python benchmarks/profile_epoch.py --data DIR --steps 190 --set cpu_decode_share=0.1 & PID=$!
    # once it prints "epoch 0", during the profiled epoch:
    py-spy record --pid $PID --threads -r 250 -d 3 --nonblocking --format raw -o /tmp/active.txt 2> /tmp/active.err
    python benchmarks/archive/spy_threads.py /tmp/active.txt /tmp/active.err

Prints each thread's share of the samples and the most sampled pairs of (innermost kd frame,
innermost frame) per thread. With py-spy's ``--gil`` the samples are those of the thread
holding the interpreter lock. py-spy is not a dependency of kd: ``pip install py-spy``.
"""

from __future__ import annotations

import collections
import re
import sys


def main() -> None:
    samples, err = sys.argv[1], sys.argv[2]
    found = re.search(r"Samples: (\d+)", open(err).read())
    by_thread: collections.Counter = collections.Counter()
    by_frame: collections.Counter = collections.Counter()
    for line in open(samples):
        stack, _, count = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        thread = re.sub(r"thread \(\d+\): ?", "", frames[0]) or "?"
        by_thread[thread] += int(count)
        ours = [f for f in frames[1:] if "kd/" in f or "benchmarks/" in f or "backends/" in f]
        inner = (ours[-1] if ours else "-").split(" (")[0]
        by_frame[f"{thread} | {inner} > {frames[-1].split(' (')[0]}"] += int(count)
    total = sum(by_thread.values())
    print(f"{total} thread samples ({found.group(1) if found else '?'} reported by py-spy)")
    print("per thread: " + ", ".join(f"{k} {100 * v / total:.1f} %" for k, v in by_thread.most_common(8)))
    for key, count in by_frame.most_common(25):
        print(f"  {100 * count / total:5.1f} %  {key}")


if __name__ == "__main__":
    main()
