"""torch and torchvision as installed: a pair that cannot work together is named in one line before
either is imported (a CPU torch beside a CUDA torchvision ends in ``operator torchvision::nms does
not exist`` and a long traceback, once torchvision is imported).

Each package's ``version.py`` is read as text: importing torchvision is what fails.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Optional, Tuple

from kd.errors import KDError

#: torchvision 0.N goes with torch 2.(N - 15): 0.15 with 2.0, 0.29 with 2.14
TORCHVISION_MINOR_OFFSET = 15
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: the local version tags of PyTorch's builds: ``+cpu``, ``+cu130``, ``+rocm6.4``, ``+xpu``
BUILD_TAGS = r"cpu|cu\d+|rocm[\d.]+|xpu"


def version_of(package: str) -> Optional[str]:
    """The ``__version__`` that ``package``'s version.py holds (``2.14.1+cu130``), without importing
    it; None where it is not installed or keeps no such file."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    places = list(spec.submodule_search_locations or []) if spec else []
    for place in places:
        try:
            text = (Path(place) / "version.py").read_text(encoding="utf-8")
        except OSError:
            continue
        found = re.search(r"^__version__\s*(?::\s*\w+\s*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
        if found:
            return found.group(1)
    return None


def _parts(version: str) -> Tuple[Tuple[int, ...], str]:
    """((major, minor), build) of ``2.13.0+cpu``: ((2, 13), "cpu"); the build is "" without a local tag."""
    public, _, build = version.partition("+")
    numbers = tuple(int(n) for n in re.findall(r"\d+", public)[:2])
    return numbers, build


def _build_words(build: str) -> str:
    if build == "cpu":
        return "the CPU build"
    cuda = re.fullmatch(r"cu(\d+)(\d)", build)
    return f"the CUDA {cuda.group(1)}.{cuda.group(2)} build" if cuda else f"the {build} build"


def mismatch(torch_version: str, torchvision_version: str) -> Optional[str]:
    """Why torchvision ``torchvision_version`` cannot work with torch ``torch_version`` (another
    release than its own, or another build: CPU against CUDA, CUDA 12.8 against 13.0), with what to
    install; None where the pair fits (or their versions say too little to tell)."""
    (torch_num, torch_build), (vision_num, vision_build) = _parts(torch_version), _parts(torchvision_version)
    if len(torch_num) < 2 or len(vision_num) < 2:
        return None
    wanted = f"0.{torch_num[1] + TORCHVISION_MINOR_OFFSET}"
    other_release = torch_num[0] == 2 and vision_num[0] == 0 and f"0.{vision_num[1]}" != wanted
    # only the builds PyTorch's indexes name (a source build's tag is its commit: nothing to compare)
    known = all(re.fullmatch(BUILD_TAGS, build) for build in (torch_build, vision_build))
    other_build = known and torch_build != vision_build
    if not (other_release or other_build):
        return None
    why = (
        f"another release than torch {torch_num[0]}.{torch_num[1]}'s ({wanted})"
        if other_release
        else f"{_build_words(vision_build)} beside torch's {_build_words(torch_build)[4:]}"
    )
    pair = f"torch=={torch_version.partition('+')[0]} torchvision=={wanted}.*"
    index = f" --index-url {CPU_INDEX}" if torch_build == "cpu" else ""
    return (
        f"torchvision {torchvision_version} does not work with torch {torch_version}: it is {why}; "
        f"install the pair from one index: pip install --force-reinstall {pair}{index}"
        + ("" if index else f" (the CPU build: add --index-url {CPU_INDEX})")
    )


def check_torch_pair() -> None:
    """Raise the one line of :func:`mismatch` for the torch and torchvision installed here."""
    torch_version, vision_version = version_of("torch"), version_of("torchvision")
    if torch_version and vision_version:
        why = mismatch(torch_version, vision_version)
        if why:
            raise KDError(why)
