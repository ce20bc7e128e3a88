"""ringdit's modules import each other without cycles -- counting the imports inside functions, which hide a cycle
until the function runs: each module can be read, tested and changed on top of the ones it imports."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ringdit"


def module_files() -> dict[str, Path]:
    """``ringdit.media.text`` -> its file (a package: its ``__init__.py``)."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imported(module: str, node: ast.Import | ast.ImportFrom, files: dict[str, Path]) -> list[str]:
    """The ringdit modules an import statement of ``module`` loads (the longest known prefix of each name)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the module's package, up level - 1 packages
            package = module.split(".") if files[module].name == "__init__.py" else module.split(".")[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
        names = [f"{base}.{alias.name}" for alias in node.names]
    found = []
    for name in names:
        while name and name not in files:
            name = name.rpartition(".")[0]
        if name.startswith("ringdit"):
            found.append(name)
    return found


def with_packages(name: str) -> list[str]:
    """``ringdit.a.b`` and the packages importing it runs first: ``ringdit.a`` (its ``__init__``), ``ringdit``."""
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(len(parts), 0, -1)]


def import_graph() -> dict[str, set[str]]:
    """module -> the ringdit modules it imports anywhere in its file, with the packages those imports run first (a
    package's ``__init__`` is code too: ``ringdit.costs`` importing ``ringdit.spec.model`` runs
    ``ringdit/spec/__init__.py`` and everything it imports). Not its own packages, loaded before it."""
    files = module_files()
    graph = {module: set() for module in files}
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module] |= {package for name in imported(module, node, files) for package in with_packages(name)
                                  if package != module and not module.startswith(f"{package}.")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = counter
                    counter += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_cycles_in_ringdit():
    graph = import_graph()
    assert "ringdit.media.text" in graph and "ringdit.media.glyph" in graph["ringdit.media.text"]
    assert "ringdit.spec" in graph["ringdit.training.run"]  # through ringdit.spec.* : the package's __init__ runs
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
