"""No import circle anywhere in the tree, of any length: the strongly connected components of
the graph of crowdchat's own modules (every import counts, also inside functions and
TYPE_CHECKING blocks) are single modules."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_OURS = {".venv", ".venv-vllm", ".git", "node_modules", "data"}


def module_files() -> dict[str, Path]:
    """Module name -> file, for every .py file of the tree (a package: its __init__)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if NOT_OURS.isdisjoint(rel.parts):
            parts = rel.with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Our modules that module `name` (at `path`) imports: `from p import x` is p.x where that
    is a module, else p itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in modules:
                    out.add(sub)
                elif base in modules:
                    out.add(base)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return found


def test_the_circle_finder_finds_circles_of_any_length() -> None:
    ring = {f"m{i}": {f"m{(i + 1) % 8}"} for i in range(8)}
    assert circles(ring) == [sorted(ring)]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    two = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"c"}}
    assert sorted(circles(two)) == [["a", "b"], ["c", "d"]]


def test_the_graph_sees_the_imports_a_circle_would_be_made_of() -> None:
    graph = import_graph()
    assert "engine.metrics" in graph["engine.core.engine"]  # a plain from-import of a module
    # `from engine.kernels import cpu_kernels`
    assert "engine.kernels.cpu_kernels" in graph["engine.model.loader"]
    assert "engine.upstream.backend" in graph["engine"]  # an import inside a function


def test_no_module_of_the_tree_imports_itself_through_others() -> None:
    assert circles(import_graph()) == []


# engine's sub-packages and what each may import of the others (docs/ARCHITECTURE.md)
LAYERS = {
    "engine.kernels": set(),
    "engine.model": {"engine.kernels"},
    "engine.core": {"engine.model", "engine.kernels"},
    "engine.upstream": {"engine.model"},
}


def test_the_engines_sub_packages_import_only_downwards() -> None:
    """The model never schedules, the scheduler never talks to vLLM, the vLLM backend never
    reaches into the built-in engine, the kernels stand alone; the top level of engine/ (the
    seam and the shared types) imports no sub-package but in engine/__init__.py."""
    wrong = []
    for name, deps in import_graph().items():
        if not name.startswith("engine"):
            continue
        home = next((p for p in LAYERS if name == p or name.startswith(p + ".")), None)
        allowed = {home} | LAYERS[home] if home else {"engine"} if name == "engine" else set()
        for dep in deps:
            layer = next((p for p in LAYERS if dep == p or dep.startswith(p + ".")), None)
            if layer is not None and layer not in allowed and name != "engine":
                wrong.append(f"{name} -> {dep}")
    assert wrong == []
