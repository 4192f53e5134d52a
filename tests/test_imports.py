"""No import circles among kd's own modules (kd/, backends/, cli.py), few layers, and layers that
only point down (:data:`LAYERS`).

Every import statement that runs counts, at the top of a module or inside a function: an import
moved into a function to dodge a circle is still one. Imports under ``if TYPE_CHECKING:`` (for
annotations only; they never run) do not. A package and its submodules count as modules of
their own (``kd.losses`` is ``kd/losses/__init__.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest
from conftest import HANG_GUARD

ROOT = Path(__file__).resolve().parent.parent


def modules() -> Dict[str, Path]:
    found = {}
    for path in [*ROOT.glob("kd/**/*.py"), *ROOT.glob("backends/**/*.py"), ROOT / "cli.py"]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        test = node.test if isinstance(node, ast.If) else None
        if test is not None and getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING":
            yield from (n for orelse in node.orelse for n in [orelse, *runtime_nodes(orelse)])
            continue
        yield node
        yield from runtime_nodes(node)


def import_graph() -> Dict[str, Set[str]]:
    mods = modules()

    def owner(name: str) -> str:  # the module of ours that ``name`` lives in ("" for none)
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps.update(owner(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                deps.update(owner(f"{base}.{alias.name}") or owner(base) for alias in node.names)
        graph[mod] = deps - {mod, ""}
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_analysis_sees_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    code = "import a\nif TYPE_CHECKING:\n    import b\nelse:\n    import c\ndef f():\n    import d\n"
    seen = [n.names[0].name for n in runtime_nodes(ast.parse(code)) if isinstance(n, ast.Import)]
    assert seen == ["a", "c", "d"]
    graph = import_graph()
    assert "kd.losses.base" in graph["kd.losses.kd"]  # from-imports of submodules are seen
    assert "kd.run.loop" in graph["kd.run.jobs"]  # so are imports inside functions


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    mutual = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in graph.get(b, ())})
    assert not mutual, f"modules that import each other: {mutual}"


def test_no_import_circles():
    assert not cycles(import_graph()), "import circles (each a group of modules that reach one another)"


#: What a ``kd train`` process may import beyond torch and torchvision (which bring torch._dynamo,
#: torch._inductor, triton's Python side and FSDP themselves: torchvision.ops imports
#: torch._dynamo): kd, its CLI and the packages the run uses, and whatever TensorBoard's writer
#: brings where it is installed (:data:`IMPORTS_OF_THE_WRITER`: boto3 where it finds it, say).
#: Not timm for torchvision models, not matplotlib (kd report's figures), not safetensors (kd export's).
TRAIN_IMPORTS = {"kd", "backends", "cli", "click", "yaml", "tqdm", "tensorboard"}
TRAIN_IMPORTS |= {"numpy", "PIL", "torch", "torchvision", "typing_extensions", "packaging", "six"}

NEW_IMPORTS = """
new = {name.split(".")[0] for name in set(sys.modules) - before}
print(json.dumps(sorted(n for n in new if not n.startswith("_") and n not in sys.stdlib_module_names)))
"""
IMPORTS_OF_THE_WRITER = (
    """
import json, sys
import torch, torchvision
before = set(sys.modules)
from torch.utils.tensorboard import SummaryWriter
"""
    + NEW_IMPORTS
)

IMPORTS_OF_A_RUN = (
    """
