"""``kd report --format markdown|latex``: the table a paper prints from kd runs, one per teacher and
student pair: the teacher, the student alone, then each method, with top-1, top-5 and, where the run
was the published setting on ImageNet, the paper's top-1 and the difference to it; a footnote marks
a run whose teacher weights, weight decay or temperature depart from the paper setting it resembles."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from kd.commands import table

#: the order of the rows of the papers' ImageNet tables, then the later methods
ORDER = [
    "kd", "at", "fitnet", "ofd", "crd", "reviewkd", "dkd", "dist", "nkd", "ctkd", "ctdkd", "mlkd", "lskd",
    "ttm", "wttm", "luminet", "crld", "deit",
]  # fmt: skip
#: how papers print each method's name
TITLES = {
    "kd": "KD", "at": "AT", "fitnet": "FitNet", "ofd": "OFD", "crd": "CRD", "reviewkd": "ReviewKD",
    "dkd": "DKD", "dist": "DIST", "nkd": "NKD", "ctkd": "KD + CTKD", "ctdkd": "DKD + CTKD", "mlkd": "MLKD",
    "lskd": "KD + LS", "ttm": "TTM", "wttm": "WTTM", "luminet": "LumiNet", "crld": "CRLD",
    "deit": "DeiT",
}  # fmt: skip
FORMATS = ("markdown", "latex")
HEADER = ["method", "top-1", "top-5", "paper top-1", "diff"]


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
        TITLES.get(method, method)
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
    resembles (kd.run.papers: teacher weights, weight decay, temperature); the footnote added once."""
    setting = str(row.get("paper_setting") or "-")
    if not setting.startswith("unlike "):
        return title
    if setting not in footnotes:
        footnotes.append(setting)
    return f"{title} [{footnotes.index(setting) + 1}]"


def pair_rows(rows: Sequence[Dict[str, object]], note: Callable[[str], None]) -> Dict[Tuple[str, str], Table]:
    """The rows of each (teacher, student) table: [name, top-1, top-5, paper top-1, diff], and its
    footnotes: where a row's run departs from the paper setting (``[1] unlike RECIPE: ...``)."""
    pairs: Dict[Tuple[str, str], List[Dict[str, object]]] = {}
    alone: Dict[str, Dict[str, object]] = {}
    for row in rows:
        if row["method"] == "ce":
            alone.setdefault(str(row["student"]), row)
        else:
            pairs.setdefault((str(row["teacher"]), str(row["student"])), []).append(row)
    tables = {}
    for (teacher, student), runs in pairs.items():
        lines = []
        footnotes: List[str] = []
        first = runs[0]
        if first.get("_teacher_top1") is not None:
            ref = published(teacher, str(first.get("_teacher_weights"))) if first.get("_imagenet") else None
            top1 = float(first["_teacher_top1"])  # type: ignore[arg-type]
            lines.append(
                [f"teacher ({teacher})", _number(top1), _number(first.get("_teacher_top5")),
                 _number(ref[0] if ref else None), _diff(top1 - ref[0] if ref else None)]
            )  # fmt: skip
        base = alone.get(student)
        if base is not None:
            alone_title = _marked(f"student alone ({student})", base, footnotes)
            lines.append([alone_title, _number(base["best_top1"]), _number(base["best_top5"]),
                          _number(base["reference_top1"]), _diff(base["diff"])])  # fmt: skip
        else:
            note(f"no run of {student} alone among the runs: train one with --no-teacher for the table's baseline row")
        rank = {name: i for i, name in enumerate(ORDER)}
        ordered = sorted(
            runs,
            key=lambda r: (
                rank.get(str(r["method"]), len(ORDER)),
                str(r["method"]),
                bool(r.get("_standardised")),
                bool(r.get("_dot")),
            ),
        )
        titles = [_title(row) for row in ordered]
        for row, title in zip(ordered, titles):
            if titles.count(title) > 1:  # the same method in two runs: told apart by their folders
                run = Path(str(row["run"]))
                title = f"{title} ({run.parent.name}/{run.name})"
            lines.append([_marked(title, row, footnotes), _number(row["best_top1"]), _number(row["best_top5"]),
                          _number(row["reference_top1"]), _diff(row["diff"])])  # fmt: skip
        tables[(teacher, student)] = (lines, [f"[{i}] {text}" for i, text in enumerate(footnotes, 1)])
    return tables


def markdown(rows: Sequence[Dict[str, object]], note: Callable[[str], None]) -> str:
    out = []
    for (teacher, student), (lines, footnotes) in pair_rows(rows, note).items():
        text = table.markdown([dict(zip(HEADER, line)) for line in lines], HEADER)
        out.append(f"{teacher} -> {student}\n\n{text}" + "".join(f"\n\n{line}" for line in footnotes))
    return "\n\n".join(out)


def _tex(text: str) -> str:
    for char, escaped in (("\\", r"\textbackslash{}"), ("_", r"\_"), ("&", r"\&"), ("%", r"\%"), ("#", r"\#")):
        text = text.replace(char, escaped)
    return text


def latex(rows: Sequence[Dict[str, object]], note: Callable[[str], None]) -> str:
    """One booktabs tabular per pair (``\\usepackage{booktabs}``)."""
    out = []
    for (teacher, student), (lines, footnotes) in pair_rows(rows, note).items():
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
                    f"% {_tex(teacher)} -> {_tex(student)}: top-1 / top-5 (%) of the best epoch; "
                    "the paper's top-1 where the run was its setting",
                    r"\begin{tabular}{lrrrr}",
                    r"\toprule",
                    r"Method & Top-1 & Top-5 & Paper top-1 & $\Delta$ \\",
                    r"\midrule",
                    *body,
                    r"\bottomrule",
                    *(rf"\multicolumn{{5}}{{l}}{{\footnotesize {_tex(line)}}} \\" for line in footnotes),
                    r"\end{tabular}",
                ]
            )
        )
    return "\n\n".join(out)
