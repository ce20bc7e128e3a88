"""Every fact about a model kind lives on its record in ``ringdit/models/`` (a diffusers ``Family``, the DiT's class,
a ``VaeKind``): code elsewhere asks the record and never names a kind to decide. Read from the source (AST), so a
new table keyed by family or class names, a ``conditioning == "text"`` test, or a search of the family registry
``FAMILIES`` (ask its questions instead: ``find_family``, ``family_of_pipeline``, ``families_of_class``, ...) fails
here. Nor does code outside duck-type a model: ``hasattr(model, "x")`` / ``getattr(model, "x", default)`` of a
model's member fails (every member is the contract's, ``ringdit.models.protocol``, with ``KindDefaults`` answering for
a kind without it: call it plainly)."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import typing
from pathlib import Path

import pytest
from torch import nn

from ringdit.models import DiT
from ringdit.models.conditioning import NULL_KEYS
from ringdit.models.diffusers import DiffusersTransformer
from ringdit.models.diffusers.families import FAMILIES
from ringdit.models.protocol import DiffusionModel, KindDefaults
from ringdit.models.vaes import VAE_KINDS

PACKAGE = Path(__file__).resolve().parent.parent / "ringdit"
KINDS = Path("models")  # where the kind records live, relative to the package
REGISTRY = "FAMILIES"  # the diffusers families' registry: only ringdit/models/ reads it
# hasattr / getattr-with-default of a name a model has, on something that is no model: (module, name) -> what it is
NOT_A_MODEL = {
    ("media/parallel_vae.py", "patch_size"): "a VAE's config (the Wan 2.2 VAE's pixel patching)",
}


def kind_names() -> set[str]:
    """Every name a kind answers to: the families, their transformer classes, the DiT, the VAE classes."""
    return ({*FAMILIES, *(family.model_class for family in FAMILIES.values()), DiT.kind_name, DiT.__name__,
             *VAE_KINDS})


def outside_kinds() -> list[Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py"))
            if path.relative_to(PACKAGE).parts[:1] != KINDS.parts]


def _strings(node: ast.AST) -> set[str]:
    """The strings a constant or a literal tuple / list / set of constants holds; empty for anything else."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    if all(isinstance(item, ast.Constant) and isinstance(item.value, str) for item in items):
        return {item.value for item in items}
    return set()


def findings(path: Path, names: set[str]) -> list[str]:
    """``path:line: what`` for each kind name written as a string, each comparison of a ``conditioning`` with ``==`` /
    ``!=`` / ``in``, and each of a class's ``__name__`` with a kind name or a table of them."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    # the module's own constant tables (NAMES = {"A", "B"}): a class-name test against one is read through it
    tables = {node.targets[0].id: node.value for node in tree.body if isinstance(node, ast.Assign)
              and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) and _strings(node.value)}
    for node in ast.walk(tree):
        where = f"{path}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.append(f"{where}: the kind name {node.value!r}")
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            sides = [node.left, *node.comparators]
            text = ast.unparse(node)
            if any("conditioning" in ast.unparse(side) for side in sides if not isinstance(side, ast.Constant)):
                found.append(f"{where}: a conditioning test `{text}`")
            # type(x).__name__ against a table (a name) or a kind's class name; a tokenizer's class is no kind
            names_a_class = any(isinstance(side, ast.Attribute) and side.attr == "__name__"
                                and not isinstance(side.value, ast.Name) for side in sides)
            against = [tables.get(side.id, side) if isinstance(side, ast.Name) else side for side in sides
                       if not (isinstance(side, ast.Attribute) and side.attr == "__name__")]
            if names_a_class and any(not _strings(side) or _strings(side) & names for side in against):
                found.append(f"{where}: a class-name test `{text}`")
        # the registry read directly (imported, iterated, indexed, searched): its questions live beside it
        named = {ast.Name: "id", ast.Attribute: "attr", ast.alias: "name"}.get(type(node))
        if named and getattr(node, named) == REGISTRY:
            found.append(f"{where}: the family registry {REGISTRY} read directly")
    return found


@functools.cache
def model_members() -> frozenset[str]:
    """Every name a model answers to beyond ``nn.Module``'s own: the contract's (``DiffusionModel``,
    ``KindDefaults``), the DiT's and ``DiffusersTransformer``'s class members, and what their code sets on an instance
    (``self.x = ...``: attributes and submodules; ``register_buffer("x", ...)``; every null-condition buffer)."""
    kinds = (DiffusionModel, KindDefaults, DiT, DiffusersTransformer)
    names = {name for kind in kinds for name in dir(kind)} | set(NULL_KEYS.values())
    for kind in (DiT, DiffusersTransformer):
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(kind)))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "register_buffer" and isinstance(node.args[0], ast.Constant):
                names.add(node.args[0].value)
    return frozenset(names - set(dir(nn.Module())) - set(dir(typing.Protocol))
                     - {"_is_protocol", "_is_runtime_protocol", "_abc_impl"})


def duck_typing(path: Path, members: frozenset[str], allowed: dict = NOT_A_MODEL) -> list[str]:
    """``path:line: what`` for each ``hasattr(x, "member")`` / ``getattr(x, "member", default)`` of a model member,
    but the ``allowed`` (module, name) pairs, whose object is no model."""
    found = []
    module = path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else path.name
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2
                and (node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3))):
            continue
        name = node.args[1]
        if isinstance(name, ast.Constant) and name.value in members and (module, name.value) not in allowed:
            found.append(f"{path}:{node.lineno}: duck typing on a model member `{ast.unparse(node)}`")
    return found


def found_outside(check, *args) -> str:
    """``check(path, *args)``'s findings in every module outside the kinds, one a line."""
    return "\n".join(line for path in outside_kinds() for line in check(path, *args))


