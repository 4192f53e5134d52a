"""``kd report OUT...``: several runs' metrics.jsonl as one table (markdown and CSV); with
``--provenance``, what each was made of (its provenance.json).

A path is a run folder (it holds ``metrics.jsonl``) or a folder of runs, searched below. Two
times: ``wall_time``, from the ``kd`` command's start to the run's end with every resumed part
added (start-up, probes and validation included: what the run cost), and ``train_time``, the
epochs' training seconds only.
"""

from __future__ import annotations

import csv
import io
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kd.commands import table
from kd.errors import KDError, writing
from kd.run import paper_setting
from kd.run.log import unended_parts, wall_parts
from kd.run.paper_setting import Departure
from kd.runfolder import RunFolder

COLUMNS = [
    "run",
    "method",
    "teacher",
    "student",
    "epochs",
    "best_top1",
    "best_top5",
    "last_top1",
    "last_top5",
    "val_images",
    "reference_top1",
    "diff",
    "paper_setting",
    "wall_time",
    "train_time",
]
CSV_COLUMNS = COLUMNS[:-2] + ["wall_s", "train_s"]  # seconds for programs, as the markdown's "12m" is for people
#: the moving average's top-1 (--model-ema), after last_top5 where a run has one
EMA_COLUMNS = ["best_top1_ema", "last_top1_ema"]


def columns(rows: Sequence[Dict[str, object]], base: Sequence[str]) -> List[str]:
    """``base`` with :data:`EMA_COLUMNS` after last_top5 where a row has them."""
    out = list(base)
    if any(EMA_COLUMNS[0] in row for row in rows):
        at = out.index("last_top5") + 1
        out[at:at] = EMA_COLUMNS
    return out


def ema_top1(evals: List[Dict[str, Any]]) -> Dict[str, object]:
    """The best and last top-1 of the moving average over the evaluated epochs (none without it)."""
    averaged = [r["val_top1_ema"] for r in evals if "val_top1_ema" in r]
    if not averaged:
        return {}
    return {"best_top1_ema": round(max(averaged), 2), "last_top1_ema": round(averaged[-1], 2)}


def duration(seconds: float) -> str:
    """A duration a person reads: 42s, 4.5m, 12m, 3.4h."""
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 600:
        return f"{seconds / 60:.1f}m"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def saved_config(folder: RunFolder) -> Dict[str, Any]:
    """A run's config.yaml as written (empty where it has none); a damaged one is one line."""
    from kd.config import load_yaml

    return load_yaml(folder.config, "saved config") if folder.config.is_file() else {}


def collect(run: Path) -> Dict[str, object]:
    folder = RunFolder(run)
    if not folder.is_run():
        raise KDError(f"{run} has no metrics.jsonl (is it a kd run folder?)")
    records = folder.records()
    evals = [r for r in records if "val_top1" in r]
    if not evals:
        raise KDError(f"{run} has no evaluated epoch yet")
    cfg = saved_config(folder)
    best = max(evals, key=lambda r: r["val_top1"])
    train = sum(r.get("seconds", 0.0) for r in records)
    parts = wall_parts(run)
    wall = sum(part["seconds"] for part in parts) if parts else None  # None: a run of a kd that did not time it
    unended = unended_parts(run)
    last = evals[-1]
    ref, why = paper_reference(cfg, records)
    stored = " (stored)" if cfg.get("soft_labels") else ""  # its outputs from a kd teach store
    return {
        "run": str(run),
        "method": "ce" if cfg.get("no_teacher") else cfg.get("kd_loss", "?"),  # the student alone: --kd-loss ce
        "teacher": "-" if cfg.get("no_teacher") else f"{cfg.get('teacher', '?')}{stored}",
        "student": cfg.get("student", "?"),
        "epochs": f"{records[-1]['epoch']}/{cfg.get('epochs', '?')}",
        "best_top1": round(best["val_top1"], 2),
        "best_top5": round(best["val_top5"], 2),
        "last_top1": round(last["val_top1"], 2),
        "last_top5": round(last["val_top5"], 2),
        **ema_top1(evals),
        "val_images": images_over(last),
        "reference_top1": ref if ref is not None else "-",
        "diff": round(best["val_top1"] - ref, 2) if ref is not None else "-",
        # the classes the run trained (its config leaves the folder's count out)
        "paper_setting": paper_setting.cell(
            {**cfg, "num_classes": last.get("classes", cfg.get("num_classes"))},
            method_defaults,
            lambda recipe: setting_gaps(cfg, recipe, records),
        )
        if cfg
        else "-",
        "wall_time": (duration(wall) + ("+" if unended else "")) if wall is not None else "-",
        "train_time": duration(train),
        "wall_s": round(wall, 1) if wall is not None else "",
        "train_s": round(train, 1),
        "_no_reference": why,
        # for the paper's table (kd.commands.paper): the teacher's accuracy as this run measured it
        "_teacher_top1": records[0].get("teacher_top1"),
        "_teacher_top5": records[0].get("teacher_top5"),
        "_teacher_weights": cfg.get("teacher_weights"),
        "_teacher_sha256": teacher_sha256(run),
        # what a student-alone row must share with the students it heads (kd.commands.paper)
        "_setting": {key: cfg.get(key) for key in ("data", "epochs", "batch_size")},
        "_standardised": paper_setting.standardised(cfg),
        "_dot": bool(cfg.get("dot")),
        "_imagenet": bool(records) and records[0].get("train_images", 0) >= 0.99 * IMAGENET_TRAIN_IMAGES,
        "_no_wall": None if parts or unended else "no wall.jsonl (a run of an older kd): its wall time is not known",
        "_unended": (
            f"wall_time leaves out {len(unended)} part(s) that began ({', '.join(_clock(t) for t in unended)}) and "
            "wrote no end (killed outright, or still running): the run took longer"
            if unended
            else None
        ),
    }


