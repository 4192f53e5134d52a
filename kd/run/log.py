"""What a run writes: TensorBoard scalars, metrics.jsonl, a progress bar. Main process only.

Other processes get a :class:`NullLogger`: quiet by design, nothing patched.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from kd.errors import writing
from kd.runfolder import RunFolder

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is a dependency
    tqdm = None

#: how a run stopped by a failed write goes on
RESUME = "continue with --resume"


#: The wall-clock time the ``kd`` command started, handed to the processes it launches.
START_ENV = "KD_START_TIME"


def process_age() -> float:
    """Seconds since this process started (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            start_ticks = float(fh.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime", encoding="ascii") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def command_start(default: float) -> float:
    """When the ``kd`` command started (set by the CLI), for the first run of this process only;
    else ``default`` (a later run in the same process, as in ``kd demo``, or a call from Python)."""
    try:
        return float(os.environ.pop(START_ENV))
    except (KeyError, ValueError):
        return default


def mark_command_start() -> None:
    """Called first by the CLI: the command starts when its process did (interpreter start included)."""
    os.environ[START_ENV] = repr(time.time() - process_age())


@contextlib.contextmanager
def wall_clock(folders: Sequence[Path]) -> Iterator[None]:
    """Around one part of a run, in the process that launched it: when it ends (finished, stopped by
    a signal, failed) each of ``folders`` that holds the run gets a line in its ``wall.jsonl``, timed from
    the ``kd`` command's start. The command's start is this part's only: a later run of the same
    process (``kd demo``'s) starts when it is called. Each line: when the part started, its seconds
    from the command's start to the run's end, how it ended; ``kd report``'s wall time is their sum."""
    entered = time.time()
    started = float(os.environ.get(START_ENV, "") or entered)
    os.environ[START_ENV] = repr(started)  # the part's start as its processes see it (:func:`open_part`)
    before = {folder: config_stamp(RunFolder(folder)) for folder in folders}
    ended = "error"
    try:
        yield
        ended = "finished"
    except BaseException as exc:
        ended = getattr(exc, "signame", None) or ("SIGINT" if isinstance(exc, KeyboardInterrupt) else "error")
        raise
    finally:
        os.environ.pop(START_ENV, None)
        line = json.dumps({"started": started, "seconds": time.time() - started, "ended": ended}) + "\n"
        for folder in folders:
            run = RunFolder(folder)
            wrote = config_stamp(run) not in (None, before[folder])  # a run that set up writes its config.yaml
            if wrote and (run.metrics.is_file() or run.last.exists()):  # a run it kept
                try:
                    with open(run.wall, "a", encoding="utf-8") as fh:
                        fh.write(line)
                except OSError as exc:  # (a full disk): said, and the run's own outcome stays the error shown
                    why = exc.strerror or exc
                    print(f"kd: this part's wall time is not in {run.wall}: {why}", file=sys.stderr, flush=True)


def config_stamp(run: RunFolder) -> Optional[Tuple[int, int, int]]:
    """``run``'s config.yaml as its file system identifies a version of it (inode, size, time in ns), or
    None where there is none: every run writes it once its set-up has succeeded (a resumed one too, by
    an atomic rename), so a part that was refused before any work leaves it as it was."""
    try:
        st = run.config.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def open_part(run: Path, started: float) -> None:
    """A part of ``run`` has begun (its set-up succeeded): a line in its wall.jsonl that the part's own
    end line (:func:`wall_clock`, same ``started``) closes. A part killed outright (kill -9, a lost
    node) leaves it open, and ``kd report`` says its time is missing rather than leave it out unsaid."""
    try:
        with open(RunFolder(run).wall, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"started": started, "open": True}) + "\n")
    except OSError as exc:
        print(f"kd: this part's start is not in {RunFolder(run).wall}: {exc.strerror or exc}", file=sys.stderr)


def _wall_lines(run: Path) -> List[Dict[str, Any]]:
    path = RunFolder(run).wall
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def wall_parts(run: Path) -> List[Dict[str, float]]:
    """The ended parts of ``run`` (:func:`wall_clock`'s lines), in order; empty for a run of an older kd."""
    return [line for line in _wall_lines(run) if not line.get("open")]


def unended_parts(run: Path) -> List[float]:
    """When each part of ``run`` that began but wrote no end started (killed outright, or still running)."""
    lines = _wall_lines(run)
    ended = {line["started"] for line in lines if not line.get("open")}
    return [line["started"] for line in lines if line.get("open") and line["started"] not in ended]


