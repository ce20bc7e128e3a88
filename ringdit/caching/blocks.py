"""What the step cache must know of a model's repeated blocks, asked of the model (``DiffusionModel``: a diffusers
model answers from its ``Family`` record, the DiT from its class): which arguments and outputs are the token streams
(``cache_blocks``, a ``BlockIO``; else diffusers' own block registry) and, for TeaCache, where the first block's
timestep-modulated input is (``teacache_input``)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ringdit.common.errors import ConfigError
from ringdit.models.block_io import BlockIO
from ringdit.models.parallelize import repeated_blocks

Tensor = torch.Tensor


def block_io(block: nn.Module, declared: BlockIO | None = None) -> BlockIO:
    """``declared`` (the model kind's ``cache_blocks``), else what diffusers' TransformerBlockRegistry (what its own
    caches read) says of the block's class."""
    if declared is not None:
        return declared
    try:
        from diffusers.hooks._helpers import TransformerBlockRegistry

        for cls in type(block).__mro__:  # FSDP2 wraps the class in a subclass
            try:
                meta = TransformerBlockRegistry.get(cls)
            except ValueError:
                continue
            return BlockIO(meta.hidden_states_argument_name, meta.encoder_hidden_states_argument_name,
                           meta.return_hidden_states_index or 0, meta.return_encoder_hidden_states_index)
    except ImportError:
        pass
    raise ConfigError(f"cache: the blocks of this model ({type(block).__name__}) are not known to the step cache "
                      f"(which arguments and outputs are the token streams); use cache=none, or declare them in the "
                      f"model family's cache_blocks")


def modulated_input_of(model: nn.Module) -> Callable:
    """TeaCache's probe of the model kind (``teacache_input``): the first block's timestep-modulated input."""
    probe = model.teacache_input
    if probe is None:
        raise ConfigError(f"cache=teacache: this model ({type(model).__name__}) has no known timestep-modulated "
                          f"input; use cache=fbcache, or declare it in the model family's teacache_input")
    return probe


def check_model(settings, model: nn.Module) -> None:
    """A ConfigError, before anything starts, when the cache cannot wrap ``model``'s blocks (a meta model is fine)."""
    if not settings.enabled:
        return
    if model.experts:  # its residual and coefficients would carry over from one expert to the other
        raise ConfigError(f"cache={settings.kind} does not run on a two-expert model (model.boundary_ratio: Wan 2.2 "
                          f"A14B): the cached residual of one expert's blocks is no estimate of the other's; use "
                          f"cache=none")
    declared = model.cache_blocks
    for block in repeated_blocks_of(model):
        block_io(block, declared)
    if settings.kind == "teacache":
        modulated_input_of(model)


def repeated_blocks_of(model: nn.Module) -> list[nn.Module]:
    return repeated_blocks(model)
