"""Imports of ringdit modules go at the top of a module, where a reader sees what it stands on (and the import
graph's test sees every edge). Few stay inside functions, each with its reason in a comment: start-up time (``import
ringdit`` and a command's ``--help`` answer before torch / Lightning load) or an optional dependency."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ringdit"
MOST_LAZY = 40  # issue 58: the layering is held by the import graph's test, not by hiding imports in functions


def lazy_imports(source: str) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ringdit modules (absolute or relative) inside a function of ``source``."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import) and any(
                    alias.name.split(".")[0] == "ringdit" for alias in child.names):
                found.append(child)
            elif in_function and isinstance(child, ast.ImportFrom) and (
                    child.level or (child.module or "").split(".")[0] == "ringdit"):
                found.append(child)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return found


def all_lazy_imports() -> list[tuple[str, int, bool]]:
    """(file:line, statement, whether a comment says why: on the statement's lines or the line above)."""
    rows = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in lazy_imports("\n".join(lines)):
            said = any("#" in line for line in lines[node.lineno - 1:node.end_lineno]) or \
                lines[node.lineno - 2].strip().startswith("#")
            rows.append((f"{path.relative_to(PACKAGE.parent)}:{node.lineno}", ast.unparse(node), said))
    return rows


def test_few_ringdit_imports_inside_functions():
    rows = all_lazy_imports()
    assert len(rows) <= MOST_LAZY, "\n".join(f"{where}: {statement}" for where, statement, _ in rows)


def test_each_ringdit_import_inside_a_function_says_why():
    silent = [f"{where}: {statement}" for where, statement, said in all_lazy_imports() if not said]
    assert not silent, "say why in a comment (start-up time, optional dependency), or import at the top:\n" + \
        "\n".join(silent)


def test_the_counter_finds_lazy_imports():
    source = ("from ringdit.a import b\n"
              "def f():\n    from ringdit.c import d\n    import ringdit.e\n    from . import g\n    import os\n"
              "class C:\n    def m(self):\n        from ringdit import h\n")
    assert [node.lineno for node in lazy_imports(source)] == [3, 4, 5, 9]
