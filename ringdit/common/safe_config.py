"""Configs read from weights files are data, never code.

A ringdit checkpoint or export carries the configs it was trained with (``model``, ``objective``, ``data``,
``sampling``); infer.py builds the model and objective from them with ``hydra.utils.instantiate``, which imports and
calls whatever ``_target_`` names. A crafted file could name ``builtins.open`` or ``os.system``. So every config that
comes out of a file passes ``check_file_config`` first: each ``_target_``, at any depth and inside lists, must be in
``ALLOWED_TARGETS``; Hydra's other special keys (``_args_``, ``_partial_``, ...) and OmegaConf interpolations
(``${oc.env:...}`` reads the environment) are refused outright.

The allow-list is an explicit registry: a new model family or objective that checkpoints may name registers its
import path once, next to its definition::

    from ringdit.common.safe_config import allow_target
    allow_target("ringdit.models.diffusers.WanTransformer")
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ringdit.common.errors import CheckpointError

ALLOWED_TARGETS: set[str] = {
    "ringdit.models.DiT",
    "ringdit.models.diffusers.DiffusersTransformer",  # conf/model/{wan,flux,qwenimage}*.yaml (on main)
    "ringdit.diffusion.FlowMatching",
    "ringdit.diffusion.DDPM",
}


def allow_target(target: str) -> str:
    """Let weights files name ``target`` (a dotted import path, exactly as the configs write it) as a ``_target_``."""
    if not isinstance(target, str) or not target or target != target.strip() or "${" in target:
        raise ValueError(f"allow_target takes a dotted import path such as 'ringdit.models.DiT', got {target!r}")
    ALLOWED_TARGETS.add(target)
    return target


def check_file_config(source: str, key: str, config: Any) -> None:
    """Raise ``CheckpointError`` (one line: the file, the key path, the value) unless ``config`` -- read from the
    file ``source`` under ``key`` -- is plain data whose every ``_target_`` is allowed."""
    for path, value in _walk(config, key):
        if isinstance(value, str) and "${" in value:
            _refuse(source, path, f"holds an interpolation {_short(value)}; file configs are plain data, not "
                                  f"resolved (an interpolation can read environment variables)")
        if not isinstance(value, Mapping):
            continue
        for name in value:
            if not isinstance(name, str):
                _refuse(source, path, f"has a non-string key {name!r}")
            if name == "_target_":
                target = value[name]
                if not isinstance(target, str) or target not in ALLOWED_TARGETS:
                    _refuse(source, f"{path}._target_", f"names {_short(target)}, which ringdit does not build "
                                                        f"from a file (allowed: {', '.join(sorted(ALLOWED_TARGETS))})")
            elif name.startswith("_") and name.endswith("_"):  # Hydra's _args_, _partial_, _recursive_, _convert_
                _refuse(source, f"{path}.{name}", "is a Hydra instantiation key; file configs may only name an "
                                                  "allowed _target_ and its keyword settings")


def check_file_configs(source: str, configs: Mapping[str, Any]) -> None:
    """``check_file_config`` for each entry of ``configs`` (every config a file carries)."""
    for key, config in configs.items():
        check_file_config(source, str(key), config)


def _walk(value: Any, path: str):
    """(key path, value) of ``value`` and everything nested in it, dicts and lists alike."""
    yield path, value
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _walk(item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _walk(item, f"{path}[{index}]")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _refuse(source: str, path: str, why: str) -> None:
    raise CheckpointError(f"refusing {source}: its config {path} {why}. Configs in weights files are data, not code: "
                          f"use a file ringdit wrote, or re-export a checkpoint you trust")
