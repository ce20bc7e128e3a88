"""What the step cache must know of a model's repeated blocks: which arguments and outputs are its token streams
(``BlockIO``), and, for TeaCache, where a first block's timestep-modulated input is. Per-family knowledge kept here
until the ``ParallelPlan`` can say it."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ringdit.errors import ConfigError

Tensor = torch.Tensor


@dataclass(frozen=True)
class BlockIO:
    """Where a block's token streams are: the argument names of the image tokens (``hidden``) and the text tokens
    (``encoder``, or None), and their places in its output (``encoder_index`` None: the output is the image tokens
    alone). Skipped blocks return their inputs in this layout."""

    hidden: str
    encoder: str | None = None
    hidden_index: int = 0
    encoder_index: int | None = None
    _positions: dict = field(default_factory=dict, compare=False)

    def argument(self, block: nn.Module, name: str, args: tuple, kwargs: dict):
        if name in kwargs:
            return kwargs[name]
        if name not in self._positions:
            parameters = list(inspect.signature(type(block).forward).parameters)[1:]  # without self
            self._positions[name] = parameters.index(name)
        position = self._positions[name]
        return args[position] if position < len(args) else None

    def inputs(self, block: nn.Module, args: tuple, kwargs: dict) -> tuple[Tensor, Tensor | None]:
        encoder = self.argument(block, self.encoder, args, kwargs) if self.encoder_index is not None else None
        return self.argument(block, self.hidden, args, kwargs), encoder

    def outputs(self, output) -> tuple[Tensor, Tensor | None]:
        if self.encoder_index is None:
            return output, None
        return output[self.hidden_index], output[self.encoder_index]

    def output(self, hidden: Tensor, encoder: Tensor | None):
        if self.encoder_index is None:
            return hidden
        out = [None, None]
        out[self.hidden_index], out[self.encoder_index] = hidden, encoder
        return tuple(out)


# ringdit's own blocks and diffusers blocks that diffusers' TransformerBlockRegistry (what its own caches read) lacks;
# the others come from that registry. Per-family knowledge that belongs in the ParallelPlan once the plan can say it.
OWN_BLOCKS = {
    "DiTBlock": BlockIO("x"),
    "SkyReelsV2TransformerBlock": BlockIO("hidden_states"),
    "HunyuanVideo15TransformerBlock": BlockIO("hidden_states", "encoder_hidden_states", 0, 1),
}


def block_io(block: nn.Module) -> BlockIO:
    for cls in type(block).__mro__:  # FSDP2 wraps the class in a subclass
        if cls.__name__ in OWN_BLOCKS:
            return OWN_BLOCKS[cls.__name__]
    try:
        from diffusers.hooks._helpers import TransformerBlockRegistry

        for cls in type(block).__mro__:
            try:
                meta = TransformerBlockRegistry.get(cls)
            except ValueError:
                continue
            return BlockIO(meta.hidden_states_argument_name, meta.encoder_hidden_states_argument_name,
                           meta.return_hidden_states_index or 0, meta.return_encoder_hidden_states_index)
    except ImportError:
        pass
    raise ConfigError(f"cache: the blocks of this model ({type(block).__name__}) are not known to the step cache "
                      f"(which arguments and outputs are the token streams); use cache=none, or add the block to "
                      f"ringdit.caching.OWN_BLOCKS")


# TeaCache's probe: the first block's timestep-modulated input, per block kind. Returns (tensor, sharded): sharded
# tensors are (rows, S_local, ...) token shards (tail padding masked); others are the same on every rank.
def _dit_modulated(block, io, args, kwargs):
    from ringdit.models.dit import modulate

    x, c = io.argument(block, "x", args, kwargs), io.argument(block, "c", args, kwargs)
    shift, scale = block.adaLN_modulation(c).chunk(6, dim=1)[:2]
    return modulate(block.norm1(x), shift, scale), True  # (B, N_local, D)


def _flux_modulated(block, io, args, kwargs):
    hidden, temb = io.argument(block, "hidden_states", args, kwargs), io.argument(block, "temb", args, kwargs)
    return block.norm1(hidden, emb=temb)[0], True  # (B, S_local, D), as TeaCache4FLUX


def _qwen_modulated(block, io, args, kwargs):
    hidden, temb = io.argument(block, "hidden_states", args, kwargs), io.argument(block, "temb", args, kwargs)
    shift, scale, _ = block.img_mod(temb).chunk(2, dim=-1)[0].chunk(3, dim=-1)
    return block.img_norm1(hidden) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1), True  # (B, S_local, D)


def _wan_modulated(block, io, args, kwargs):
    return io.argument(block, "temb", args, kwargs), False  # (B, 6, D) timestep projection, as TeaCache4Wan2.1


MODULATED_INPUT: dict[str, Callable] = {
    "DiTBlock": _dit_modulated,
    "FluxTransformerBlock": _flux_modulated,
    "QwenImageTransformerBlock": _qwen_modulated,
    "WanTransformerBlock": _wan_modulated,
}


def modulated_input_of(block: nn.Module) -> Callable:
    for cls in type(block).__mro__:
        if cls.__name__ in MODULATED_INPUT:
            return MODULATED_INPUT[cls.__name__]
    raise ConfigError(f"cache=teacache: the first block of this model ({type(block).__name__}) has no known "
                      f"timestep-modulated input; use cache=fbcache, or add it to ringdit.caching.MODULATED_INPUT")


def check_model(settings, model: nn.Module) -> None:
    """A ConfigError, before anything starts, when the cache cannot wrap ``model``'s blocks (a meta model is fine)."""
    if not settings.enabled:
        return
    if getattr(model, "experts", ()):  # its residual and coefficients would carry over from one expert to the other
        raise ConfigError(f"cache={settings.kind} does not run on a two-expert model (model.boundary_ratio: Wan 2.2 "
                          f"A14B): the cached residual of one expert's blocks is no estimate of the other's; use "
                          f"cache=none")
    blocks = repeated_blocks_of(model)
    for block in blocks:
        block_io(block)
    if settings.kind == "teacache":
        modulated_input_of(blocks[0])


def repeated_blocks_of(model: nn.Module) -> list[nn.Module]:
    from ringdit.models.parallelize import repeated_blocks

    return repeated_blocks(model)
