"""``kd verify PATH``: every byte of what kd wrote, against the checksums it wrote beside it.

PATH is a checkpoint (against ``NAME.sha256`` beside it; a file with none, from elsewhere or an
older kd, is read through to check it loads), a run folder (each of its checkpoints; of each
student, for a run of several), a prepared
copy (its manifest, every shard, the index and paths files) or a soft-label store (its own
:func:`kd.teacher.store.verify`). One line per file checked, ``OK`` or ``DAMAGED: why``; anything
damaged ends in a KDError (``kd: error:``, exit 2) that names it and what to do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Set

from kd.errors import KDError
from kd.runfolder import RunFolder
from kd.utils import checkpoint_io

Echo = Callable[[str], None]


def check_file(path: Path) -> str:
    """``OK ...`` or ``DAMAGED: why`` for one checkpoint or weights file (read in full, not cached)."""
    if not path.exists() and checkpoint_io.sums_file(path).is_file():
        return f"DAMAGED: missing, though {checkpoint_io.sums_file(path).name} is here (deleted, or not copied)"
    listed = checkpoint_io.listed_sums(path)
    if listed is None:
        try:
            checkpoint_io.read(path, "cannot read", mmap=True)
        except KDError as exc:
            return f"DAMAGED: {str(exc).split(': ', 1)[-1]}"
        return f"OK (no {checkpoint_io.sums_file(path).name} beside it: it loads, but its bytes cannot be checked)"
    try:
        sound = checkpoint_io.matches_sums(path)
    except KDError as exc:  # an I/O error: a bad sector, say
        return f"DAMAGED: {str(exc).split(': ', 1)[-1]}"
    if not sound:
        return f"DAMAGED: its bytes do not match the SHA-256 in {checkpoint_io.sums_file(path).name}"
    return "OK"


def checkpoints(folder: Path) -> List[Path]:
    """A run folder's checkpoints (last.pt, best.pt, step_*.pt; not the temporary files of a write),
    or those of each student of a run of several (``OUT/NAME/checkpoints``); a checkpoint gone from
    beside its ``.sha256`` is listed too (a deleted last.pt)."""
    runs = [folder] if RunFolder(folder).checkpoints.is_dir() else sorted(p for p in folder.iterdir() if p.is_dir())
    found: Set[Path] = set()
    for run in runs:
        where = RunFolder(run).checkpoints
        found.update(p for p in where.glob("*.pt") if p.is_file())
        found.update(
            sums.with_name(sums.name[: -len(checkpoint_io.SUMS)]) for sums in where.glob(f"*.pt{checkpoint_io.SUMS}")
        )
    return sorted(p for p in found if not p.name.startswith("."))


def verify_files(paths: List[Path], echo: Echo, what: str) -> str:
    bad = []
    for path in paths:
        verdict = check_file(path)
        echo(f"{path}: {verdict}")
        if verdict.startswith("DAMAGED"):
            bad.append(path)
    if not bad:
        return f"{what}: sound ({len(paths)} file{'s' if len(paths) != 1 else ''})"
    sound = [p.name for p in paths if p not in bad]
    advice = (
        f"resume or evaluate from a sound one ({', '.join(sound)})"
        if sound
        else "copy it again from where it came from, or train again"
    )
    names = ", ".join(str(p) for p in bad)
    raise KDError(f"{names} {'is' if len(bad) == 1 else 'are'} damaged: {advice}")


def check_best(runs: List[Path], echo: Echo) -> None:
    """Each run's best.pt must hold the best epoch its last.pt records (sound files, already checked)."""
    from kd.run.checkpoint import stale_best

    stale = []
    for run in runs:
        why = stale_best(RunFolder(run))
        if why:
            echo(f"{RunFolder(run).best}: STALE: {why}")
            stale.append(RunFolder(run).best)
    if stale:
        names = ", ".join(map(str, stale))
        raise KDError(
            f"{names} {'is' if len(stale) == 1 else 'are'} not the best epoch's checkpoint: "
            "kd train --resume copies it again where last.pt is that epoch's"
        )


def verify(path: Path, echo: Echo = print) -> str:
    """Check ``path`` (see the module's docstring), a line per file through ``echo``; returns a
    one-line summary, or raises a KDError for the first damage (a run folder: after every file)."""
    from kd.data.prepared import is_prepared, verify_copy
    from kd.run.students import is_students_folder
    from kd.teacher import store

    path = Path(path)
    if not path.exists():
        raise KDError(f"{path} does not exist")
    if path.is_file():
        return verify_files([path], echo, str(path))
    if is_prepared(path):
        return verify_copy(path, echo)
    if store.is_store(path):
        return store.verify(path)

    def holds_run(folder: Path) -> bool:
        return RunFolder(folder).is_run() or RunFolder(folder).checkpoints.is_dir() or is_students_folder(folder)

    runs = [path] if holds_run(path) else sorted(p for p in path.iterdir() if p.is_dir() and holds_run(p))
    if runs:  # a run folder, or a folder of runs (kd report's RUNS)
        found = [f for run in runs for f in checkpoints(run)]
        if not found:
            raise KDError(f"{path} is a run folder with no checkpoint yet")
        what = f"run {path}" if runs == [path] else f"{len(runs)} runs in {path}"
        summary = verify_files(found, echo, what)
        check_best(sorted({p.parent.parent for p in found}), echo)
        return summary
    raise KDError(
        f"{path} is nothing kd verifies: give a checkpoint file, a run folder, a prepared copy "
        f"(kd prepare) or a soft-label store (kd teach)"
    )
