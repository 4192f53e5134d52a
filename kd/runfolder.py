"""The files of one run folder (``--out``), named in one place.

::

    RUN/config.yaml             the resolved config (with notes on what was chosen and why)
    RUN/metrics.jsonl           one JSON record per epoch (and the bench's timed steps)
    RUN/checkpoints/last.pt     the latest full state (model, optimizer, scaler, RNG, loader position)
    RUN/checkpoints/best.pt     a copy of the checkpoint with the best validation top-1
    RUN/tb/                     TensorBoard event files
    RUN/provenance.json         each side's resolved weights (file, SHA-256), versions, kd's commit, devices
    RUN/wall.jsonl              each part of the run (each resume): its wall time (:func:`kd.run.log.wall_clock`)
    RUN/.kd-lock                the writer's lock, while a run writes the folder (:mod:`kd.runlock`)
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional, Tuple, Union

from kd.errors import KDError


class _Below:
    """A run file's path on a :class:`RunFolder`: ``parts`` joined below its root."""

    def __init__(self, *parts: str):
        self.parts = parts

    def __get__(self, folder: RunFolder, owner: type) -> Path:
        return folder.root.joinpath(*self.parts)


@dataclass(frozen=True)
class RunFolder:
    """The paths of a run folder; nothing is created or read by building one."""

    root: Path

    def __init__(self, root: Union[str, Path]):
        object.__setattr__(self, "root", Path(root))

    #: The names whose presence means the folder holds a run.
    RUN_FILES: ClassVar[Tuple[str, ...]] = (
        "config.yaml",
        "metrics.jsonl",
        "checkpoints",
        "tb",
        "wall.jsonl",
        "provenance.json",
    )

    config = _Below("config.yaml")
    metrics = _Below("metrics.jsonl")
    provenance = _Below("provenance.json")
    wall = _Below("wall.jsonl")
    checkpoints = _Below("checkpoints")
    last = _Below("checkpoints", "last.pt")
    best = _Below("checkpoints", "best.pt")
    tensorboard = _Below("tb")

    def metric_lines(self) -> List[Tuple[str, Dict[str, Any]]]:
        """metrics.jsonl's lines, each ending in a newline, with its record (:func:`read_json_lines`)."""
        return read_json_lines(self.metrics)

    def records(self) -> List[Dict[str, Any]]:
        """metrics.jsonl's records in order (:func:`read_json_lines`)."""
        return [record for _, record in self.metric_lines()]

    def held(self) -> Tuple[str, ...]:
        """The run files already present (empty for a new or empty folder)."""
        return tuple(name for name in self.RUN_FILES if (self.root / name).exists())

    def is_run(self) -> bool:
        """True when the folder holds a run's metrics."""
        return self.metrics.is_file()

    def start(self) -> None:
        """Make the folder for a new run, removing the files of a run it held (``--overwrite``, checked
        before set-up). Called by the main process once set-up has succeeded."""
        for name in self.RUN_FILES:
            target = self.root / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
        self.root.mkdir(parents=True, exist_ok=True)

    def discard_unstarted(self, keep_folder: bool) -> None:
        """Remove what a run wrote before its first checkpoint (a stop during set-up: config.yaml,
        tb/, students.yaml), and the folder itself unless ``keep_folder`` (it was there before). A
        folder of several students is started once any student's checkpoint is written."""
        if self.last.exists() or not self.root.is_dir() or any(self.root.glob("*/checkpoints/last.pt")):
            return
        for name in (*self.RUN_FILES, "students.yaml"):
            target = self.root / name
            if target.is_dir():
                shutil.rmtree(target, ignore_errors=True)
            elif target.exists():
                target.unlink()
        if not keep_folder:
            try:
                self.root.rmdir()  # only if nothing else is in it
            except OSError:
                pass


def nearest_folder(path: Path) -> Path:
    """``path`` or its nearest existing parent: where a folder made at ``path`` is written."""
    return next(p for p in (path, *path.absolute().parents) if p.exists())


def why_unwritable(out: Path) -> Optional[str]:
    """Why no folder can be made (or written) at ``out``, or None where one can: tried with a
    temporary folder in its nearest existing folder, removed at once (permission bits do not tell
    for root, /proc or a read-only mount)."""
    base = nearest_folder(out)
    if not base.is_dir():
        return f"{base} is a file, not a folder"
    if not os.access(base, os.W_OK | os.X_OK):
        return f"{base} is not writable ({os.strerror(errno.EACCES)})"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kd-probe-", dir=base))
    except OSError as exc:
        return f"{base} takes no new folders ({exc.strerror})"
    return None


def write_json(path: Path, data: Any) -> None:
    """``data`` as JSON at ``path``, whole or not at all (written beside it, then renamed): a stop
    mid-write leaves the file as it was (kd prepare's and kd teach's manifests)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)


#: what to do about a damaged run file
REPAIR = "restore it from a copy, or repair the line named"


def not_text(exc: UnicodeDecodeError) -> str:
    """Where a file is not UTF-8 text, in words (the line and byte)."""
    line = exc.object[: exc.start].count(b"\n") + 1
    return f"line {line} is not UTF-8 text (byte {exc.start})"


def read_json_lines(path: Path) -> List[Tuple[str, Dict[str, Any]]]:
    """The lines of a JSON-lines file (metrics.jsonl), each ending in a newline, with its record;
    empty where there is no file. A last line cut short (a kill mid-write) is left out: it is no
    damage. A line elsewhere that is no JSON record, or bytes that are not UTF-8, are a KDError
    of one line naming the line."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    try:
        lines = raw.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError as exc:
        raise KDError(f"{path} is damaged: {not_text(exc)}; {REPAIR}") from None
    read = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and not line.endswith("\n"):
                break  # cut short by a kill mid-write
            record = None
        if not isinstance(record, dict):
            raise KDError(f"{path} is damaged: line {number} is not a JSON record; {REPAIR}")
        read.append((line.rstrip("\r\n") + "\n", record))
    return read


#: The lock file of a folder a run writes (a run folder, each student's, kd teach's store;
#: :class:`kd.runlock.FolderLock`).
LOCK_FILE = ".kd-lock"
