"""Every fact about a model kind lives on its record in ``ringdit/models/`` (a diffusers ``Family``, the DiT's class,
a ``VaeKind``): code elsewhere asks the record and never names a kind to decide. Read from the source (AST), so a
new table keyed by family or class names, a ``conditioning == "text"`` test, or a search of the family registry
``FAMILIES`` (ask its questions instead: ``find_family``, ``family_of_pipeline``, ``families_of_class``, ...) fails
here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ringdit.models import DiT
from ringdit.models.diffusers.families import FAMILIES
from ringdit.models.vaes import VAE_KINDS

PACKAGE = Path(__file__).resolve().parent.parent / "ringdit"
KINDS = Path("models")  # where the kind records live, relative to the package
REGISTRY = "FAMILIES"  # the diffusers families' registry: only ringdit/models/ reads it


def kind_names() -> set[str]:
    """Every name a kind answers to: the families, their transformer classes, the DiT, the VAE classes."""
    return ({*FAMILIES, *(family.model_class for family in FAMILIES.values()), DiT.kind_name, DiT.__name__,
             *VAE_KINDS})


def outside_kinds() -> list[Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py"))
            if path.relative_to(PACKAGE).parts[:1] != KINDS.parts]


def findings(path: Path, names: set[str]) -> list[str]:
    """``path:line: what`` for each kind name written as a string, each comparison of a ``conditioning`` with ``==`` /
    ``!=`` / ``in``, and each of a class's ``__name__`` with a kind name or a table of them."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.append(f"{where}: the kind name {node.value!r}")
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            sides = [node.left, *node.comparators]
            text = ast.unparse(node)
            if any("conditioning" in ast.unparse(side) for side in sides):
                found.append(f"{where}: a conditioning test `{text}`")
            # type(x).__name__ against a table (a name) or a kind's class name; a tokenizer's class is no kind
            names_a_class = any(isinstance(side, ast.Attribute) and side.attr == "__name__"
                                and not isinstance(side.value, ast.Name) for side in sides)
            against = [side for side in sides if not (isinstance(side, ast.Attribute) and side.attr == "__name__")]
            if names_a_class and any(not isinstance(side, ast.Constant) or side.value in names for side in against):
                found.append(f"{where}: a class-name test `{text}`")
        # the registry read directly (imported, iterated, indexed, searched): its questions live beside it
        named = {ast.Name: "id", ast.Attribute: "attr", ast.alias: "name"}.get(type(node))
        if named and getattr(node, named) == REGISTRY:
            found.append(f"{where}: the family registry {REGISTRY} read directly")
    return found


def test_no_kind_names_or_conditioning_tests_outside_the_kinds():
    names = kind_names()
    found = [line for path in outside_kinds() for line in findings(path, names)]
    assert not found, ("model-kind facts decided outside ringdit/models/ (put the fact on the kind record -- Family, "
                       "the DiT, VaeKind -- and ask it; search the family registry with its own functions in "
                       "ringdit/models/diffusers/families.py):\n" + "\n".join(found))


@pytest.mark.parametrize("source, expected", [
    ('if data["conditioning"] == "text":\n    pass\n', "conditioning test"),
    ('x = {"wan": 1}\n', "kind name 'wan'"),
    ('ok = type(vae).__name__ in ("AutoencoderKLWan",)\n', "class-name test"),
    ('if family == "flux2":\n    pass\n', "kind name 'flux2'"),
    ('from ringdit.models.diffusers.families import FAMILIES\n', "registry FAMILIES read directly"),
    ('family = next(f for f in FAMILIES.values() if name in f.pipelines)\n', "registry FAMILIES read directly"),
    ('rates = {f.fps for f in families.FAMILIES.values()}\n', "registry FAMILIES read directly"),
])
def test_the_check_finds_each_kind_of_leak(tmp_path, source, expected):
    """The check above can fail: each pattern it looks for is found."""
    path = tmp_path / "leak.py"
    path.write_text(source)
    assert any(expected in line for line in findings(path, kind_names()))


def test_the_check_passes_a_plain_module(tmp_path):
    path = tmp_path / "plain.py"
    path.write_text('if __name__ == "__main__":\n    kind = model.kind_name\n')
    assert findings(path, kind_names()) == []
