"""Model names as kd reads them, checked against the libraries' lists, without torch.

A model is a torchvision classification model (``resnet50``) or a timm model (``timm:NAME``),
which may carry timm's pretrained tag as timm users type it (``timm:NAME.TAG``). The lists of
names come from the libraries (:mod:`kd.models`, which needs torch); each time kd has them it
keeps them on disk, one file per library and installed version, so that the next command can
answer a mistaken name before torch is imported. No file for the installed version: the name is
left to :func:`kd.models.check_name`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from kd.errors import KDError, suggest
from kd.utils.archs import KD_ARCHS

TIMM_PREFIX = "timm:"
#: the libraries whose names kd keeps, and the lists of each: a library's list key -> its lists' keys
LIBRARIES = {"torchvision": ("models",), "timm": ("models", "pretrained")}

#: ``lists(library, key)``: a library's list of names, or None where it is not at hand
Lists = Callable[[str, str], Optional[Sequence[str]]]


def timm_parts(name: str) -> Tuple[str, Optional[str]]:
    """``(NAME, TAG)`` of ``timm:NAME.TAG``, ``(NAME, None)`` of ``timm:NAME`` (split at the
    first dot, as timm splits a name; an empty tag is timm's default, as no tag)."""
    arch, _, tag = name[len(TIMM_PREFIX) :].partition(".")
    return arch, tag or None


class NotAtHand(Exception):
    """A list of names that is needed to decide is not at hand."""


def refusal(name: str, lists: Lists) -> Optional[str]:
    """The one line that refuses model ``name``, or None where a library has it."""

    def need(library: str, key: str) -> Sequence[str]:
        found = lists(library, key)
        if found is None:
            raise NotAtHand(library)
        return found

    if name.startswith(TIMM_PREFIX):
        arch, tag = timm_parts(name)
        if arch in KD_ARCHS and tag is None:  # kd's own, in timm's lists once kd registers it
            return None
        archs = need("timm", "models")
        if arch not in archs:
            return f"unknown timm model {arch!r}{suggest(arch, archs)}"
        if tag is None or f"{arch}.{tag}" in need("timm", "pretrained"):
            return None
        tags = [p.partition(".")[2] for p in need("timm", "pretrained") if p.partition(".")[0] == arch]
        if not tags:
            return f"timm publishes no weights for {arch}, so no tag {tag!r}; use timm:{arch}"
        return f"timm has no tag {tag!r} for {arch}{suggest(tag, tags)}; its tags: {', '.join(tags)}"
    names = need("torchvision", "models")
    if name in names:
        return None
    hint = suggest(name, names)
    if not hint and name.partition(".")[0] in need("timm", "models"):
        hint = f" (timm has it: use timm:{name})"
    return f"unknown torchvision model {name!r}{hint}; use a torchvision classification model or timm:NAME"


def tag_disagreement(name: str, weights: Optional[str], options: Tuple[str, str] = ("", "")) -> Optional[str]:
    """The line that refuses timm weights ``timm:OTHER`` for a name that carries another tag
    (``timm:NAME.TAG``), or None; ``options``: the two options that gave them (``--teacher``,
    ``--teacher-weights``), named in the line where given."""
    if not (name.startswith(TIMM_PREFIX) and weights and weights.startswith(TIMM_PREFIX)):
        return None
    arch, tag = timm_parts(name)
    other = weights[len(TIMM_PREFIX) :]
    if tag is None or other == tag:
        return None
    model = f"{options[0]} " if options[0] else ""
    given = options[1] or "the weights"
    untagged = f"{model}timm:{arch} {options[1]} {weights}" if options[1] else f"timm:{arch} with weights {weights}"
    return (
        f"{model}{name} asks for timm's {tag} weights but {given} {weights} for {other}: name them once, "
        f"as {model}timm:{arch}.{other} (or {untagged})"
    )


def from_file(weights: Optional[str]) -> bool:
    """Whether ``weights`` name a file (not none, pretrained, ``torchvision:TAG`` or ``timm:TAG``)."""
    return weights not in (None, "none", "pretrained") and not str(weights).startswith((TIMM_PREFIX, "torchvision:"))


def file_for_tag(name: str, weights: Optional[str]) -> bool:
    """Whether ``weights`` (a file) replace the weights a tag in ``name`` names (``timm:NAME.TAG``):
    timm builds the model as the tag configures it and loads the file, as
    ``timm.create_model('NAME.TAG', checkpoint_path=FILE)`` does."""
    return name.startswith(TIMM_PREFIX) and timm_parts(name)[1] is not None and from_file(weights)


def check_early(name: str) -> None:
    """A KDError where the lists kept for the installed libraries refuse ``name``; where they
    are not kept (or cannot decide), nothing: :func:`kd.models.check_name` answers after torch."""
    if {"timm", "torchvision"} & set(sys.modules):
        return  # loaded here already: asked themselves after torch, with models registered in this process
    try:
        line = refusal(name, kept)
    except NotAtHand:
        return
    if line:
        raise KDError(line)


# ----------------------------------------------------------------------------- the lists on disk
def cache_file(library: str) -> Optional[Path]:
    """Where ``library``'s names are kept for its installed version (read from its package
    metadata, without importing it): ``$XDG_CACHE_HOME/kd/models-LIBRARY-VERSION.json``
    (``~/.cache`` without XDG_CACHE_HOME), the version followed by a digest of where it was
    installed from where pip recorded it (a commit of a git install). None where it is not
    installed, or installed editable: its source may change under the same version."""
    try:
        installed = metadata.distribution(library)
    except metadata.PackageNotFoundError:
        return None
    origin = installed.read_text("direct_url.json") or ""
    try:
        editable = bool(origin and json.loads(origin).get("dir_info", {}).get("editable"))
    except (ValueError, AttributeError):
        return None
    if editable:
        return None
    version = installed.version + (f"-{hashlib.sha256(origin.encode()).hexdigest()[:12]}" if origin else "")
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "kd" / f"models-{library}-{version}.json"


def kept(library: str, key: str) -> Optional[List[str]]:
    """``library``'s list ``key`` as kept for its installed version, or None (none kept, unreadable)."""
    path = cache_file(library)
    try:
        lists = json.loads(path.read_text(encoding="utf-8")) if path is not None else None
    except (OSError, ValueError):
        return None
    found = lists.get(key) if isinstance(lists, dict) else None
    return found if isinstance(found, list) and all(isinstance(n, str) for n in found) else None


def keep(library: str, lists: Dict[str, List[str]]) -> None:
    """Keep ``library``'s ``lists`` for its installed version, where not kept yet: written whole
    or not at all (a temporary file renamed); a cache that cannot be written is left unwritten."""
    path = cache_file(library)
    if path is None or path.is_file():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(lists, fh)
        os.replace(temporary, path)
    except OSError:
        Path(temporary).unlink(missing_ok=True)
