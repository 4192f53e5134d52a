"""``kd bench``: backend x opt-level comparison, each combination in a fresh process set.

Every combination runs ``kd train`` as a subprocess (the real launch path), times the steps
after a warm-up, and reports seconds per 20 iterations, images/s, the peak memory of every
GPU, and the speed-up against the first row that ran (``dp O0`` when asked for). A combination
whose backend cannot run on this machine (dp without CUDA) starts no process: its row gives
the line kd train refuses it with.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

from kd.commands import table
from kd.errors import KDError
from kd.runfolder import RunFolder
from kd.siblings import own

COLUMNS = ["backend", "opt", "methods", "s_per_20_iters", "img_per_s", "peak_mem_gb", "speedup", "impl", "note"]
#: with --vs-synthetic, after img_per_s: the same combination on synthetic tensors, and the folder's share of it
SYNTHETIC_COLUMNS = ["synthetic_img_per_s", "of_synthetic_pct"]
#: with --vs-store: where the row's teacher outputs came from (after opt), and its img/s as a % of
#: the student alone (after img_per_s)
STORE_COLUMNS = ["teacher", "of_alone_pct"]


def combo_options(backend: str, opt: str, args: Dict[str, Any], out: Path, verb: str = "train") -> Dict[str, Any]:
    """The options of one combination's ``kd train`` (or ``kd teach``, ``verb``), named as its run
    config names them (``top_k``: kd teach's ``--top-k``): its timed steps after ``warmup`` untimed
    ones, models without weights. Values are True (a bare flag) or the option's text."""
    synthetic = args.get("data", "synthetic") == "synthetic"
    options: Dict[str, Any] = {"backend": backend, "opt": opt, "epochs": "1", "out": str(out)}
    if verb == "train" or synthetic:  # kd teach labels a folder's whole epoch; synthetic tensors have none
        options["limit_train_batches"] = str(args["warmup"] + args["iters"])
    if verb == "train":
        options["student_weights"] = "none"
    backends = own("backends")
    multiprocess = backend in backends.BACKENDS and backends.get(backend).multiprocess
    keys = ["data", "batch_size", "image_size", "device", "gpus", "nproc", "amp_dtype", "workers", "loader", "compile"]
    keys += ["student", "kd_loss", "soft_labels", "no_teacher"] if verb == "train" else ["top_k"]
    for key in ["teacher", *keys]:
        value = args.get(key)
        if key == "nproc" and not multiprocess:
            continue
        if value is None or value is False:
            continue
        options[key] = True if value is True else str(value)
    if args.get("teacher"):
        options["teacher_weights"] = "none"
    return options


def combo_command(backend: str, opt: str, args: Dict[str, Any], out: Path, verb: str = "train") -> List[str]:
    """The ``kd train`` (or ``kd teach``, ``verb``) command of one combination: its options
    (:func:`combo_options`) and ``--set`` items."""
    cmd = [sys.executable, "-m", "cli", verb, "--no-progress", "--timed-after", str(args["warmup"])]
    if verb == "train":
        cmd.append("--overwrite")
    for key, value in combo_options(backend, opt, args, out, verb).items():
        flag = "--" + key.replace("_", "-")
        cmd += [flag] if value is True else [flag, value]
    for item in args.get("sets") or ():
        cmd += ["--set", item]
    return cmd


def refused_here(backend: str, opt: str, args: Dict[str, Any], out: Path) -> Optional[str]:
    """Why ``kd train`` refuses a combination whose backend cannot run on this machine at all (dp
    without CUDA), found without starting its process: its options are checked as kd train checks
    them, then its backend's checks before any work give the line. None where the backend can run
    here, or where kd train would refuse the options first: the combination's process says why."""
    backends = own("backends")
    if backend not in backends.BACKENDS or backends.get(backend).unavailable() is None:
        return None
    from kd import config as kd_config
    from kd.run.jobs import TrainJob
    from kd.run.launch import processes_here
    from kd.run.students import for_command

    options = combo_options(backend, opt, args, out)
    try:
        kd_config.refuse_unused(options)
        job = TrainJob(for_command((), options, args.get("sets") or (), overwrite=True))
        job.check_early(overwrite=True)
    except KDError:
        return None
    try:
        processes_here(job.cfg, backends.get(backend))
    except KDError as exc:
        return str(exc)
    return None


def run_combo(
    backend: str, opt: str, args: Dict[str, object], out: Path, timeout: Optional[float], verb: str = "train"
) -> Dict[str, object]:
    row: Dict[str, object] = {"backend": backend, "opt": opt}
    refused = refused_here(backend, opt, args, out) if verb == "train" else None
    if refused:
        return {**row, "note": refused[:200]}
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        proc = subprocess.run(
            combo_command(backend, opt, args, out, verb), capture_output=True, text=True, env=env, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {**row, "note": f"timed out after {timeout:.0f}s"}
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.startswith("kd: error:")]
        why = lines[-1][len("kd: error: ") :] if lines else (proc.stderr.strip().splitlines() or ["failed"])[-1]
        return {**row, "note": why[:200]}
    if verb == "teach":  # the store's log of its teaching: the timed batches where there were enough
        from kd.teacher.store import teaching_log

        record = teaching_log(out)[-1]
        record.setdefault("timed_img_per_s", record["img_per_s"])
        record.setdefault("s_per_20_iters", 20 * record["seconds"] / max(record["batches"], 1))
    else:
        run = RunFolder(out)
        if not run.is_run():  # several students: each its own folder, each timed on the same steps
            run = RunFolder(out / str(args["kd_loss"]).split(",")[0])
        record = run.records()[-1]
    lines = [
        line.split("] ", 1)[1] if line.startswith("[") and "] " in line else line for line in proc.stderr.splitlines()
    ]
    said = list(dict.fromkeys(line for line in lines if line.startswith(("backend ", "precision "))))
    impl, note = implementation(said)
    row.update(
        s_per_20_iters=round(record["s_per_20_iters"], 3),
        img_per_s=round(record["timed_img_per_s"], 1),
        peak_mem_gb="/".join(f"{m:.2f}" for m in record.get("peak_mem_gb", [])) or "-",
        impl=impl,
        note=note,
        described=said,  # in bench.json only: the whole of what the combination said it ran
    )
    return row


def implementation(said: Sequence[str]) -> Tuple[str, str]:
    """``(impl, note)`` of a combination from the precision and backend lines it logged (their
    ``describe()``). impl names what ran in a word or two: the opt level's implementation (``native``
    or ``apex``), and apex_ddp's all-reduce (``+ apex.parallel``, or ``+ kd all-reduce`` where it ran
    kd's own). The note keeps what the other columns do not say: the reduced dtype, the processes
    of a multi-process backend, find_unused_parameters, and why apex did not run where it was wanted."""
    precision = next((line for line in reversed(said) if line.startswith("precision ")), "")
    backend = next((line for line in reversed(said) if line.startswith("backend ")), "")
    inside = precision[precision.find("(") + 1 : precision.rfind(")")] if ")" in precision else ""
    impl = inside.split(", ")[0]
    notes = re.findall(r"\bb?float16\b", inside)[:1]
    processes = re.match(r"backend \S+: (\d+) process", backend)
    if processes and int(processes.group(1)) > 1:
        notes.append(f"{processes.group(1)} processes")
    if "find_unused_parameters=True" in backend:
        notes.append("find_unused_parameters")
    notes += re.findall(r"not apex\.amp: .*", inside)
    if "real apex.parallel" in backend:
        impl += " + apex.parallel"
    native = re.search(r"kd's native delayed all-reduce \((.*)\)", backend)
    if native:
        impl += " + kd all-reduce"
        notes.append(native.group(1).split(";")[0])
    return impl, "; ".join(notes).replace("|", "/")


def bench(
    backends: Sequence[str],
    opts: Sequence[str],
    args: Dict[str, Any],
    out: Optional[Path] = None,
    timeout: Optional[float] = None,
) -> List[Dict[str, object]]:
    """All combinations; a combination that cannot run shows why in its row."""
    if args.get("iters", 0) < 1 or args.get("warmup", 0) < 1:
        raise KDError("--iters and --warmup must be at least 1")
    methods = [m for m in args.get("methods") or () if m]
    check_methods(methods)
    vs_synthetic = bool(args.get("vs_synthetic"))
    if vs_synthetic and args.get("data", "synthetic") == "synthetic":
        raise KDError("--vs-synthetic compares a run on --data DIR with one on synthetic tensors: give --data DIR")
    if vs_synthetic and methods:
        raise KDError("--vs-synthetic times one method per combination: leave out --methods")
    vs_store = bool(args.get("vs_store"))
    if vs_store and (methods or vs_synthetic):
        raise KDError(
            "--vs-store times one method per combination on one input: leave out --methods and --vs-synthetic"
        )
    top_k = str(args.get("top_k") or "10")
    if vs_store and top_k != "all" and not (top_k.isdigit() and int(top_k) >= 1):
        raise KDError(f"--top-k must be a positive number or all, got {top_k!r}")
    from kd.data.layout import check_data

    check_data(str(args.get("data", "synthetic")))  # once here, not as the same note in every row
    out = Path(out or tempfile.mkdtemp(prefix="kd-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    warn_slow_cpu_precision(opts, args)
    if methods:
        return bench_methods(backends, opts, methods, args, out, timeout)
    if vs_store:
        return bench_store(backends, opts, args, out, timeout)
    rows: List[Dict[str, Any]] = []
    for backend in backends:
        for opt in opts:
            print(f"kd bench: {backend} {opt} ...", file=sys.stderr, flush=True)
            rows.append(run_combo(backend, opt, args, out / "runs" / f"{backend}_{opt}", timeout))
            if vs_synthetic and "img_per_s" in rows[-1]:  # a folder run that failed has no share to give
                print(f"kd bench: {backend} {opt} on synthetic tensors ...", file=sys.stderr, flush=True)
                on_synthetic = {**args, "data": "synthetic", "loader": None, "workers": None}
                synthetic = run_combo(backend, opt, on_synthetic, out / "runs" / f"{backend}_{opt}_synthetic", timeout)
                add_synthetic(rows[-1], synthetic)
    base = next((r for r in rows if r["backend"] == "dp" and r["opt"] == "O0" and "img_per_s" in r), None)
    base = base or next((r for r in rows if "img_per_s" in r), None)
    for r in rows:
        r["speedup"] = round(r["img_per_s"] / base["img_per_s"], 2) if base and "img_per_s" in r else "-"
        r.setdefault("methods", args.get("kd_loss") or "kd")
        for c in COLUMNS + (SYNTHETIC_COLUMNS if vs_synthetic else []):
            r.setdefault(c, "-")
    write_outputs(
        rows, out, f"{base['backend']} {base['opt']}" if base else "-", setting=setting_of(args), device=device_of(args)
    )
    drop_runs(out, args)
    return rows


def check_methods(methods: Sequence[str]) -> None:
    """``--methods``: each a KD method, none twice; a KDError naming the first that is not, before any run."""
    from kd.losses import check_method

    for i, name in enumerate(methods):
        check_method(name)
        if name in methods[:i]:
            raise KDError(f"--methods names {name} twice; each student needs its own method")


def drop_runs(out: Path, args: Dict[str, Any]) -> None:
    """The combinations' run folders (checkpoints and logs of short runs, hundreds of MB) go once the
    table is written, unless ``--keep-runs``."""
    runs = out / "runs"
    if args.get("keep_runs") or not runs.is_dir():
        return
    shutil.rmtree(runs, ignore_errors=True)
    print(f"kd bench: removed the combinations' runs in {runs} (--keep-runs keeps them)", file=sys.stderr, flush=True)


def add_synthetic(row: Dict[str, Any], synthetic: Dict[str, object]) -> None:
    """``row`` (a run on a folder) gains the synthetic run's img/s and its own share of it, in %."""
    folder_rate, rate = row.get("img_per_s"), synthetic.get("img_per_s")
    row["synthetic_img_per_s"], row["of_synthetic_pct"] = "-", "-"
    if not isinstance(rate, (int, float)):  # the synthetic run failed: its reason beside the row's own
        row["note"] = "; ".join(n for n in (row.get("note"), f"synthetic: {synthetic.get('note')}") if n)
        return
    row["synthetic_img_per_s"] = rate
    if isinstance(folder_rate, (int, float)) and rate > 0:
        row["of_synthetic_pct"] = round(100 * folder_rate / rate, 1)


def columns(rows: Sequence[Dict[str, object]]) -> List[str]:
    """COLUMNS, with SYNTHETIC_COLUMNS after img_per_s where the rows have them, or the teacher
    after opt and of_alone_pct after img_per_s (STORE_COLUMNS)."""
    out = list(COLUMNS)
    at = out.index("img_per_s") + 1
    if any(SYNTHETIC_COLUMNS[0] in r for r in rows):
        out[at:at] = SYNTHETIC_COLUMNS
    if any(STORE_COLUMNS[0] in r for r in rows):
        out[at:at] = STORE_COLUMNS[1:]
        out.insert(out.index("opt") + 1, STORE_COLUMNS[0])
    return out


def bench_methods(
    backends: Sequence[str],
    opts: Sequence[str],
    methods: Sequence[str],
    args: Dict[str, object],
    out: Path,
    timeout: Optional[float],
) -> List[Dict[str, object]]:
    """``kd bench --methods kd,dkd,...``: per backend and opt level, the students trained together
    (one teacher forward per batch) against each trained alone. The together row's img/s is each
    student's; its speed-up is the time of the separate runs over the time together
    (img/s together x the sum over methods of 1 / img/s alone)."""
    rows = []
    for backend in backends:
        for opt in opts:
            group = []
            for label in [",".join(methods), *methods]:
                print(f"kd bench: {backend} {opt} {label} ...", file=sys.stderr, flush=True)
                folder = out / "runs" / f"{backend}_{opt}_{label.replace(',', '+')}"
                row = run_combo(backend, opt, {**args, "kd_loss": label}, folder, timeout)
                group.append({**row, "methods": label})
            together, alone = group[0], group[1:]
            ok = "img_per_s" in together and all("img_per_s" in r for r in alone)
            if ok:  # run_combo's img_per_s, where it has one, is a float
                rate = cast(float, together["img_per_s"])
                together["speedup"] = round(rate * sum(1 / cast(float, r["img_per_s"]) for r in alone), 2)
            else:
                together["speedup"] = "-"
            for r in alone:
                r["speedup"] = 1.0 if "img_per_s" in r else "-"
            rows += group
    for r in rows:
        for c in COLUMNS:
            r.setdefault(c, "-")
    write_outputs(rows, out, "each method alone", setting=setting_of(args), device=device_of(args))
    drop_runs(out, cast(Dict[str, Any], args))
    return rows


def bench_store(
    backends: Sequence[str], opts: Sequence[str], args: Dict[str, Any], out: Path, timeout: Optional[float]
) -> List[Dict[str, object]]:
    """``kd bench --vs-store``: per backend and opt level, the student with the live teacher, the
    teaching of a soft-label store on the same input (``kd teach``), the student from that store,
    and the student alone (``--no-teacher``). Speed-ups are against the live teacher; each row's
    img/s is also given as a % of the student alone. The store row's note says after how many
    student runs the teaching is repaid: ``n`` with ``n / live = 1 / teach + n / store``."""
    rows: List[Dict[str, Any]] = []
    k = args.get("top_k") or "10"
    for backend in backends:
        for opt in opts:
            runs = out / "runs" / f"{backend}_{opt}"
            store = runs / "store"
            shutil.rmtree(store, ignore_errors=True)  # a store of an earlier bench would be continued, not timed
            ways: List[Tuple[str, str, str, Dict[str, Any]]] = [  # the row's teacher, command, folder, options
                (f"{args.get('teacher')} (live)", "train", "live", {}),
                ("kd teach", "teach", "store", {"top_k": k}),
                (f"store (top-k {k})", "train", "from_store", {"teacher": None, "soft_labels": str(store)}),
                ("none (--no-teacher)", "train", "alone", {"teacher": None, "no_teacher": True}),
            ]
            group = []
            for label, verb, folder, change in ways:
                print(f"kd bench: {backend} {opt} {label} ...", file=sys.stderr, flush=True)
                row = run_combo(backend, opt, {**args, **change}, runs / folder, timeout, verb)
                row.update(
                    teacher=label,
                    methods="-" if "no_teacher" in change or verb == "teach" else args.get("kd_loss") or "kd",
                )
                if verb == "teach" and "img_per_s" in row:
                    from kd.teacher.store import read_manifest

                    row["impl"] = f"teacher {read_manifest(store).get('teacher_precision')}"  # top-k: the store row's
                group.append(row)
            live, teach, stored, alone = (r.get("img_per_s") for r in group)
            for r in group:
                rate = r.get("img_per_s")
                if isinstance(rate, float) and isinstance(live, float):
                    r["speedup"] = round(rate / live, 2)
                if isinstance(rate, float) and isinstance(alone, float) and r is not group[1]:
                    r["of_alone_pct"] = round(100 * rate / alone, 1)
            if all(isinstance(x, float) for x in (live, teach, stored)):
                gain = 1 / cast(float, live) - 1 / cast(float, stored)
                group[2]["note"] = (
                    f"teaching repaid after {(1 / cast(float, teach)) / gain:.1f} student run(s) of its epochs"
                    if gain > 0
                    else "no faster than the live teacher"
                )
            rows += group
    for r in rows:
        for c in COLUMNS + STORE_COLUMNS:
            r.setdefault(c, "-")
    write_outputs(rows, out, f"{args.get('teacher')} (live)", setting=setting_of(args), device=device_of(args))
    drop_runs(out, args)
    return rows


def warn_slow_cpu_precision(opts: Sequence[str], args: Dict[str, object]) -> None:
    """The slow-bfloat16 warning of a CPU run, once (each row's own log is not shown)."""
    import torch

    from kd.precision.cpu import slow_precision_warning

    if args.get("device") == "cpu" or (args.get("device") in (None, "auto") and not torch.cuda.is_available()):
        for opt in opts:
            warning = slow_precision_warning(opt, torch.float32 if opt == "O0" else torch.bfloat16, torch.device("cpu"))
            if warning:
                print(f"kd bench: {warning}", file=sys.stderr, flush=True)
                return


def markdown(rows: List[Dict[str, object]]) -> str:
    return table.markdown(rows, columns(rows))


def setting_of(args: Dict[str, Any]) -> str:
    """What every combination of a bench trains, for its chart's title and bench.json:
    ``resnet101 -> resnet18, batch 256, 224 px, synthetic data``."""
    data = str(args.get("data") or "synthetic")
    where = "synthetic data" if data == "synthetic" else f"data {Path(data).name}"
    teacher = args.get("teacher") or "no teacher"
    return f"{teacher} -> {args.get('student')}, batch {args.get('batch_size')}, {args.get('image_size')} px, {where}"


def device_of(args: Dict[str, Any]) -> str:
    """Where the combinations ran, for the chart's title and bench.json: ``cpu``, or the model of
    the GPUs (those of ``--gpus``, else the visible ones), as ``--device`` resolves in ``kd train``."""
    import torch

    gpus = [int(g) for g in str(args.get("gpus") or "").split(",") if g.strip().isdigit()]
    device = args.get("device") or "auto"
    if device == "cpu" or (device == "auto" and not gpus and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        return "cuda (not usable here)"
    count = torch.cuda.device_count()
    names = ", ".join(dict.fromkeys(torch.cuda.get_device_name(i) for i in gpus or range(count) if i < count))
    return f"GPUs {','.join(map(str, gpus))}: {names}" if gpus else names or "cuda"


def write_outputs(
    rows: List[Dict[str, object]], out: Path, baseline: str, note=None, setting: str = "", device: str = ""
) -> None:
    """bench.json, bench.csv, bench.md and the chart bench.png, titled with the ``setting`` and the
    ``device``; ``note`` hears (stderr by default) when the chart cannot be drawn, as matplotlib is
    missing."""
    said = {"setting": setting, "device": device} if setting or device else {}
    (out / "bench.json").write_text(json.dumps({"baseline": baseline, **said, "rows": rows}, indent=2))
    with open(out / "bench.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns(rows), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (out / "bench.md").write_text(markdown(rows) + "\n")
    from kd.commands.report import pyplot

    try:
        plt = pyplot()
    except KDError as exc:
        (note or (lambda line: print(f"kd bench: {line}", file=sys.stderr, flush=True)))(f"no bench.png: {exc}")
        return
    ok = [r for r in rows if isinstance(r.get("img_per_s"), (int, float))]
    fig, ax = plt.subplots(figsize=(max(5.5, 1.1 * len(ok)), 3.8))
    ax.bar(range(len(ok)), [r["img_per_s"] for r in ok], color="#4a7ab7")
    # one label per bar, slanted so that long ones (backend, level, methods) do not overlap
    ax.set_xticks(
        range(len(ok)),
        [f"{r['backend']} {r['opt']} {r.get('teacher', r.get('methods', ''))}".strip() for r in ok],
        rotation=30,
        ha="right",
        fontsize=8,
    )
    ax.set_ylabel("images/s per student")
    title = "kd bench" + (f": {setting}" if setting else "") + (f"\n{device}" if device else "")
    ax.set_title(title if ok else f"{title}\nno combination ran", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "bench.png", dpi=120)
    plt.close(fig)


def bench_data(options: Dict[str, object], epochs: int, echo=print, split: str = "train") -> List[Dict[str, float]]:
    """``kd bench data``: images/s of the training (or val) loader alone, per epoch (or pass).

    The loader is the one ``kd train`` builds (sampling, decode, crop, flip, normalisation
    and the copy to the device, all of it); batches are consumed and dropped. Epoch 1
    includes starting the workers; later epochs show the steady rate, and for ``split="val"``
    the val crops kept in memory (``--val-cache-gb``).
    """

    import torch

    if epochs < 1:
        raise KDError("--epochs must be at least 1")
    if split not in ("train", "val"):
        raise KDError(f"--split must be train or val, got {split!r}")
    data, device = build_loaders(options)
    loader = data.train if split == "train" else data.val
    echo(loader.describe())

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    try:
        return _time_passes(loader, epochs, split, sync, echo)
    finally:
        data.close()


def build_loaders(options: Dict[str, object]):
    """The train and val loaders ``kd train`` builds for ``options`` (a ``--data DIR`` run), without
    its models, in this one process: ``(kd.data.Data, device)``."""
    from kd import config as kd_config
    from kd.data import build
    from kd.run.runtime import resolve as resolve_runtime

    # the models are not built; names only satisfy the config's validation
    cfg = kd_config.resolve(options={"teacher": "resnet18", "student": "resnet18", **options})
    if cfg.data == "synthetic":
        raise KDError("kd bench data needs --data DIR (an ImageNet-layout folder), not synthetic")
    device = own("backends").base.resolve_device(cfg)
    return build(cfg, 1, 0, cfg.batch_size, device, resolve_runtime(cfg, device).channels_last), device


def _time_passes(loader, epochs: int, split: str, sync, echo) -> List[Dict[str, float]]:
    import time

    rows = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        sync()
        start, first, images = time.perf_counter(), None, 0
        for batch in loader:
            if first is None:
                sync()
                first = time.perf_counter() - start
            images += len(batch)
        sync()
        seconds = time.perf_counter() - start
        row = {
            "epoch": epoch + 1,
            "images": images,
            "seconds": seconds,
            "img_per_s": images / max(seconds, 1e-9),
            "first_batch_s": first or 0.0,
        }
        rows.append(row)
        echo(
            f"{'epoch' if split == 'train' else 'pass'} {epoch + 1}: {images} images in {seconds:.2f}s, "
            f"{row['img_per_s']:,.0f} images/s (first batch after {row['first_batch_s']:.2f}s)"
        )
    return rows