def teacher_sha256(run: Path) -> Optional[str]:
    """The SHA-256 of the teacher's weights as the run's provenance.json recorded them (None without one)."""
    from kd.run import provenance

    try:
        parts = provenance.load(run)
    except KDError:  # a damaged one: kd report --provenance says so; the weights are told apart by name
        return None
    teacher = parts[0].get("teacher") if parts else None
    return teacher.get("sha256") if teacher else None


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def images_over(record: Dict[str, Any]) -> str:
    """What a record's accuracy is over: ``20`` or ``20 (2 unreadable)``; ``-`` for a run of a kd
    that did not count them."""
    if "val_images" not in record:
        return "-"
    bad = int(record.get("val_unreadable", 0))
    return f"{int(record['val_images'])}" + (f" ({bad} unreadable)" if bad else "")


def val_count(record: Dict[str, Any]) -> str:
    """`` (20 val images, 2 unreadable)`` for the summary line; "" for a run of a kd that did not count them."""
    if "val_images" not in record:
        return ""
    return f" ({int(record['val_images'])} val images, {int(record.get('val_unreadable', 0))} unreadable)"


def summary_line(run: Path, seconds: float, name: str = "") -> str:
    """The line ``kd train`` ends with: best and last top-1, the wall time (of a resumed run: this
    part's, and the run's in all), the run folder and the best checkpoint (what a user opens next).
    ``seconds`` is this part's time where its wall.jsonl has none (a run of an older kd)."""
    folder = RunFolder(run)
    records = folder.records()
    evals = [r for r in records if "val_top1" in r]
    prefix = f"[{name}] " if name else ""
    epochs = f"{records[-1]['epoch']} epoch(s)" if records else "no epoch"
    if not evals:
        return f"{prefix}done: {epochs} in {duration(seconds)}; run {run}"
    best, last = max(evals, key=lambda r: r["val_top1"]), evals[-1]
    # a run continued from another folder's checkpoint writes best.pt only where it beats the best it inherited
    checkpoint = (
        f"best checkpoint {folder.best}" if folder.best.is_file() else f"last checkpoint {folder.last} (no best.pt)"
    )
    parts, unended = wall_parts(run), unended_parts(run)
    if parts:  # this part's line, just written: timed from the command's start, as kd report sums them
        seconds = parts[-1]["seconds"]
    if unended:  # a part before this one was killed outright: its time is not known
        known = duration(sum(p["seconds"] for p in parts))
        took = f"{duration(seconds)} (more than {known} in all: {len(unended)} earlier part(s) wrote no end)"
    elif len(parts) > 1:  # a resumed run: this part's time, and the run's
        took = f"{duration(seconds)} ({duration(sum(p['seconds'] for p in parts))} in all, {len(parts)} parts)"
    else:
        took = duration(seconds)
    ema = ema_top1(evals)
    averaged = ""
    if ema:
        averaged = f"; moving average: best top-1 {ema['best_top1_ema']:.2f}, last {ema['last_top1_ema']:.2f}"
    return (
        f"{prefix}done: best top-1 {best['val_top1']:.2f} at epoch {best['epoch']}, last top-1 "
        f"{last['val_top1']:.2f} at epoch {last['epoch']}{val_count(last)}{averaged}, {took}; "
        f"run {run}, {checkpoint}"
    )


