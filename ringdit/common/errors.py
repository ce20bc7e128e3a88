"""Errors a user can act on, and the checks of one setting's value that raise them, one wording per mistake; train.py
and infer.py show them as one line (``ringdit.commands.cli.user_errors``). The checks live here, not in ``ringdit.spec``,
so that data, media and parallel code can use the same ones without importing the run spec.
"""

from __future__ import annotations

import math


class ConfigError(ValueError):
    """A setting that cannot work."""


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite (``nonfinite_loss=stop``)."""


class CheckpointError(ValueError):
    """A weights file that is missing, unreadable, unsafe or does not fit the model."""


def require_count(setting: str, value, *, minimum: int = 1, optional: bool = False, hint: str = "") -> None:
    """``value`` is an integer >= ``minimum`` (not 1.5, not a bool): "<setting> must be a positive integer, got
    <value>" (or "an integer >= 0"), then ``hint`` (what to do instead); ``optional``: None is fine."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"{setting} must be {what}, got {value!r}" + (f"; {hint}" if hint else ""))


def require_number(setting: str, value, *, low: float | None = None, high: float | None = None,
                   low_open: bool = False, optional: bool = False) -> None:
    """``value`` is a finite real number in [low, high] (``low_open``: (low, high]); ``optional``: None is fine."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{setting} must be a finite number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low) or high is not None and value > high:
        interval = f"{'(' if low_open else '['}{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        raise ConfigError(f"{setting} must be in {interval}, got {value!r}")


def require_seed(setting: str, value) -> None:
    """A seed numpy and Lightning accept: an integer in [0, 2**32 - 1]."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**32 - 1:
        raise ConfigError(f"{setting} must be an integer from 0 to 2**32 - 1 = {2**32 - 1}, got {value!r}")


def require_choice(setting: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{setting} must be one of {' | '.join(map(str, choices))}, got {value!r}")
