"""The students of a run: their names, configs and run folders, and ``OUT/students.yaml``, which
names the students of a run of several and those a non-finite loss stopped (a resume continues
the others)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Sequence, Tuple

import yaml

STUDENTS_FILE = "students.yaml"


@dataclass(frozen=True)
class Students:
    """The students of one run: their names, their resolved configs and their run folders. Several
    students live in ``out/<name>/`` beside ``out/students.yaml``; one alone is its run folder."""

    out: Path
    names: Tuple[str, ...]
    cfgs: Tuple[Any, ...]

    @functools.cached_property  # asked at every step of the loop
    def grouped(self) -> bool:
        """Whether they live in ``out/<name>/`` beside ``out/students.yaml`` (not a plain run's folder)."""
        return Path(self.cfgs[0].out) != self.out

    def folder(self, name: str) -> Path:
        return self.out / name if self.grouped else self.out

    @classmethod
    def alone(cls, cfg) -> Students:
        """The one student of a plain ``kd train``, in ``cfg.out``."""
        out = Path(cfg.out)
        return cls(out, (out.name,), (cfg,))


def is_students_folder(out: Path) -> bool:
    return (Path(out) / STUDENTS_FILE).is_file()


def stopped_students(out: Path) -> Dict[str, str]:
    """The students of the run in ``out`` that a non-finite loss stopped: name -> why."""
    path = Path(out) / STUDENTS_FILE
    if not path.is_file():
        return {}
    return dict((yaml.safe_load(path.read_text()) or {}).get("stopped") or {})


def write_students(out: Path, names: Sequence[str], stopped: Dict[str, str]) -> None:
    """``out``/students.yaml: the students, and those stopped (a resume continues the others)."""
    out.mkdir(parents=True, exist_ok=True)
    content = {"students": list(names), **({"stopped": dict(stopped)} if stopped else {})}
    tmp = out / f".{STUDENTS_FILE}.tmp"
    tmp.write_text(yaml.safe_dump(content))
    tmp.replace(out / STUDENTS_FILE)