def test_no_duck_typing_of_a_model_outside_the_kinds():
    found = found_outside(duck_typing, model_members())
    assert not found, ("a model's member asked whether it exists outside ringdit/models/ (make it a member of "
                       "ringdit.models.protocol.DiffusionModel with a default on KindDefaults, and call it plainly; "
                       "an object that is no model goes in NOT_A_MODEL with what it is):\n" + found)


@pytest.mark.parametrize("source", [
    'if hasattr(model, "with_condition_frames"):\n    pass\n',
    'weights = getattr(self.model, "loss_weights", None)\n',
    'text = getattr(meta_model, "null_text", None)\n',
    'state = getattr(model, "_ringdit_sequence", None)\n',
    'arch = getattr(getattr(meta_model, "transformer", None), "config", None)\n',
])
def test_the_duck_typing_check_finds_each_form(tmp_path, source):
    path = tmp_path / "leak.py"
    path.write_text(source)
    assert duck_typing(path, model_members())


def test_the_duck_typing_check_passes_plain_calls_and_non_members(tmp_path):
    path = tmp_path / "plain.py"
    path.write_text('x = model.with_condition_frames(x, c)\nok = hasattr(vae, "use_tiling")\n'
                    'arch = getattr(model, "transformer")\n')
    assert duck_typing(path, model_members()) == []
    path.write_text('p = getattr(vae.config, "patch_size", None)\n')
    assert duck_typing(path, model_members()) and not duck_typing(path, model_members(), {("plain.py", "patch_size")})


def test_no_kind_names_or_conditioning_tests_outside_the_kinds():
    found = found_outside(findings, kind_names())
    assert not found, ("model-kind facts decided outside ringdit/models/ (put the fact on the kind record -- Family, "
                       "the DiT, VaeKind -- and ask it; search the family registry with its own functions in "
                       "ringdit/models/diffusers/families.py):\n" + found)


@pytest.mark.parametrize("source, expected", [
    ('if data["conditioning"] == "text":\n    pass\n', "conditioning test"),
    ('x = {"wan": 1}\n', "kind name 'wan'"),
    ('ok = type(vae).__name__ in ("AutoencoderKLWan",)\n', "class-name test"),
    ('WAN_VAES = ("AutoencoderKLWan",)\nok = type(vae).__name__ in WAN_VAES\n', "class-name test"),
    ('ok = type(vae).__name__ in settings.tables\n', "class-name test"),
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
    path.write_text('if __name__ == "__main__":\n    kind = model.kind_name\nok = what[0] == "image conditioning"\n'
                    'CLEAN = {"MiniMaxH3Scheduler"}\nclean = type(scheduler).__name__ in CLEAN\n')
    assert findings(path, kind_names()) == []
