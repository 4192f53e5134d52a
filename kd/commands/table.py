"""Tables for people: markdown (kd report, kd bench, kd recipes list, kd demo) and plain aligned
text (kd losses, kd backends), rendered in one place."""

from __future__ import annotations

from typing import Mapping, Sequence


def _is_number(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    try:
        float(str(value))
        return True
    except ValueError:
        return False


def markdown(rows: Sequence[Mapping[str, object]], columns: Sequence[str], pad: bool = False) -> str:
    """``rows`` as a markdown table of ``columns``; a column of numbers (and '-') is right-aligned.

    Cells hold the values as ``str()`` writes them, so ``| dkd | resnet34 |`` can be searched
    for; ``pad=True`` also pads every cell to its column's width for reading in a terminal.
    """
    cells = [[str(row[c]) for c in columns] for row in rows]
    numeric = [
        bool(rows)
        and all(_is_number(line[i]) or line[i] == "-" for line in cells)
        and any(_is_number(line[i]) for line in cells)
        for i in range(len(columns))
    ]
    widths = [max([len(c)] + [len(line[i]) for line in cells]) if pad else 0 for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return (
            "| "
            + " | ".join(v.rjust(w) if right else v.ljust(w) for v, w, right in zip(values, widths, numeric))
            + " |"
        )

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":" if right else "-" * (w + 2)) if pad else ("---:" if right else "---")
            for w, right in zip(widths, numeric)
        )
        + "|"
    )
    return "\n".join([line(list(columns)), rule] + [line(values) for values in cells])


def aligned(rows: Sequence[Sequence[object]], gap: int = 2) -> str:
    """Plain text: every column but the last padded to its widest cell, ``gap`` spaces between."""
    if not rows:
        return ""
    cells = [[str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells if i < len(row)) for i in range(max(map(len, cells)))]
    return "\n".join(
        (" " * gap).join(v.ljust(widths[i]) if i < len(row) - 1 else v for i, v in enumerate(row)).rstrip()
        for row in cells
    )
