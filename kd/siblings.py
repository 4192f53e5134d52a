"""kd's modules outside the ``kd`` package: ``backends`` and ``cli``, installed beside ``kd``
under those plain names (``recipes`` too, which kd reads by its place beside ``kd``, never
imports). Another distribution's module of such a name, installed over kd's or earlier on
``sys.path``, would be imported in kd's place; :func:`own` imports one and refuses a stranger in
one line that names where it came from and what to do. The ``kd`` console script is
:func:`run_cli`: kd's own ``cli``, checked so.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import List

from kd.errors import KDError

#: True in each of kd's own (backends/__init__.py, cli.py); another package of the name has none
MARK = "KD_SIBLING"


def own(name: str) -> ModuleType:
    """The module ``name`` (``backends``, ``cli``) imported, where it is kd's own; else a KDError."""
    module = importlib.import_module(name)
    if getattr(module, MARK, False) is not True:
        raise KDError(stranger(name, module))
    return module


def run_cli() -> None:
    """The ``kd`` console script: ``cli.run()`` where ``cli`` is kd's own, else one line and exit 2."""
    try:
        cli = own("cli")
    except KDError as exc:
        sys.stderr.write(f"kd: error: {exc}\n")
        sys.exit(2)
    cli.run()


def stranger(name: str, module: ModuleType) -> str:
    """Why ``module``, imported as ``name``, is not kd's, and what to do about it."""
    where = module.__file__ or ", ".join(getattr(module, "__path__", [])) or "a module without a file"
    reinstall = "reinstall kd (pip install --force-reinstall --no-deps kd, or . from its source)"
    owners = installed_by(Path(module.__file__)) if module.__file__ else []
    if owners:
        return (
            f"Python imports {name!r} from {where}, which {' and '.join(owners)} installed, not kd: it takes "
            f"the place of kd's own; pip uninstall {owners[0]}, then {reinstall}"
        )
    home = Path(__file__).resolve().parent.parent  # where kd's own sit, beside the kd package
    if Path(where).resolve() in (home / name, home / name / "__init__.py", home / f"{name}.py"):
        return f"Python imports {name!r} from {where}, where kd's own belongs, but it is not kd's; {reinstall}"
    return (
        f"Python imports {name!r} from {where}, not kd's own (it comes first on sys.path); "
        f"rename or move it, or run kd from another folder"
    )


def installed_by(path: Path) -> List[str]:
    """The distributions other than kd whose files include ``path``."""
    from importlib.metadata import distributions

    path = path.resolve()
    owners = []
    for dist in distributions():
        name = dist.metadata["Name"] or ""
        if name.lower() == "kd" or name in owners:
            continue
        if any(f.name == path.name and Path(str(dist.locate_file(f))).resolve() == path for f in dist.files or ()):
            owners.append(name)
    return owners
