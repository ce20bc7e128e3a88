"""``TokenLayout``: which tokens of a sharded sequence are real, so attention can give the others no weight.

Every SP rank holds one chunk of the sequence (chunk index = ``sp_rank``). A chunk concatenates this rank's share
of each *stream*, in a fixed order: one stream (the tokens) for self-attention; text and image for joint attention
(Flux, QwenImage). Each stream is split into equal per-rank chunks and padded at its own tail, so rank r holds
``[text[r*Lc : (r+1)*Lc] ; image[r*Sc : (r+1)*Sc]]``. That is why the text is sharded with the image: its per-token
work (norms, MLPs, modulation, projections) is done once in the SP group, and every rank computes
``Lc + Sc = ceil(L / R) + ceil(S / R)`` tokens, about ``(L + S) / R``.

Attention is a sum over keys, so the order in which the chunks put the tokens does not change the result, as long
as every query meets every real key once (the ring does that) and RoPE rotates each token by its own position
(the plan slices the rotations like the tokens). What the layout adds is which keys are real:

- a stream's tail padding (position >= its length) is no key at all;
- a stream may carry a per-sample key mask (QwenImage pads its prompts): masked keys get no weight either.

Kernels take no masks: a block's keys are cut to its real ones (a view when they are one contiguous run, an index
otherwise, a per-sample loop only where samples differ). Padded query rows come back as zeros and get no gradient;
masked text query rows attend normally, as in diffusers. A layout computes each block's key selection once and
keeps it: one layout serves every attention layer of a forward (and the recomputation of checkpointed blocks), so
reading the masks synchronises with the device once per forward, not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor

# Which keys of a block are real: None (all of them), a slice (one contiguous run, possibly empty), an index
# tensor, or a list with one of those per sample (where samples differ).
Selection = "slice | Tensor | list | None"


@dataclass(frozen=True)
class Stream:
    """One stream of the sequence: ``length`` real tokens, ``chunk`` of them per rank (``chunk * ranks >= length``;
    the rest of the last chunks is padding) and an optional key mask ``(B, length)`` bool, True on real keys."""

    length: int
    chunk: int
    mask: Tensor | None = None


class TokenLayout:
    """The streams of every rank's chunk, in the order the chunk holds them."""

    def __init__(self, streams: tuple[Stream, ...] | list[Stream]):
        self.streams = tuple(streams)
        self._keys: dict[tuple[int, int], Selection] = {}
        self._rows: dict[tuple[int, int], Tensor | None] = {}

    @classmethod
    def tail_padded(cls, length: int, chunk: int) -> TokenLayout:
        """One stream of ``length`` real tokens in chunks of ``chunk``: plain sequence parallelism."""
        return cls([Stream(length, chunk)])

    @property
    def chunk(self) -> int:
        """Tokens per rank."""
        return sum(stream.chunk for stream in self.streams)

    def keys(self, first: int, count: int = 1) -> Selection:
        """The real keys of the block made of chunks ``first .. first + count - 1`` (their concatenation)."""
        if (first, count) not in self._keys:
            self._keys[first, count] = _selection(self._real(first, count, masked=True))
        return self._keys[first, count]

    def real_rows(self, first: int, count: int = 1) -> Tensor | None:
        """``(count * chunk,)`` bool, True on the block's real (not padding) rows; None when all are real."""
        if (first, count) not in self._rows:
            real = self._real(first, count, masked=False)[0]
            self._rows[first, count] = None if bool(real.all()) else real
        return self._rows[first, count]

    def _real(self, first: int, count: int, masked: bool) -> Tensor:
        """``(B or 1, count * chunk)`` bool: the block's tokens that are real (and, if ``masked``, not masked)."""
        device = next((s.mask.device for s in self.streams if s.mask is not None), None)
        pieces = []
        for index in range(first, first + count):
            for stream in self.streams:
                positions = torch.arange(index * stream.chunk, (index + 1) * stream.chunk, device=device)
                real = (positions < stream.length).unsqueeze(0)  # (1, chunk)
                if masked and stream.mask is not None:
                    mask = stream.mask[:, index * stream.chunk : (index + 1) * stream.chunk]
                    real = real & torch.nn.functional.pad(mask, (0, stream.chunk - mask.shape[1]))
                pieces.append(real)
        batch = max(piece.shape[0] for piece in pieces)
        return torch.cat([piece.expand(batch, -1) for piece in pieces], dim=1)


def _selection(real: Tensor) -> Selection:
    """A ``(B, n)`` real-key mask as the cheapest selection that takes exactly those keys."""
    if bool(real.all()):
        return None
    if real.shape[0] == 1 or bool((real == real[:1]).all()):
        return _row_selection(real[0])
    return [_row_selection(row) for row in real]


def _row_selection(row: Tensor) -> slice | Tensor | None:
    count = int(row.sum())
    if count == row.numel():
        return None
    if count == 0:
        return slice(0, 0)
    positions = row.nonzero().squeeze(1)
    start = int(positions[0])
    if int(positions[-1]) - start + 1 == count:  # one contiguous run: a view, no copy
        return slice(start, start + count)
    return positions


def is_empty(selection: Selection) -> bool:
    """No real key at all (a block of padding): the block can be skipped."""
    if isinstance(selection, list):
        return all(is_empty(s) for s in selection)
    return isinstance(selection, slice) and selection.stop == selection.start


def take(x: Tensor, selection: slice | Tensor | None, dim: int) -> Tensor:
    """The selected positions of ``x`` along ``dim`` (a view for None and slices)."""
    if selection is None:
        return x
    if isinstance(selection, slice):
        return x.narrow(dim, selection.start, selection.stop - selection.start)
    return x.index_select(dim, selection)


def add_at(accumulator: Tensor, selection: slice | Tensor | None, value: Tensor, dim: int) -> None:
    """``accumulator[selected positions along dim] += value``, in place: the inverse of ``take`` for gradients."""
    if selection is None:
        accumulator += value
    elif isinstance(selection, slice):
        accumulator.narrow(dim, selection.start, selection.stop - selection.start).add_(value)
    else:
        accumulator.index_add_(dim, selection, value.to(accumulator.dtype))
