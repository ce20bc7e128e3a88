"""Differentiable collectives, each with its autograd written out (no ``torch.distributed.nn``: its all_gather gave
wrong input gradients on gloo in one of our checks).

Autograd convention for sequence parallelism: the objective is the SUM of the losses computed on the ranks of a
group. Hence ``shard_sequence`` (every rank holds the same full tensor) keeps only the local chunk's gradient, and
``gather_sequence``'s backward sums the gradients every rank computed for the local chunk (a reduce-scatter).

Forward mode (``torch.func.jvp``, ``torch.autograd.forward_ad``): each of these maps is linear, so its ``jvp`` is the
same map applied to the tangent. ``forward`` and ``setup_context`` are separate, the form ``torch.func`` needs.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringdit.parallel.mesh import ParallelDims, ProcessGroup

Tensor = torch.Tensor


def _all_to_all(x: Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int, scatter_sizes: tuple[int, ...],
                gather_sizes: tuple[int, ...]) -> Tensor:
    """Split ``x`` along ``scatter_dim`` into pieces of ``scatter_sizes``, send piece j to rank j, concatenate what
    arrives (in rank order) along ``gather_dim``; the piece from rank i is ``gather_sizes[i]`` long there.

    The sizes may differ (Ulysses over a head count its degree does not divide: ``ringdit.parallel.heads``), so the
    pieces travel flattened, one after the other, through ``all_to_all_single`` with per-rank split sizes (NCCL's and
    gloo's all-to-all-v). Against padding the heads to a multiple of the degree (an even exchange of zero heads):
    both leave the busiest rank the same ``ceil(H / U)`` heads, so the step takes as long, but padding sends the
    zero heads over the link, makes the lighter ranks attend over them (memory and energy for nothing) and costs a
    pad and a slice on every q, k, v, output and gradient. Unequal splits cost nothing beyond the exchange itself,
    and an even split is the same code (equal sizes). Each piece is copied once into the send buffer and once out of
    the receive buffer, as for a plain all-to-all."""
    rank = dist.get_rank(group)
    pieces = x.split(list(scatter_sizes), dim=scatter_dim)
    send, offset = x.new_empty(x.numel()), 0
    for piece in pieces:  # narrow, not split: split's views refuse in-place writes in grad mode (forward AD)
        send.narrow(0, offset, piece.numel()).view(piece.shape).copy_(piece)
        offset += piece.numel()
    shapes = []
    for size in gather_sizes:  # what rank i sends here: my share of its scatter_dim, its length of gather_dim
        shape = list(x.shape)
        shape[scatter_dim], shape[gather_dim] = scatter_sizes[rank], size
        shapes.append(shape)
    numels = [math.prod(shape) for shape in shapes]
    recv = x.new_empty(sum(numels))
    dist.all_to_all_single(recv, send, output_split_sizes=numels, input_split_sizes=[p.numel() for p in pieces],
                           group=group)
    return torch.cat([flat.view(shape) for flat, shape in zip(recv.split(numels), shapes)], dim=gather_dim)


class AllToAll(torch.autograd.Function):
    """Ulysses' exchange: trade a shard of one dim for a shard of another; backward is the reverse exchange (what
    went to rank j comes back from it: the scatter and gather dims and sizes swap)."""

    @staticmethod
    def forward(x: Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int, scatter_sizes: tuple[int, ...],
                gather_sizes: tuple[int, ...]) -> Tensor:
        return _all_to_all(x, group, scatter_dim, gather_dim, scatter_sizes, gather_sizes)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.scatter_dim, ctx.gather_dim, ctx.scatter_sizes, ctx.gather_sizes = inputs

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = _all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim, ctx.gather_sizes, ctx.scatter_sizes)
        return grad, None, None, None, None, None

    @staticmethod
    def jvp(ctx, tangent: Tensor, *_):
        return _all_to_all(tangent, ctx.group, ctx.scatter_dim, ctx.gather_dim, ctx.scatter_sizes, ctx.gather_sizes)


def all_to_all(x: Tensor, group: ProcessGroup | None, scatter_dim: int, gather_dim: int,
               scatter_sizes: tuple[int, ...] | None = None, gather_sizes: tuple[int, ...] | None = None) -> Tensor:
    """Ulysses' differentiable all-to-all. ``scatter_sizes``: the length of ``scatter_dim`` each rank gets (default:
    equal shares, which must divide); ``gather_sizes``: the length of ``gather_dim`` each rank sends (default: all
    as long as this rank's). Every rank passes the same sizes; this rank's ``gather_sizes`` entry is its own."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    size = x.shape[scatter_dim]
    if scatter_sizes is None:
        if size % world:
            raise ValueError(f"all_to_all: dim {scatter_dim} of size {size} does not split over {world} ranks")
        scatter_sizes = (size // world,) * world
    gather_sizes = (x.shape[gather_dim],) * world if gather_sizes is None else gather_sizes
    if len(scatter_sizes) != world or sum(scatter_sizes) != size:
        raise ValueError(f"all_to_all: scatter sizes {tuple(scatter_sizes)} do not split dim {scatter_dim} of size "
                         f"{size} over {world} ranks")
    if len(gather_sizes) != world or gather_sizes[rank] != x.shape[gather_dim]:
        raise ValueError(f"all_to_all: gather sizes {tuple(gather_sizes)} of {world} ranks do not give rank {rank} "
                         f"its dim {gather_dim} of size {x.shape[gather_dim]}")
    return AllToAll.apply(x, group, scatter_dim, gather_dim, tuple(scatter_sizes), tuple(gather_sizes))


def chunk_length(length: int, parts: int) -> int:
    """Tokens per rank when ``length`` tokens are split into ``parts`` equal chunks (the last one padded)."""
    return -(-length // parts)


class _ShardSequence(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, dim: int, index: int, parts: int) -> Tensor:
        return _shard(x, dim, index, parts)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, dim, index, parts = inputs
        local = chunk_length(x.shape[dim], parts)
        ctx.dim, ctx.length, ctx.padded_length, ctx.start = dim, x.shape[dim], local * parts, index * local
        ctx.index, ctx.parts = index, parts

    @staticmethod
    def backward(ctx, grad: Tensor):
        # Only this rank's chunk saw the gradient of this rank's loss; the other chunks are the other ranks' share.
        full = grad.new_zeros(_shape_with(grad, ctx.dim, ctx.padded_length))
        full.narrow(ctx.dim, ctx.start, grad.shape[ctx.dim]).copy_(grad)
        return full.narrow(ctx.dim, 0, ctx.length), None, None, None

    @staticmethod
    def jvp(ctx, tangent: Tensor, *_):
        return _shard(tangent, ctx.dim, ctx.index, ctx.parts)


def _shard(x: Tensor, dim: int, index: int, parts: int) -> Tensor:
    local = chunk_length(x.shape[dim], parts)
    return _pad_dim(x, dim, local * parts).narrow(dim, index * local, local).clone()


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, dim: int, length: int, group: ProcessGroup) -> Tensor:
        return _gather(x, dim, length, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.dim, ctx.length, ctx.group = inputs
        ctx.local = x.shape[ctx.dim]

    @staticmethod
    def backward(ctx, grad: Tensor):
        world = dist.get_world_size(ctx.group)
        padded = _pad_dim(grad, ctx.dim, ctx.local * world)
        # reduce-scatter as an all-to-all plus a sum: works on gloo, which has no reduce_scatter.
        # (world, *local), contiguous: a gradient in a 4-D channels-last layout (an attention's key gradient) would
        # stack into one, which the exchange refuses
        send = torch.stack(padded.chunk(world, dim=ctx.dim)).contiguous()
        recv = torch.empty_like(send, memory_format=torch.contiguous_format)
        dist.all_to_all_single(recv, send, group=ctx.group)
        return recv.sum(dim=0), None, None, None

    @staticmethod
    def jvp(ctx, tangent: Tensor, *_):
        return _gather(tangent, ctx.dim, ctx.length, ctx.group)


def _gather(x: Tensor, dim: int, length: int, group: ProcessGroup) -> Tensor:
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, x.contiguous(), group=group)
    return torch.cat(pieces, dim=dim).narrow(dim, 0, length)


def shard_sequence(x: Tensor, dim: int = 1, *, dims: ParallelDims) -> Tensor:
    """This sequence-parallel rank's contiguous chunk of ``x`` along ``dim`` (chunk index = sp_rank).

    The length is padded at the tail with zeros to a multiple of the SP degree; ``gather_sequence`` undoes both.
    """
    if dims.sp_degree == 1:
        return x
    return _ShardSequence.apply(x, dim, dims.sp_rank, dims.sp_degree)


def gather_sequence(x_local: Tensor, dim: int = 1, length: int | None = None, *, dims: ParallelDims) -> Tensor:
    """Concatenate every SP rank's chunk along ``dim`` and drop the tail padding beyond ``length``."""
    if dims.sp_degree == 1:
        return x_local if length is None else x_local.narrow(dim, 0, length)
    length = x_local.shape[dim] * dims.sp_degree if length is None else length
    return _GatherSequence.apply(x_local, dim, length, dims.sp_group)


def _shape_with(x: Tensor, dim: int, size: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = size
    return shape


def _pad_dim(x: Tensor, dim: int, size: int) -> Tensor:
    """Zero-pad ``x`` at the end of ``dim`` up to ``size``."""
    missing = size - x.shape[dim]
    if missing <= 0:
        return x
    dim = dim % x.dim()
    return F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, missing])


def exchange_guidance_halves(prediction: Tensor, dims: ParallelDims) -> tuple[Tensor, Tensor]:
    """CFG parallel: this rank computed one half of classifier-free guidance (``dims.cfg_rank`` 0: conditional, 1:
    unconditional); returns ``(conditional, unconditional)`` from it and its partner's. Sampling only (no autograd)."""
    halves = [torch.empty_like(prediction) for _ in range(2)]
    dist.all_gather(halves, prediction.contiguous(), group=dims.cfg_group)
    return halves[0], halves[1]
