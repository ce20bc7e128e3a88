"""``cache=`` settings, checked, and where TeaCache's rescaling polynomial for a model comes from."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ringdit.common.errors import ConfigError
from ringdit.common.safe_json import read_json

KINDS = ("none", "fbcache", "teacache")
SCOPES = ("sample", "batch")
COEFFICIENTS_FILE = "teacache.json"  # beside a checkpoint: what ``calibrate`` writes and ``teacache`` reads

# ---- settings ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheSettings:
    """``cache=`` of infer.py, checked. ``warmup``: model evaluations at the start of each run that always run every
    block (the residuals and references are seeded there). ``coefficients``: TeaCache's polynomial, or None to look
    it up (``teacache_coefficients``)."""

    kind: str = "none"
    threshold: float = 0.0
    warmup: int = 1
    coefficients: tuple[float, ...] | None = None
    scope: str = "sample"  # sample: each sample decides (its result does not depend on its batch); batch: one
    # decision from the whole batch's sums (more steps skipped in a large batch; a sample then depends on its batch)

    @classmethod
    def from_config(cls, cache: Any) -> CacheSettings:
        """From infer.py's ``cache`` group (``conf/cache/*.yaml``); a one-line ConfigError naming the setting."""
        if cache is None:
            return cls()
        cache = dict(cache)
        kind = cache.get("kind", "none")
        if kind not in KINDS:
            raise ConfigError(f"cache.kind={kind!r} is not a step cache; use cache=none, cache=fbcache or "
                              f"cache=teacache")
        if kind == "none":
            return cls()
        threshold = cache.get("threshold")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold) \
                or threshold < 0:
            raise ConfigError(f"cache.threshold={threshold!r} must be a finite number >= 0 (the relative change below "
                              f"which a step reuses the cache; 0 never reuses); e.g. cache.threshold=0.1")
        warmup = cache.get("warmup", 1)
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ConfigError(f"cache.warmup={warmup!r} must be an integer >= 1 (the first evaluations always run "
                              f"every block, to seed the cache); e.g. cache.warmup=1")
        scope = cache.get("scope", "sample")
        if scope not in SCOPES:
            raise ConfigError(f"cache.scope={scope!r} is not a decision scope; use cache.scope=sample (each sample "
                              f"decides alone) or cache.scope=batch (one decision per batch)")
        coefficients = cache.get("coefficients")
        if coefficients is not None and kind == "teacache":
            coefficients = read_coefficients("cache.coefficients", coefficients)
        return cls(kind=kind, threshold=float(threshold), warmup=warmup,
                   coefficients=None if kind != "teacache" else coefficients, scope=scope)

    @property
    def enabled(self) -> bool:
        return self.kind != "none"


MAX_COEFFICIENTS = 16  # degree 15: calibrate fits degree 4, the published fits are degree 4; every cache decision
# evaluates the polynomial, so a file of millions of them would turn each step into seconds of Python


def read_coefficients(setting: str, value: Any, fingerprint: tuple | None = None) -> tuple[float, ...]:
    """A polynomial as a list of numbers, or a JSON file (``calibrate``'s) holding ``{"coefficients": [...]}``; a
    file that records the model it was fitted to (``"model"``: family, width, depth) must name ``fingerprint``."""
    where = setting  # the setting, and the file when the numbers come from one
    if isinstance(value, (str, Path)):
        where = f"{setting}={value}"
        fix = (f"pass the {COEFFICIENTS_FILE} that `python -m ringdit.caching calibrate ckpt_path=CKPT` wrote, or a "
               f"list of numbers")
        content = read_json(value, where, fix=fix, max_bytes=2**20, kind=dict)
        if "coefficients" not in content:
            raise ConfigError(f"{where} has no \"coefficients\" key; {fix}")
        fitted = content.get("model")
        if fingerprint is not None and fitted is not None and list(fitted) != list(fingerprint):
            raise ConfigError(f"{where} was fitted to another model ({fitted}: family, width, depth), not this one "
                              f"({list(fingerprint)}); calibrate this checkpoint (`python -m ringdit.caching "
                              f"calibrate ckpt_path=...`), or pass cache.coefficients=[...]")
        value = content["coefficients"]
    values = list(value) if isinstance(value, (list, tuple)) or hasattr(value, "__iter__") else None
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                         for v in values):
        shown = value if not isinstance(value, (list, tuple)) or len(value) <= 8 else f"[{len(value)} values]"
        what = f"{where}: {shown!r}" if where != setting else f"{setting}={shown!r}"
        raise ConfigError(f"{what} must be a non-empty list of finite numbers (a polynomial, highest "
                          f"degree first, as numpy.polyfit returns)")
    if len(values) > MAX_COEFFICIENTS:
        raise ConfigError(f"{where} holds {len(values):,} coefficients, a polynomial of degree {len(values) - 1}; "
                          f"TeaCache's rescaling is degree 4 (at most {MAX_COEFFICIENTS} coefficients are taken): "
                          f"calibrate again, or pass the list numpy.polyfit returned")
    return tuple(float(v) for v in values)


def model_fingerprint(model: nn.Module) -> tuple[str, int, int]:
    """(kind, width, depth) of a model (``DiffusionModel``): what TeaCache coefficients are fitted to."""
    return (model.kind_name, *model.teacache_size)


def teacache_coefficients(settings: CacheSettings, model: nn.Module, ckpt_path: str | None) -> tuple[float, ...]:
    """TeaCache's polynomial for ``model``: ``cache.coefficients``, else the ``teacache.json`` beside the checkpoint,
    else a published one; none of them is a one-line ConfigError saying how to fit them."""
    if settings.coefficients is not None:
        return settings.coefficients
    if ckpt_path:
        beside = Path(ckpt_path).expanduser().parent / COEFFICIENTS_FILE
        if beside.exists():  # a folder or a pipe there is named, not skipped
            return read_coefficients(f"the {COEFFICIENTS_FILE} beside ckpt_path", str(beside),
                                     fingerprint=model_fingerprint(model))
    fingerprint = model_fingerprint(model)
    published = model.published_teacache_coefficients  # the model kind's, at its size
    if published is not None:
        return published
    raise ConfigError(f"cache=teacache: no TeaCache coefficients for this model ({fingerprint[0]}, width "
                      f"{fingerprint[1]}, depth {fingerprint[2]}; ckpt_path={ckpt_path}); fit them with `python -m "
                      f"ringdit.caching calibrate ckpt_path={ckpt_path}` (writes {COEFFICIENTS_FILE} beside it), or "
                      f"pass cache.coefficients=[...], or use cache=fbcache")
