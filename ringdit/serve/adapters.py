"""LoRA adapters chosen per request: several resident at once, applied to one batch at a time.

An adapter is diffusers' LoRA file (``pytorch_lora_weights.safetensors``, what ``python -m ringdit.export ... lora=true``
writes: ``transformer.<module>.lora_A.weight`` (r, in) and ``lora_B.weight`` (out, r), alpha in its
``lora_adapter_metadata``; a two-expert model's low-noise expert from a second file). While a batch samples with
adapter A at strength s, each adapted layer's output gets ``s * alpha / r * B(A(x))`` added by a forward hook: the
layer computes ``x W^T + s alpha / r (x A^T) B^T``, which is what the base merged with the adapter at that strength,
``W + s alpha / r B A``, computes, up to the order of the floating-point sums. A request may stack several adapters,
each at its strength: each adapted layer then adds every adapter's term (``ringdit.models.lora.stack_adapters``, the code
infer.py's ``lora=[...]`` stacks with), the base merged with their sum. Hooks leave the base weights alone, so
switching adapters between batches costs nothing and any number can stay resident; a layer that already carries a
trained adapter (an adapter-only LoRA checkpoint being served) gets the request's on top.

Files are data: read with safetensors (no pickle), only from inside ``lora_dir``, every tensor checked against the
layer it adapts before the adapter is accepted.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ringdit.checkpoints.lora_formats import read_lora_file
from ringdit.common.errors import ConfigError
from ringdit.models.lora import adapted_modules, stack_adapters

Tensor = torch.Tensor


class AdapterError(ValueError):
    """An adapter that cannot be loaded: the message names the field (``path``) and why."""


@dataclass
class Adapter:
    name: str
    files: tuple[str, ...]                            # as given, relative to lora_dir
    layers: list[dict[str, tuple[Tensor, Tensor, float]]]  # per expert: module name -> (A, B, alpha / r)

    def describe(self) -> dict:
        return {"name": self.name, "paths": list(self.files), "rank": self.rank,
                "layers": sum(len(expert) for expert in self.layers)}

    @property
    def rank(self) -> int:
        return next((int(a.shape[0]) for expert in self.layers for a, _, _ in expert.values()), 0)


def resolve_file(lora_dir: Path | None, given: str, field: str) -> Path:
    """``given`` (relative to ``lora_dir``) as a real .safetensors file inside it."""
    if lora_dir is None:
        raise AdapterError("the server was started without lora_dir: no adapter can be loaded (start it with "
                           "lora_dir=<folder of adapters>)")
    if not isinstance(given, str) or not given:
        raise AdapterError(f"{field}: give the adapter's path relative to lora_dir")
    if "\0" in given:  # no file system takes it (Python raises ValueError on it)
        raise AdapterError(f"{field}={given!r} holds a NUL character; give the adapter's path relative to lora_dir")
    try:
        path = (lora_dir / given).resolve()
        if not path.is_relative_to(lora_dir):
            raise AdapterError(f"{field}={given!r} is outside lora_dir; give a path inside it")
        if path.suffix != ".safetensors":
            raise AdapterError(f"{field}={given!r} is not a .safetensors file (pickled formats are not loaded)")
        if not path.is_file():
            raise AdapterError(f"{field}={given!r} does not exist in lora_dir")
    except OSError as error:  # a name too long for the file system, a loop of links, a folder it may not read
        raise AdapterError(f"{field}={given!r} cannot be read in lora_dir ({error.strerror})") from None
    return path


def read_adapter(path: Path, field: str, root: nn.Module, family: str | None) -> dict[str, tuple[Tensor, Tensor, float]]:
    """The file's adapter for ``root`` (one transformer of a model of ``family``), each layer's (A (r, in),
    B (out, r), alpha / r): any LoRA file infer.py's ``lora=`` reads (diffusers, peft, ComfyUI, ringdit exports:
    ``ringdit.checkpoints.lora_formats``), checked against the layers it adapts; a mistake is an ``AdapterError``
    (a 400 naming ``field``)."""
    try:
        return read_lora_file(path, root, family, field)
    except ConfigError as error:
        raise AdapterError(str(error)) from None


class Adapters:
    """The resident adapters of one model (every rank holds the same ones, on its device)."""

    def __init__(self, model: nn.Module, device: torch.device | str):
        self.roots = adapted_modules(model)
        self.family = model.kind_name  # a diffusers family's ComfyUI names are its record's
        self.device = device
        self.loaded: dict[str, Adapter] = {}

    def read(self, lora_dir: Path | None, name: str, paths: list[str]) -> Adapter:
        """The adapter ``name`` from ``paths`` (one per expert: the high-noise one first), checked; not yet resident."""
        if not isinstance(name, str) or not name or len(name) > 128:
            raise AdapterError("name: give the adapter a name of 1 to 128 characters")
        if not 1 <= len(paths) <= len(self.roots):
            raise AdapterError(f"path: this model has {len(self.roots)} transformer(s); give one adapter file "
                               f"{'per expert (path, path_2)' if len(self.roots) > 1 else '(path)'}")
        layers = []
        for i, given in enumerate(paths):
            field = "path" if i == 0 else f"path_{i + 1}"
            layers.append(read_adapter(resolve_file(lora_dir, given, field), field, self.roots[i], self.family))
        return Adapter(name, tuple(paths), layers)

    def add(self, adapter: Adapter) -> None:
        """Make ``adapter`` resident (replacing one of its name), its tensors on this rank's device."""
        adapter.layers = [{name: (down.to(self.device), up.to(self.device), scale)
                           for name, (down, up, scale) in expert.items()} for expert in adapter.layers]
        self.loaded[adapter.name] = adapter

    def remove(self, name: str) -> bool:
        return self.loaded.pop(name, None) is not None

    @contextlib.contextmanager
    def applied(self, loras):
        """Inside, the model computes as if merged with every adapter of ``loras`` (``(name, strength)`` pairs, stacked
        in that order: ``ringdit.models.lora.stack_adapters``, as infer.py's ``lora=[...]``) at its strength; nothing when
        empty. The hooks are taken off on leaving, whatever happened inside."""
        handles = stack_adapters(self.roots, [(self.loaded[name].layers, strength) for name, strength in loras],
                                 self.device)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