#: ImageNet-1k's training images: a run made from a recipe is the paper's setting only on them.
IMAGENET_TRAIN_IMAGES = 1_281_167
#: Recipe keys that do not change what is measured (where and how fast it runs).
NOT_THE_SETTING = {
    "description", "reference", "data", "out", "compile", "compile_mode", "opt", "amp_dtype", "amp_impl",
    "workers", "loader", "progress_bar", "log_every", "eval_every", "save_every_steps", "keep_last",
    "gpus", "backend", "device", "nproc", "recipe",
}  # fmt: skip


#: settings of the trainer, not the method, that a recipe leaves out where they are off
TRAINER_SWITCHES = ("dot", "drop_path")


def setting_gaps(cfg: Dict[str, Any], recipe: Dict[str, Any], records: List[Dict[str, Any]]) -> List[Departure]:
    """Where a run (its config as a dict, its metrics.jsonl records) departs from ``recipe``'s setting:
    data other than ImageNet-1k first, then each setting key, trainer switch or hyper-parameter given
    outside the recipe's keys (``--logit-standardisation``) that differs."""
    from kd.config import cli_value

    gaps: List[Departure] = []
    gaps += data_gaps(cfg, records[0] if records else {})
    differ = [k for k in recipe if k not in NOT_THE_SETTING and cfg.get(k) != recipe[k]]
    # a trainer switch a recipe may leave out (off there) changes the setting all the same
    differ += [k for k in TRAINER_SWITCHES if k not in recipe and cfg.get(k)]
    if not differ:
        ran, published = _loss_settings(cfg), _loss_settings(recipe)
        differ = [f"loss_args.{k}" for k in sorted(set(ran) | set(published)) if ran.get(k) != published.get(k)]
        cfg = {**cfg, **{f"loss_args.{k}": v for k, v in ran.items()}}
        recipe = {**recipe, **{f"loss_args.{k}": v for k, v in published.items()}}
    for k in differ:
        ours, theirs = cfg.get(k), recipe.get(k)
        words = f"{k} {ours!r}" + (f" (recipe: {theirs!r})" if k in recipe else "")
        short = f"{k} {cli_value(ours)}" + (f" ({cli_value(theirs)})" if k in recipe else "")
        gaps.append(Departure(k, short, words))
    return gaps


def data_gaps(cfg: Dict[str, Any], first: Dict[str, Any]) -> List[Departure]:
    """Where a run's training data departs from ImageNet-1k (its first record): a folder of fewer images,
    and, as a reason of its own, fewer images trained an epoch than the folder holds (--limit-train-batches)."""
    trained, held = first.get("train_images"), first.get("train_set_images")
    gaps: List[Departure] = []
    if held is not None and held < 0.99 * IMAGENET_TRAIN_IMAGES:
        words = f"its data holds {int(held):,} training images, not ImageNet-1k's {IMAGENET_TRAIN_IMAGES:,}"
        gaps.append(Departure("train_images", f"not ImageNet ({int(held):,} train images)", words))
    limit = cfg.get("limit_train_batches")
    if held is None and trained is not None and trained < 0.99 * IMAGENET_TRAIN_IMAGES:  # a run of an older kd
        words = f"trained on {int(trained):,} images an epoch, not ImageNet-1k's {IMAGENET_TRAIN_IMAGES:,}"
        counted = f"{int(trained):,} images an epoch" if limit else f"{int(trained):,} train images"
        gaps.append(Departure("train_images", f"not ImageNet ({counted})", words))
    if limit and trained is not None and (held is None or trained < held):
        words = f"trained {int(trained):,} images an epoch" + (f" of its {int(held):,}" if held else "")
        flag = f"--limit-train-batches {limit}"
        gaps.append(Departure("limit_train_batches", flag, f"{words} ({flag})"))
    return gaps


