"""The floating-point dtypes a setting may name (``dtype=bfloat16``, ``trainer.strategy.param_dtype=...``), and the
default dtype set for a block of code."""

from __future__ import annotations

import contextlib

import torch

from ringdit.common.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_named(setting: str, name: str) -> torch.dtype:
    """The dtype ``name`` given as ``setting``; a ConfigError naming the choices for anything else."""
    if name not in DTYPES:
        raise ConfigError(f"{setting}={name!r} is not a dtype ringdit takes; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """``torch``'s default dtype set to ``dtype`` inside the block, restored after (an error included)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
