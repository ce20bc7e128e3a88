"""``BlockIO``: where a repeated block's token streams are in its arguments and outputs -- what the step cache
(``ringdit.caching``) needs to skip a block. A model kind declares it (``Family.cache_blocks``, ``DiT.cache_blocks``)
where diffusers' ``TransformerBlockRegistry`` does not say it."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

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