def paper_reference(cfg: Dict[str, Any], records: List[Dict[str, Any]]) -> Tuple[Optional[float], Optional[str]]:
    """(the recipe's published top-1, None) for a run of that recipe's setting on ImageNet, else
    (None, why not) where the run's recipe has a reference: another model, method, hyper-parameter
    or epoch count than the recipe's, or other data (an epoch of fewer images than ImageNet's)."""
    ref = (cfg.get("reference") or {}).get("top1")
    if ref is None:
        return None, None
    name = cfg.get("recipe")
    recipe = _named_recipe(name)
    if not recipe:
        return None, f"its recipe {name} is not found here, so its setting cannot be checked"
    gaps = setting_gaps(cfg, recipe, records)
    keys = [gap for gap in gaps if gap.key != "train_images"]
    if keys:
        shown = ", ".join(gap.words for gap in keys[:3])
        return None, f"not the setting of recipe {name}: {shown}{' ...' if len(keys) > 3 else ''}"
    if gaps:
        return None, gaps[0].words
    return ref, None


def _named_recipe(name: Any) -> Dict[str, Any]:
    """The values of the recipe a run names ({} where it names none or it is not found here)."""
    try:
        from kd.config import find_recipe, load_yaml

        return load_yaml(find_recipe(str(name))) if name else {}
    except KDError:
        return {}


def method_defaults(method: str) -> Dict[str, Any]:
    """A KD method's default hyper-parameters (none for a name no method has)."""
    from kd.losses import LOSSES

    return dict(LOSSES.get(method).defaults) if method in LOSSES.names() else {}


def _loss_settings(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The hyper-parameters a config gives its method (loss_args and the loss options, over the method's
    defaults), so that a switch given outside the recipe's keys counts too."""
    from kd.config import LOSS_OPTIONS

    method = cfg.get("kd_loss", "kd")
    given = {**(cfg.get("loss_args") or {}), **{k: cfg[k] for k in LOSS_OPTIONS if cfg.get(k) is not None}}
    defaults = method_defaults(method)
    return {k: float(v) if isinstance(v, (bool, int, float)) else v for k, v in {**defaults, **given}.items()}


MAX_DEPTH = 3  # folder levels searched below a path (runs/<group>/<run>/ is 2): a dataset beside the runs is not walked


def _runs_below(path: Path, depth: int = 0) -> List[Path]:
    if RunFolder(path).is_run():
        return [path]
    if depth >= MAX_DEPTH or not path.is_dir():
        return []
    with os.scandir(path) as entries:  # DirEntry.is_dir() needs no stat per file
        children = sorted(Path(e.path) for e in entries if e.is_dir() and not e.name.startswith("."))
    return [run for child in children for run in _runs_below(child, depth + 1)]


def find_runs(path: Path, note: Callable[[str], None]) -> List[Path]:
    """``path`` if it is a run folder (it holds metrics.jsonl), else the run folders below it;
    ``note`` hears about each folder in ``path`` that holds no run (not about its files: a run of
    several students keeps its students.yaml there)."""
    if not path.exists():
        raise KDError(f"{path} does not exist")
    found = _runs_below(path)
    if not found:
        what = "not a run folder" if not path.is_dir() else "no metrics.jsonl in it or below it (not a kd run)"
        note(f"skipped {path}: {what}")
    elif found != [path]:
        for child in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if not any(run == child or child in run.parents for run in found):
                note(f"skipped {child}: no run in it")
    return found


def report(runs: Sequence[Path], note: Optional[Callable[[str], None]] = None) -> List[Dict[str, object]]:
    """One row per run found in ``runs`` (run folders or folders of runs); ``note`` hears what was skipped."""
    skipped: List[str] = []
    rows = []
    for run in [run for path in runs for run in find_runs(Path(path), skipped.append)]:
        try:
            row = collect(run)
        except KDError as exc:  # a run that has not evaluated yet, a broken metrics.jsonl
            skipped.append(f"skipped {run}: {exc}")
            continue
        why = row.pop("_no_reference")
        if why:
            skipped.append(f"{run}: no paper reference shown, {why}")
        unended = row.pop("_unended")
        if unended:
            skipped.append(f"{run}: {unended}")
        no_wall = row.pop("_no_wall")
        if no_wall:
            skipped.append(f"{run}: wall_time -, {no_wall}; train_time is its epochs' training seconds")
        rows.append(row)
    if not rows:
        reasons = "; ".join(s[len("skipped ") :] for s in skipped[:3]) or "no path given"
        raise KDError(f"no kd run to report: {reasons}{' ...' if len(skipped) > 3 else ''}")
    if note is not None:
        for line in skipped:
            note(line)
    return rows


MATPLOTLIB_MISSING = (
    "matplotlib is not installed, and kd draws its figures with it: pip install matplotlib "
    "(a dependency of kd: pip install -e . in this clone installs it too)"
)


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display), or a KDError saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KDError(MATPLOTLIB_MISSING) from None
    return plt


