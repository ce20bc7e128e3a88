"""Rooms by concern (issue 58): no ringdit module over 500 lines, unless its docstring says why it must be one; no
two modules of one name (a reader, a traceback and an editor's tab each show the name alone)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ringdit"
MOST_LINES = 500


def test_no_module_over_500_lines_without_a_reason():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        lines = len(text.splitlines())
        doc = ast.get_docstring(ast.parse(text)) or ""
        if lines > MOST_LINES and "must be one module" not in doc:
            long.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines")
    assert not long, f"split these by concern, or say in the docstring why each must be one module: {long}"


def test_no_two_modules_share_a_name():
    where = defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):  # Python's own names: a package and its command
            where[path.name].append(str(path.relative_to(PACKAGE.parent)))
    clashes = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not clashes, f"give each module a name that says what it holds: {clashes}"
