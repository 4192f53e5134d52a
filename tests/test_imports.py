"""No import circles among kd's own modules (kd/, backends/, cli.py).

Every import statement counts, at the top of a module or inside a function: an import moved into
a function to dodge a circle is still one. A package and its submodules count as modules of
their own (``kd.losses`` is ``kd/losses/__init__.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parent.parent


def modules() -> Dict[str, Path]:
    found = {}
    for path in [*ROOT.glob("kd/**/*.py"), *ROOT.glob("backends/**/*.py"), ROOT / "cli.py"]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


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
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
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
    graph = import_graph()
    assert "kd.losses.base" in graph["kd.losses.kd"]  # from-imports of submodules are seen
    assert "kd.engine" in graph["kd.launch"]  # so are imports inside functions


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    mutual = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in graph.get(b, ())})
    assert not mutual, f"modules that import each other: {mutual}"


def test_no_import_circles():
    assert not cycles(import_graph()), "import circles (each a group of modules that reach one another)"