import json, sys
import torch, torchvision
before = set(sys.modules)
import cli
cli.cli.main(args=sys.argv[1:], standalone_mode=False)
"""
    + NEW_IMPORTS
)


def test_a_training_run_imports_only_what_it_uses(tmp_path):
    """Each import a run does not use is set-up time before every first step (the parent of a
    several-process run and each of its processes pay it)."""
    import json
    import subprocess
    import sys

    args = ["train", "--data", "synthetic", "--teacher", "resnet18", "--teacher-weights", "none"]
    args += ["--student", "resnet18", "--device", "cpu", "--epochs", "1", "--limit-train-batches", "1"]
    args += ["--limit-val-batches", "1", "-b", "2", "--image-size", "32", "--out", str(tmp_path / "run")]

    def imports(code: str, *args: str) -> Set[str]:
        r = subprocess.run(
            [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD
        )
        assert r.returncode == 0, r.stderr
        return set(json.loads(r.stdout.strip().splitlines()[-1]))

    imported = imports(IMPORTS_OF_A_RUN, *args)
    assert {"kd", "tensorboard", "yaml"} <= imported  # the check sees what the run imports
    allowed = TRAIN_IMPORTS | imports(IMPORTS_OF_THE_WRITER)
    assert imported <= allowed, f"imported beyond what a run uses: {sorted(imported - allowed)}"


def longest_chain(graph: Dict[str, Set[str]], start: str) -> List[str]:
    """The longest import chain from ``start`` down to a leaf (the graph has no circles)."""
    memo: Dict[str, List[str]] = {}

    def down(m: str) -> List[str]:
        if m not in memo:
            memo[m] = [m] + max((down(d) for d in sorted(graph.get(m, ()))), key=len, default=[])
        return memo[m]

    return down(start)


def test_the_longest_import_chain_is_at_most_ten_modules():
    """A reader follows cli.py down to the leaves in at most ten steps: the layers are few."""
    assert longest_chain({"a": {"b", "c"}, "b": {"c"}, "c": set()}, "a") == ["a", "b", "c"]
    graph = import_graph()
    chain = max((longest_chain(graph, m) for m in graph), key=len)
    assert len(chain) <= 10, f"{len(chain)} modules: {' -> '.join(chain)}"


def test_at_most_a_dozen_modules_directly_under_kd():
    top = sorted(p.name for p in (ROOT / "kd").glob("*.py"))
    assert len(top) <= 12, top


def test_nothing_but_the_cli_and_the_commands_import_the_commands():
    """kd.commands is what the command line calls (kd/commands/__init__.py): the run, the teacher
    and the data never depend on it."""
    graph = import_graph()
    users = sorted(m for m, deps in graph.items() for d in deps if d.startswith("kd.commands"))
    assert all(m == "cli" or m.startswith("kd.commands") for m in users), users


#: kd's layers, the lowest first: a module imports modules of its own layer or of those below it,
#: never of one above. A name is a module, or a package with its submodules (``kd`` itself is only
#: kd/__init__.py, the ``kd.train`` of the Python API).
LAYERS: List[Tuple[str, List[str]]] = [
    (
        "the helpers",
        [
            "kd.errors",
            "kd.checksum",
            "kd.runfolder",
            "kd.runlock",
            "kd.process_deaths",
            "kd.registry",
            "kd.version",
            "kd.nest",
            "kd.utils",
        ],
    ),
    ("the parts of a run", ["kd.models", "kd.losses", "kd.precision", "kd.data", "kd.teacher", "backends"]),
    ("the run's options", ["kd.config"]),  # checked against the registries of losses and models
    ("the engine", ["kd.run"]),
    ("the entry points", ["kd.commands", "cli", "kd.siblings", "kd"]),
]

#: Which parts of a run import which others; any other import between two parts is refused.
PARTS_IMPORT: Dict[str, Set[str]] = {
    "kd.models": set(),
    "kd.losses": set(),
    "kd.precision": set(),
    "kd.data": {"kd.models"},  # a model's data config (mean, std, crop)
    "kd.teacher": {"kd.models", "kd.precision", "kd.data"},  # its own val crops (a model's eval transform)
    "backends": {"kd.precision"},  # apex's amp beside apex's DDP
}

#: Modules that import no module of kd's (kd.runfolder reads a run's records: it raises kd.errors' KDError).
LEAVES = ["kd.errors", "kd.checksum", "kd.version"]


def place(module: str) -> Tuple[int, str]:
    """``module``'s layer (its index in :data:`LAYERS`) and the name of the table that holds it."""
    names = {name: i for i, (_, layer) in enumerate(LAYERS) for name in layer}
    for name in sorted(names, key=len, reverse=True):
        if module == name or (name != "kd" and module.startswith(name + ".")):
            return names[name], name
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_imports.py")


def layer_violations(graph: Dict[str, Set[str]]) -> List[str]:
    """Each import of ``graph`` the layer table refuses, in words."""
    found = []
    for module, deps in sorted(graph.items()):
        layer, home = place(module)
        for dep in sorted(deps):
            dep_layer, dep_home = place(dep)
            if dep_layer > layer:
                found.append(f"{module} imports {dep}, of {LAYERS[dep_layer][0]}, a layer above {LAYERS[layer][0]}")
            elif home in PARTS_IMPORT and dep_home in PARTS_IMPORT and dep_home not in PARTS_IMPORT[home] | {home}:
                allowed = ", ".join(sorted(PARTS_IMPORT[home])) or "no other part"
                found.append(f"{module} imports {dep}: {home} may import {allowed}")
    return found


def test_the_layer_check_sees_an_import_that_points_up():
    up = {"kd.models": {"kd.errors", "kd.run.checkpoint"}, "kd.run.checkpoint": {"kd.models"}}
    assert layer_violations(up) == [
        "kd.models imports kd.run.checkpoint, of the engine, a layer above the parts of a run"
    ]
    sideways = {"kd.losses.kd": {"kd.teacher.frozen"}, "kd.teacher.frozen": {"kd.models", "kd.utils.taps"}}
    assert layer_violations(sideways) == ["kd.losses.kd imports kd.teacher.frozen: kd.losses may import no other part"]
    assert place("kd") == (4, "kd") and place("kd.utils.signals") == (0, "kd.utils")
    with pytest.raises(AssertionError, match="kd.newcomer is in no layer"):
        place("kd.newcomer")


def test_layers_only_point_down():
    """The helpers, the parts of a run (data, models, losses, precision, teacher, backends), the
    run's options, the engine (kd.run), the entry points: each imports only its own layer and those
    below, and the parts import one another only as PARTS_IMPORT says."""
    parts = dict(LAYERS)["the parts of a run"]
    assert sorted(PARTS_IMPORT) == sorted(parts) and all(PARTS_IMPORT[p] <= set(parts) for p in parts)
    graph = import_graph()
    violations = layer_violations(graph)
    assert not violations, "imports against the layers:\n" + "\n".join(violations)
    for leaf in LEAVES:
        assert not graph[leaf], f"{leaf} imports {sorted(graph[leaf])}: it is a leaf"
