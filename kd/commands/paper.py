"""``kd report --format markdown|latex|csv``: the table a paper prints from kd runs, one per teacher and
student pair: the teacher, the student alone, then each method, with top-1 and top-5 of the best and
of the last epoch (``--epoch``) and, where the run was the published setting on ImageNet, the paper's
top-1 and the difference to it; a footnote marks a run that departs from the paper setting it resembles.

The best epoch is chosen on the validation set; the methods' official code prints it (mdistiller's
``best_acc``) and the papers report it. The last epoch is the one nothing chose."""

from __future__ import annotations

import csv
import io
from collections import Counter
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from kd.commands import table
from kd.errors import KDError
from kd.losses import LOSSES

FORMATS = ("markdown", "latex", "csv")
#: ``--epoch``: the epochs whose top-1 and top-5 the table shows
EPOCHS = ("both", "best", "last")
#: what each epoch is, under the table
EPOCH_WORDS = {
    "best": "best: the epoch of the highest val top-1, chosen on the validation set (what the papers report)",
    "last": "last: the final epoch",
}


def header(epoch: str) -> List[str]:
    """The columns of the table of ``epoch`` (both, best or last); diff is the first epoch's top-1 less the paper's."""
    shown = ["best", "last"] if epoch == "both" else [epoch]
    return ["method", *(f"{e} {k}" for e in shown for k in ("top-1", "top-5")), "paper top-1", f"diff ({shown[0]})"]


#: what the teacher row's numbers are: the teacher does not train, so it has no best or last epoch
TEACHER_WORDS = "teacher: its weights' top-1 and top-5, measured once before training (it has no epochs)"


def caption(epoch: str, teacher: bool = False) -> str:
    """The line under a table that says which epoch each column is, and what the teacher row is where it has one."""
    words = [EPOCH_WORDS[e] for e in (["best", "last"] if epoch == "both" else [epoch])]
    return "; ".join(words + ([TEACHER_WORDS] if teacher else []))


def published(model: str, weights: str) -> Optional[Tuple[float, float]]:
    """(top-1, top-5) that torchvision publishes for ``model`` with ``weights`` (``pretrained``,
    ``torchvision:TAG``), None for other weights (a file, timm's: no number ships with them)."""
    if model.startswith("timm:") or not (weights == "pretrained" or weights.startswith("torchvision:")):
        return None
    try:
        from torchvision.models import get_model_weights

        enum = get_model_weights(model)
        entry = enum.DEFAULT if weights == "pretrained" else enum[weights.split(":", 1)[1]]
        metrics = entry.meta["_metrics"]["ImageNet-1K"]
        return float(metrics["acc@1"]), float(metrics["acc@5"])
    except (KeyError, ValueError):
        return None


def _title(row: Dict[str, object]) -> str:
    """The method as papers print it, ``+ LS`` where its logits were standardised, ``+ DOT`` where DOT
    trained it."""
    method = str(row["method"])
    return (
        (LOSSES.card(method).title if method in LOSSES else method)
        + (" + LS" if row.get("_standardised") else "")
        + (" + DOT" if row.get("_dot") else "")
    )


def _number(value: object) -> str:
    return "-" if value in (None, "-", "") else f"{float(value):.2f}"  # type: ignore[arg-type]


def _diff(value: object) -> str:
    return "-" if value in (None, "-", "") else f"{float(value):+.2f}"  # type: ignore[arg-type]


Table = Tuple[List[List[str]], List[str]]


def _marked(title: str, row: Dict[str, object], footnotes: List[str]) -> str:
    """``title`` with the number of its footnote where its run departs from the paper setting it
    resembles (kd.run.paper_setting: teacher weights, weight decay, temperature); the footnote added once."""
    setting = str(row.get("paper_setting") or "-")
    if not setting.startswith("unlike "):
        return title
    if setting not in footnotes:
        footnotes.append(setting)
    return f"{title} [{footnotes.index(setting) + 1}]"


def _cells(row: Dict[str, object], epoch: str) -> List[str]:
    """A run's top-1 and top-5 of ``epoch`` (both: best, then last), its paper top-1 and the first epoch's diff."""
    shown = ["best", "last"] if epoch == "both" else [epoch]
    ref = row["reference_top1"]
    top1 = row[f"{shown[0]}_top1"]
    diff = None if ref in (None, "-") else float(top1) - float(ref)  # type: ignore[arg-type]
    numbers = [_number(row[f"{e}_{k}"]) for e in shown for k in ("top1", "top5")]
    return [*numbers, _number(ref), _diff(diff)]


def _tag(model: str, weights: str) -> str:
    """``torchvision:TAG`` for torchvision's ``pretrained`` (its default weights), else ``weights``."""
    if weights != "pretrained" or model.startswith("timm:"):
        return weights
    try:
        from torchvision.models import get_model_weights

        return f"torchvision:{get_model_weights(model).DEFAULT.name}"
    except (KeyError, ValueError):
        return weights