class SetupClock:
    """Seconds of each part of a run's set-up, from the command's start (``started``, ``time.time()``)
    to its first step: where a slow start goes, logged and kept in metrics.jsonl."""

    def __init__(self, started: float):
        self.started = started
        self.last = started
        self.parts: Dict[str, float] = {}
        self.compiled_before = compile_seconds()  # another run's in this process (tests, benchmarks)
        self.breaks_before = graph_breaks()  # and its graph breaks

    def mark(self, part: str) -> None:
        """``part`` ends now: the seconds since the last mark are its."""
        now = time.time()
        self.parts[part] = self.parts.get(part, 0.0) + now - self.last
        self.last = now

    @property
    def seconds(self) -> float:
        """From the command to the last mark."""
        return self.last - self.started


def first_step_record(clock: SetupClock, asked: float, waited: float, device, log) -> Dict[str, float]:
    """Seconds from the command to this process's first step, which began by asking for its batch at
    ``asked`` (``perf_counter``) and waited ``waited`` for it, with the set-up's parts (``clock``):
    logged, and returned for metrics.jsonl (one device sync, once). The step's seconds and torch.compile's
    run from the batch's asking (a later student's include the students before it, which step first);
    the graph breaks are this student's own (the first student's with the teacher's), said in one line."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
    step = time.perf_counter() - asked - waited
    total = time.time() - clock.started
    # between the set-up and the first batch: the epoch's start (loader iterator, logging)
    before = max(total - clock.seconds - waited - step, 0.0)
    parts = ", ".join(f"{name} {seconds:.1f}" for name, seconds in clock.parts.items())
    compiling = compile_seconds() - clock.compiled_before
    of_it = f" (torch.compile {compiling:.1f} s of it)" if compiling > 0 else ""
    log(
        f"first step done {total:.1f} s after the command (set-up {clock.seconds:.1f} s: {parts}; then "
        f"the epoch's start {before:.1f} s, the first batch {waited:.1f} s and the step {step:.1f} s{of_it})"
    )
    now = graph_breaks()
    broken = now - clock.breaks_before  # this student's first step's (the first student's: with the teacher's)
    clock.breaks_before = now  # the next student's first step counts from here
    if broken:
        log(graph_break_note(broken))
    note = bytecode_note()
    if note:
        log(note)
    record = {"startup_s": total, "startup_setup_s": clock.seconds}
    record.update({f"startup_{name.replace(' ', '_')}_s": seconds for name, seconds in clock.parts.items()})
    record.update(startup_epoch_start_s=before, startup_first_batch_s=waited, startup_step_s=step)
    if compiling > 0:
        record["startup_compile_s"] = compiling
        record["startup_graph_breaks"] = float(sum(broken.values()))
    return record


def graph_breaks() -> Counter:
    """torch.compile's graph breaks in this process so far, by reason (dynamo's count); empty where
    nothing compiled."""
    if "torch._dynamo" not in sys.modules:
        return Counter()
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return Counter()
    return Counter(counters.get("graph_break", {}))


def graph_break_note(breaks: Counter) -> str:
    """One line for a compiled step that torch.compile cut into graphs: the code between them ran eager.
    Each reason by its first line (dynamo's own words), the commonest first."""
    said = "; ".join(
        (reason.strip().splitlines() or ["(no reason given)"])[0].rstrip(".") + (f" (x{n})" if n > 1 else "")
        for reason, n in breaks.most_common(3)
    )
    more = f"; {len(breaks) - 3} more" if len(breaks) > 3 else ""
    total = sum(breaks.values())
    return (
        f"torch.compile: {total} graph break(s) in the first step, the code between the graphs ran eager: "
        f"{said}{more} (TORCH_LOGS=graph_breaks says where)"
    )


def compile_seconds() -> float:
    """Seconds torch.compile has spent in this process, by its own account: the forward graphs, and
    the backward graphs it compiles at their first use; 0 where nothing compiled (or this torch keeps
    no such account)."""
    if "torch._dynamo" not in sys.modules:  # nothing compiled, and importing it costs seconds
        return 0.0
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return 0.0
    return float(
        sum(sum(compilation_time_metrics.get(k, ())) for k in ("_compile.compile_inner", "backward._backward_impl"))
    )


def bytecode_note(module=None) -> Optional[str]:
    """A line where Python keeps no bytecode for ``module`` (torch): every kd process then compiles
    its sources again, 7.5 s of each start on one H200 machine (docs/benchmarks.md); None where the
    cache is there."""
    import importlib.util

    if module is None:
        import torch as module
    source = getattr(module, "__file__", None) or ""
    if not source.endswith(".py"):
        return None
    try:
        cached = importlib.util.cache_from_source(source)
    except NotImplementedError:  # an interpreter without bytecode caching
        return None
    if os.path.exists(cached):
        return None
    package = os.path.dirname(source)
    why = "PYTHONDONTWRITEBYTECODE is set" if sys.dont_write_bytecode else "it cannot write beside the sources"
    return (
        f"start-up: Python keeps no bytecode for {module.__name__} here ({why}), so every process compiles its "
        f"sources again, seconds at each start; once: python -m compileall -q -j 0 {package}"
    )


class NullLogger:
    """The logger of non-main processes: accepts everything, writes nothing."""

    bar_enabled: bool = False  # whether progress() shows a bar (RunLogger: its progress_bar setting)

    def info(self, msg: str) -> None:
        pass

    def scalars(self, prefix: str, values: Dict[str, float], step: int) -> None:
        pass

    def interval(self, stats: Dict[str, float], extra: Dict[str, float], elapsed: float, step: int, bar) -> None:
        """The training scalars of a log interval (means over its steps, plus ``extra``), to TensorBoard
        and the progress bar."""
        scalars = {k: v for k, v in stats.items() if k != "images"}
        scalars.update(extra, img_per_s=stats["images"] / max(elapsed, 1e-9))
        self.scalars("train", scalars, step)
        bar.set_postfix_str(f"loss {scalars['loss']:.4f} lr {scalars['lr']:.4g} img/s {scalars['img_per_s']:.0f}")

    def resume_at(self, epochs_done: int) -> None:
        pass

    def epoch(self, record: Dict[str, float]) -> None:
        pass

    def progress(self, total: int, desc: str):
        return NullBar()

    def close(self) -> None:
        pass


class NullBar:
    """A progress bar that shows nothing (other processes, --no-progress, before the first epoch)."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


class RunLogger(NullLogger):
    """Writes ``OUT/tb/`` event files and ``OUT/metrics.jsonl``; prints to stderr."""

    def __init__(self, out: Path, progress_bar: Optional[bool] = None, prefix: str = ""):
        """``prefix`` starts every line printed (the student's name when several train at once)."""
        self.out = Path(out)
        self.prefix = prefix
        self._writer = None
        self.metrics_path = RunFolder(out).metrics
        self.bar_enabled = sys.stderr.isatty() if progress_bar is None else progress_bar

    @property
    def writer(self):
        """The SummaryWriter, made on first use so a run that fails to start leaves no tb/."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            with writing(RunFolder(self.out).tensorboard, RESUME):
                self._writer = SummaryWriter(log_dir=str(RunFolder(self.out).tensorboard), flush_secs=30)
        return self._writer

    def info(self, msg: str) -> None:
        msg = self.prefix + msg
        if tqdm is not None and self.bar_enabled:
            tqdm.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def scalars(self, prefix: str, values: Dict[str, float], step: int) -> None:
        writer = self.writer
        with writing(RunFolder(self.out).tensorboard, RESUME):
            for key, value in values.items():
                writer.add_scalar(f"{prefix}/{key}", value, step)

    def resume_at(self, epochs_done: int) -> None:
        """Drop the metrics.jsonl lines of epochs after ``epochs_done`` (the checkpoint resumed from):
        a run stopped between an epoch's line and its checkpoint trains that epoch again; a last
        line a kill cut short goes too."""
        path = self.metrics_path
        if not path.is_file():
            return
        lines = RunFolder(self.out).metric_lines()
        kept = "".join(line for line, record in lines if record.get("epoch", 0) <= epochs_done)
        if kept.encode("utf-8") != path.read_bytes():
            tmp = path.with_name(f".{path.name}.tmp")
            with writing(path, RESUME):
                tmp.write_text(kept, encoding="utf-8")
                os.replace(tmp, path)

    def epoch(self, record: Dict[str, float]) -> None:
        with writing(self.metrics_path, RESUME), open(self.metrics_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
        step = int(record["epoch"])
        self.scalars("epoch", {k: v for k, v in record.items() if k != "epoch" and isinstance(v, (int, float))}, step)
        with writing(RunFolder(self.out).tensorboard, RESUME):
            self.writer.flush()

    def progress(self, total: int, desc: str):
        if tqdm is None or not self.bar_enabled:
            return NullBar()
        return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)

    def close(self) -> None:
        if self._writer is not None:
            with writing(RunFolder(self.out).tensorboard, RESUME):
                self._writer.close()