def plot(runs: Sequence[Path], path: Path, note: Optional[Callable[[str], None]] = None) -> Path:
    """The figure of a table (:func:`figure`) written to ``path``."""
    plt = pyplot()
    fig = figure(runs, note)
    path = Path(path)
    try:
        with writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
    return path


def figure(runs: Sequence[Path], note: Optional[Callable[[str], None]] = None):
    """The matplotlib figure of a table: val top-1 per epoch of each run found in ``runs`` (with its
    recipe's paper reference as a dashed line of the same colour), and its train loss per epoch on a
    log axis (a FitNet loss of hundreds beside KD losses of a few); each run its own colour and line
    style. ``note`` hears what is skipped, and losses a log axis cannot show."""
    plt = pyplot()
    tell = note or (lambda line: None)
    found = [run for p in runs for run in find_runs(Path(p), tell)]
    if not found:
        raise KDError("no kd run to plot")
    fig, (top1, loss) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = run_labels(found)
    dashed = False
    for run, label, (color, style) in zip(found, names, run_styles(len(found))):
        folder = RunFolder(run)
        records, cfg = folder.records(), saved_config(folder)
        look = dict(color=color, linestyle=style, marker=".", label=label)
        evals = [r for r in records if "val_top1" in r]
        top1.plot([r["epoch"] for r in evals], [r["val_top1"] for r in evals], **look)
        ref, _ = paper_reference(cfg, records)
        if ref is not None:
            dashed = True
            top1.axhline(ref, color=color, linestyle="--", linewidth=1, label=f"{label}: paper {ref}")
        trained = [r for r in records if "train_loss" in r]
        shown = [r for r in trained if r["train_loss"] > 0]  # NaN too: neither has a place on a log axis
        if len(shown) < len(trained):
            tell(f"{label}: {len(trained) - len(shown)} epoch(s) of train loss 0, below or NaN left off the log axis")
        loss.plot([r["epoch"] for r in shown], [r["train_loss"] for r in shown], **look)
    top1.set(xlabel="epoch", ylabel="val top-1 (%)", title="validation top-1" + (" (dashed: paper)" if dashed else ""))
    loss.set_yscale("log")
    loss.set(xlabel="epoch", ylabel="train loss (log scale)", title="training loss")
    for ax in (top1, loss):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


#: line styles that tell neighbouring runs apart beyond ten; dashed is kept for the paper's reference
RUN_LINESTYLES = ("-", ":", "-.")


def run_styles(count: int) -> List[Tuple[Any, str]]:
    """A (colour, line style) for each of ``count`` runs, no two alike: matplotlib's ten default
    colours up to ten runs; beyond, ``count`` hues spread evenly over the colour wheel, with
    neighbours in different line styles too."""
    if count <= 10:
        return [(f"C{i}", "-") for i in range(count)]
    from matplotlib.colors import hsv_to_rgb

    # hues up to 0.9 of the wheel: the last run's does not come round to the first's red
    hues = [tuple(hsv_to_rgb((0.9 * i / count, 0.85, 0.8))) for i in range(count)]
    return [(hue, RUN_LINESTYLES[i % len(RUN_LINESTYLES)]) for i, hue in enumerate(hues)]


def run_labels(runs: Sequence[Path]) -> List[str]:
    """The shortest endings of the runs' paths that tell them apart (``a/kd`` and ``b/kd``, not ``kd``
    twice); the whole path for a single run."""
    parts = [Path(run).resolve().parts for run in runs]
    if len(parts) < 2:
        return [str(run) for run in runs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(run) for run in runs]


def markdown(rows: List[Dict[str, object]]) -> str:
    shown = columns(rows, COLUMNS)
    return table.markdown([{**{c: "-" for c in EMA_COLUMNS}, **row} for row in rows], shown)


def provenance_table(rows: List[Dict[str, object]], note: Callable[[str], None]) -> str:
    """Each run's provenance.json (:func:`kd.run.provenance.summary`) as one table; ``note`` hears of a run
    of a kd that wrote none."""
    from kd.run import provenance

    lines = []
    for row in rows:
        found = provenance.summary(Path(str(row["run"])))
        if found is None:
            note(f"{row['run']}: no provenance.json (a run of an older kd)")
            found = {**{column: "-" for column in provenance.COLUMNS}, "run": str(row["run"])}
        lines.append(found)
    return table.markdown(lines, provenance.COLUMNS)


def to_csv(rows: List[Dict[str, object]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns(rows, CSV_COLUMNS), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()