def _weights(row: Dict[str, object], whole: bool = False) -> str:
    """A teacher's weights in a few words: ``pretrained``, ``torchvision:TAG``, a file's name (``whole``:
    its path as given), with the first digits of their SHA-256 where the run recorded it."""
    weights = str(row.get("_teacher_weights") or "-")
    is_file = weights.endswith((".pt", ".pth", ".safetensors")) or "/" in weights
    name = Path(weights).name if is_file and not whole else weights
    digest = row.get("_teacher_sha256")
    return f"{name}, sha256 {str(digest)[:12]}" if digest else name


def groups(rows: Sequence[Dict[str, object]]) -> Dict[Tuple[str, str], List[Dict[str, object]]]:
    """The distilled runs of each table, by path: one per teacher and student, where a teacher is its
    model and its weights (their SHA-256, else the weights named); a model taught from two weights is
    two teachers, each named with its weights (``resnet18 (a.pt, sha256 0123456789ab)``)."""
    found: Dict[Tuple[str, str, str], List[Dict[str, object]]] = {}
    for row in rows:
        if row["method"] != "ce":
            weights = str(row.get("_teacher_sha256") or _tag(str(row["teacher"]), str(row.get("_teacher_weights"))))
            found.setdefault((str(row["teacher"]), str(row["student"]), weights), []).append(row)
    names = Counter((teacher, student) for teacher, student, _ in found)
    short = Counter((teacher, student, _weights(runs[0])) for (teacher, student, _), runs in found.items())
    out = {}
    for (teacher, student, _), runs in found.items():
        runs = sorted(runs, key=lambda r: str(r["run"]))
        weights = _weights(runs[0])
        if short[(teacher, student, weights)] > 1:  # two files of one name (best.pt): their whole paths
            weights = _weights(runs[0], whole=True)
        named = f"{teacher} ({weights})" if names[(teacher, student)] > 1 else teacher
        out[(named, student)] = runs
    return dict(sorted(out.items()))


def check(rows: Sequence[Dict[str, object]]) -> None:
    """A KDError where no run had a teacher: the paper's table has no row to print."""
    if all(row["method"] == "ce" for row in rows):
        raise KDError(
            f"the paper's table needs distilled runs (a teacher's), and the {len(rows)} run(s) given are all "
            "--no-teacher: kd report without --format lists them"
        )


def _teacher_line(teacher: str, runs: List[Dict[str, object]], note: Callable[[str], None], epoch: str) -> List[str]:
    """The teacher's row: its weights' top-1 and top-5 as its students' runs measured them before
    training (the first run by path; another measurement is said), in each epoch's columns."""
    measured = [r for r in runs if r.get("_teacher_top1") is not None]
    if not measured:
        return []
    first = measured[0]
    for other in measured[1:]:
        if (other["_teacher_top1"], other.get("_teacher_top5")) != (first["_teacher_top1"], first.get("_teacher_top5")):
            note(
                f"{other['run']}: measured its teacher at top-1 {_number(other['_teacher_top1'])}; the table's "
                f"teacher row shows {first['run']}'s {_number(first['_teacher_top1'])}"
            )
    model = teacher.split(" (", 1)[0]
    ref = published(model, str(first.get("_teacher_weights"))) if first.get("_imagenet") else None
    top1 = float(first["_teacher_top1"])  # type: ignore[arg-type]
    numbers = [_number(top1), _number(first.get("_teacher_top5"))]  # once, before the first epoch
    return [f"teacher ({teacher})", *numbers * (2 if epoch == "both" else 1),
            _number(ref[0] if ref else None), _diff(top1 - ref[0] if ref else None)]  # fmt: skip


Row = Dict[str, object]


def _alone(rows: Sequence[Row], student: str, runs: List[Row], table: str, note: Callable[[str], None]) -> List[Row]:
    """The student-alone runs (--no-teacher) a table shows: those of its students' setting (data, epochs,
    batch), else every one of ``student``; each left out is said, with why."""
    found = sorted((r for r in rows if r["method"] == "ce" and r["student"] == student), key=lambda r: str(r["run"]))
    settings = [r.get("_setting") for r in runs]
    shown = [r for r in found if r.get("_setting") in settings] or found
    theirs: Dict[str, object] = settings[0] or {}  # type: ignore[assignment]
    for row in found:
        if row not in shown:
            ours: Dict[str, object] = row.get("_setting") or {}  # type: ignore[assignment]
            keys = [k for k, v in ours.items() if theirs.get(k) != v]
            differ = ", ".join(f"{k} {ours[k]} (its students': {theirs.get(k)})" for k in keys)
            shown_runs = ", ".join(str(r["run"]) for r in shown)
            note(f"{row['run']}: left out of the {table} table's student-alone rows: {differ}; shown: {shown_runs}")
    return shown


def _folder(row: Dict[str, object]) -> str:
    run = Path(str(row["run"]))
    return f"{run.parent.name}/{run.name}"


