"""``RUN/provenance.json``: what a run was made of, beyond its options. Each side's weights as
resolved (library, the enum member or timm tag, the file and its SHA-256), the versions of the
libraries, kd's version and commit, the devices and the processes. Written by the main process
once set-up has succeeded; a resumed run adds its part."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from kd import models
from kd.checksum import file_sha256
from kd.errors import KDError
from kd.runfolder import RunFolder, write_json
from kd.utils import checkpoint_io
from kd.utils.weight_files import kd_run_model
from kd.version import __version__

#: the libraries whose versions a run records (apex read from its metadata: never imported here)
LIBRARIES = ("torch", "torchvision", "timm", "apex", "huggingface_hub", "safetensors")
#: SHA-256 of files read in this process, by (path, size, mtime)
_sums: Dict[Tuple[str, int, int], str] = {}


def sha256(path: Path) -> str:
    """The SHA-256 of ``path``: from a kd file's ``NAME.sha256`` where it lists one sum, else read (once
    per file, size and time in a process): a sums file listing two is one a write was replacing, and
    which of them the file holds is known only by reading it."""
    listed = checkpoint_io.listed_sums(path)
    if listed and len(listed) == 1:
        return listed[0]
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _sums:
        _sums[key] = file_sha256(path)
    return _sums[key]


def side(model: Optional[str], weights: Optional[str]) -> Dict[str, Any]:
    """One side's weights as the run resolved them: ``library`` (torchvision, timm, kd checkpoint,
    file, random init), ``name`` (the enum member, the timm tag), ``file`` and ``sha256``."""
    out: Dict[str, Any] = {"model": model, "weights": weights}
    if not weights or weights == "none":
        return {**out, "library": "random init"}
    if models.is_named(weights):
        assert model is not None  # named weights belong to a model (checked by the config)
        found = models.named_weights(model, weights)
        out.update(library=found.library, name=found.name, source=found.source)
        if found.cached is None:  # a soft-label store's teacher, not on this machine
            return {**out, "file": None, "sha256": None}
        file = found.cached
        if file.parent.parent.name == "snapshots":  # Hugging Face's cache: the repository's commit
            out["revision"] = file.parent.name
    else:
        file = Path(weights)
        if not file.is_file():  # a soft-label store's teacher, read on another machine
            return {**out, "library": "file", "file": str(file), "sha256": None}
        out["library"] = "kd checkpoint" if kd_run_model(weights) else "file"
    return {**out, "file": str(file.resolve()), "sha256": sha256(file)}


def versions() -> Dict[str, Optional[str]]:
    """Python's and each of :data:`LIBRARIES`' version (None: not installed): a loaded module's own
    (torch's with its build, ``2.4.1+cu121``), else the installed package's."""
    found: Dict[str, Optional[str]] = {"python": platform.python_version()}
    for name in LIBRARIES:
        loaded = getattr(sys.modules.get(name), "__version__", None)
        try:
            found[name] = str(loaded) if loaded else importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    import torch

    found["cuda"] = torch.version.cuda
    found["cudnn"] = str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None
    return found


def checkout(root: Optional[Path] = None) -> Optional[Dict[str, Any]]:
    """The git commit kd runs from (read from ``.git``) and whether tracked files differ from it
    (``git status``, two seconds at most: None where it cannot tell); None where kd is no checkout."""
    root = root or Path(__file__).resolve().parents[2]
    git = root / ".git"
    if git.is_file():  # a worktree: "gitdir: PATH"
        git = (root / git.read_text().split(":", 1)[1].strip()).resolve()
    if not (git / "HEAD").is_file():
        return None
    commit = _head(git)
    dirty: Optional[bool] = None
    try:
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=2,
        )
        if status.returncode == 0:
            dirty = bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return {"commit": commit, "dirty": dirty}


def _head(git: Path) -> Optional[str]:
    """The commit ``HEAD`` names in the git folder ``git`` (loose or packed refs; a worktree's
    refs live in its common folder)."""
    head = (git / "HEAD").read_text().strip()
    if not head.startswith("ref:"):
        return head
    ref = head.split(":", 1)[1].strip()
    common = git
    if (git / "commondir").is_file():
        common = (git / (git / "commondir").read_text().strip()).resolve()
    for folder in (git, common):
        if (folder / ref).is_file():
            return (folder / ref).read_text().strip()
    packed = common / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    return None


def devices(device) -> List[str]:
    """The names of the GPUs this process sees (kd's launcher shows it those of ``--gpus`` only), or ['cpu']."""
    if device.type != "cuda":
        return ["cpu"]
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def record(cfg, backend) -> Dict[str, Any]:
    """This part of the run: when, each side's weights, versions, kd's checkout, devices, processes."""
    import torch.distributed as dist

    teacher = None
    if not cfg.no_teacher:
        teacher = side(cfg.teacher, cfg.teacher_weights)
        if cfg.soft_labels:
            teacher["soft_labels"] = str(Path(cfg.soft_labels).resolve())
    return {
        "started": time.time(),
        "teacher": teacher,
        "student": side(cfg.student, cfg.student_weights),
        "versions": versions(),
        "kd": {"version": __version__, "checkout": checkout()},
        "devices": devices(backend.device),
        "processes": backend.world_size,
        "backend": backend.name,
        "process_group": dist.get_backend() if dist.is_available() and dist.is_initialized() else None,
        "host": platform.node(),
    }


def write(out: Path, cfg, backend, resumed: bool) -> None:
    """``out/provenance.json``: a new run's first part, or one more part of a resumed run."""
    path = RunFolder(out).provenance
    parts = load(out) if resumed else []
    write_json(path, {"parts": [*parts, record(cfg, backend)]})


def load(run: Path) -> List[Dict[str, Any]]:
    """The parts recorded in ``run``'s provenance.json (empty for a run of a kd that did not write one)."""
    import json

    path = RunFolder(run).provenance
    if not path.is_file():
        return []
    try:
        return list(json.loads(path.read_text(encoding="utf-8"))["parts"])
    except (ValueError, KeyError, TypeError):
        raise KDError(f"{path} is not a provenance file kd wrote") from None


def describe_side(entry: Optional[Dict[str, Any]]) -> str:
    """One side in a few words: ``torchvision ResNet50_Weights.IMAGENET1K_V1 sha256 0676ba61…``."""
    if entry is None:
        return "-"
    if entry.get("library") == "random init":
        return "random init"
    what = entry.get("name") or Path(str(entry.get("file"))).name
    digest = entry.get("sha256")
    return f"{entry['library']} {what} " + (f"sha256 {digest[:12]}" if digest else "(file not on this machine)")


#: ``kd report --provenance``'s columns (:func:`summary`'s keys)
COLUMNS = ["run", "teacher_weights", "student_weights", "versions", "kd", "devices", "processes"]


def summary(run: Path) -> Optional[Dict[str, str]]:
    """``run``'s provenance as ``kd report --provenance`` shows it (its first part; later parts where
    they differ), or None for a run without one."""
    parts = load(run)
    if not parts:
        return None
    first = parts[0]
    v = first["versions"]
    checkout_ = first["kd"].get("checkout") or {}
    commit = checkout_.get("commit")
    kd_text = first["kd"]["version"] + (
        f" ({commit[:10]}{', modified' if checkout_.get('dirty') else ''})" if commit else ""
    )
    names = first["devices"]
    device = f"{len(names)} x {names[0]}" if len(set(names)) == 1 and len(names) > 1 else ", ".join(names)
    row = {
        "run": str(run),
        "teacher_weights": describe_side(first["teacher"]),
        "student_weights": describe_side(first["student"]),
        "versions": " ".join(
            f"{name} {v.get(name)}" for name in ("torch", "torchvision", "timm", "apex") if v.get(name)
        ),
        "kd": kd_text,
        "devices": device,
        "processes": f"{first['processes']} ({first['backend']})",
    }
    changed = [k for k in ("versions", "kd", "devices", "processes") if any(p.get(k) != first.get(k) for p in parts)]
    if len(parts) > 1:
        row["processes"] += f"; {len(parts)} parts" + (f", {', '.join(changed)} changed" if changed else "")
    return row
