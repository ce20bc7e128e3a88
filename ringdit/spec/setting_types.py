"""The type a setting must have, read from the code that takes it: a ``_target_``'s parameters (``model.*`` from the
model class, ``optimizer.*`` from the optimizer) declare it in their annotations, or, unannotated, by their default's
type. One check for all of them, so that ``model.activation_offload=maybe`` -- a string, true to Python -- is refused
like ``model.activation_offload=1`` instead of switching offloading on; a new boolean setting is covered by its
annotation, with no list of names to keep.

Only what a config value can be is checked: booleans, whole numbers and real numbers (``None`` where the parameter is
optional). A parameter that also takes another kind of value (a tuple, a dict, a path string) is left to the checks
of its own meaning; so are values (ranges) -- this is about the kind of value.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping

import torch

from ringdit.common.errors import ConfigError

CHECKED = (bool, int, float, type(None))
WORDS = {bool: ("true", "false"), int: ("a whole number",), float: ("a number",), type(None): ("null",)}


def declared_types(target: Callable) -> dict[str, tuple[type, ...]]:
    """``target``'s parameters whose values a config can hold, each with the types it accepts (``float`` takes an
    int too); parameters that take anything else, or that nothing declares, are left out."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin without a signature: nothing declared
        return {}
    try:
        hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve here: read the defaults instead
        hints = {}
    declared = {}
    for name, parameter in signature.parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        annotation = hints.get(name, inspect.Parameter.empty)
        if annotation is inspect.Parameter.empty:  # unannotated: its default says (torchao's amsgrad=False)
            default = parameter.default
            if default is inspect.Parameter.empty or type(default) not in CHECKED[:3]:
                continue
            annotation = type(default)
        members = tuple(m for m in (typing.get_args(annotation) or (annotation,)) if m is not torch.Tensor)
        if members and all(m in CHECKED for m in members):  # a Tensor member: a config never holds one
            declared[name] = members
    return declared


def fits(value, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # before int: True is an int to Python, not to a setting
        return bool in types
    if isinstance(value, int):
        return int in types or float in types
    if isinstance(value, float):
        return float in types
    return value is None and type(None) in types


def check_setting_types(prefix: str, settings: Mapping, target: Callable, defaults: Mapping | None = None) -> None:
    """A ConfigError naming ``<prefix>.<key>`` for each of ``settings`` whose value is not of the kind ``target``
    declares for it; the fix given is the declared default (or ``defaults``' value, the preset's)."""
    declared = declared_types(target)
    parameters = inspect.signature(target).parameters if declared else {}
    for key, value in settings.items():
        types = declared.get(key)
        if types is None or fits(value, types):
            continue
        words = [word for t in types if not (t is int and float in types) for word in WORDS[t]]
        words = ", ".join(words[:-1]) + f" or {words[-1]}" if len(words) > 1 else words[0]
        default = (defaults or {}).get(key, parameters[key].default)
        fix = f", e.g. {prefix}.{key}={_as_setting(default)}" if fits(default, types) else ""
        shown = repr(value) if isinstance(value, str) else _as_setting(value)
        raise ConfigError(f"{prefix}.{key}={shown} must be {words}{fix}")


def _as_setting(value) -> str:
    """A value as it is written on the command line (``false``, ``null``, ``0.5``)."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return str(value)