def pair_rows(
    rows: Sequence[Dict[str, object]], note: Callable[[str], None], epoch: str = "both"
) -> Dict[Tuple[str, str], Table]:
    """The rows of each (teacher, student) table (:func:`groups`): [name, top-1 and top-5 of ``epoch``
    (both: best and last), paper top-1, diff], and its footnotes: where a row's run departs from the paper
    setting (``[1] unlike RECIPE: ...``). A KDError where no run had a teacher."""
    check(rows)
    pairs = groups(rows)
    tables = {}
    for (teacher, student), runs in pairs.items():
        footnotes: List[str] = []
        teacher_line = _teacher_line(teacher, runs, note, epoch)
        lines = [teacher_line] if teacher_line else []
        alone = _alone(rows, student, runs, f"{teacher} -> {student}", note)
        for base in alone:
            title = f"student alone ({student})" + (f" ({_folder(base)})" if len(alone) > 1 else "")
            lines.append([_marked(title, base, footnotes), *_cells(base, epoch)])
        if not alone:
            note(f"no run of {student} alone among the runs: train one with --no-teacher for the table's baseline row")
        rank = {name: i for i, name in enumerate(LOSSES.in_table_order())}  # the papers' order, later methods after
        ordered = sorted(
            runs,
            key=lambda r: (
                rank.get(str(r["method"]), len(rank)),
                str(r["method"]),
                bool(r.get("_standardised")),
                bool(r.get("_dot")),
            ),
        )
        titles = [_title(row) for row in ordered]
        for row, title in zip(ordered, titles):
            if titles.count(title) > 1:  # the same method in two runs: told apart by their folders
                title = f"{title} ({_folder(row)})"
            lines.append([_marked(title, row, footnotes), *_cells(row, epoch)])
        tables[(teacher, student)] = (lines, [f"[{i}] {text}" for i, text in enumerate(footnotes, 1)])
    return tables


def markdown(rows: Sequence[Dict[str, object]], note: Callable[[str], None], epoch: str = "both") -> str:
    """One markdown table per pair, its caption (which epoch each column is) and footnotes below it."""
    out = []
    columns = header(epoch)
    for (teacher, student), (lines, footnotes) in pair_rows(rows, note, epoch).items():
        text = table.markdown([dict(zip(columns, line)) for line in lines], columns)
        below = [caption(epoch, lines[0][0].startswith("teacher")), *footnotes]
        out.append(f"{teacher} -> {student}\n\n{text}" + "".join(f"\n\n{line}" for line in below))
    return "\n\n".join(out)


def to_csv(rows: Sequence[Dict[str, object]], note: Callable[[str], None], epoch: str = "both") -> str:
    """The tables as one CSV: a row per table row, led by its teacher and student; its footnote's text
    in a column of its own."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["teacher", "student", *header(epoch), "paper_setting"])
    for (teacher, student), (lines, footnotes) in pair_rows(rows, note, epoch).items():
        for line in lines:
            mark = line[0].rsplit(" [", 1)
            footnote = footnotes[int(mark[1][:-1]) - 1].split("] ", 1)[1] if len(mark) == 2 else ""
            writer.writerow([teacher, student, mark[0], *line[1:], footnote])
    return buf.getvalue()


def _tex(text: str) -> str:
    for char, escaped in (("\\", r"\textbackslash{}"), ("_", r"\_"), ("&", r"\&"), ("%", r"\%"), ("#", r"\#")):
        text = text.replace(char, escaped)
    return text


def latex(rows: Sequence[Dict[str, object]], note: Callable[[str], None], epoch: str = "both") -> str:
    """One booktabs tabular per pair (``\\usepackage{booktabs}``)."""
    out = []
    columns = header(epoch)
    titles = [
        "Method",
        *(c[0].upper() + c[1:] for c in columns[1:-2]),
        "Paper top-1",
        rf"$\Delta$ ({columns[-1][6:-1]})",
    ]
    width = len(columns)
    for (teacher, student), (lines, footnotes) in pair_rows(rows, note, epoch).items():
        body = []
        for i, line in enumerate(lines):
            if (
                i
                and lines[i - 1][0].startswith(("teacher", "student alone"))
                and not line[0].startswith("student alone")
            ):
                body.append(r"\midrule")
            body.append(" & ".join(_tex(cell) for cell in line) + r" \\")
        out.append(
            "\n".join(
                [
                    f"% {_tex(teacher)} -> {_tex(student)}: top-1 / top-5 (%); "
                    "the paper's top-1 where the run was its setting",
                    rf"\begin{{tabular}}{{l{'r' * (width - 1)}}}",
                    r"\toprule",
                    " & ".join(titles) + r" \\",
                    r"\midrule",
                    *body,
                    r"\bottomrule",
                    *(
                        rf"\multicolumn{{{width}}}{{l}}{{\footnotesize {_tex(line)}}} \\"
                        for line in [caption(epoch, lines[0][0].startswith("teacher")), *footnotes]
                    ),
                    r"\end{tabular}",
                ]
            )
        )
    return "\n\n".join(out)
