"""Differentiable collectives, each with its autograd written out (no ``torch.distributed.nn``: its all_gather gave
wrong input gradients on gloo in one of our checks).

Autograd convention for sequence parallelism: the objective is the SUM of the losses computed on the ranks of a
group. Hence ``shard_sequence`` (every rank holds the same full tensor) keeps only the local chunk's gradient, and
``gather_sequence``'s backward sums the gradients every rank computed for the local chunk (a reduce-scatter).

Forward mode (``torch.func.jvp``, ``torch.autograd.forward_ad``): each of these maps is linear, so its ``jvp`` is the
same map applied to the tangent. ``forward`` and ``setup_context`` are separate, the form ``torch.func`` needs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringdit.parallel.mesh import ParallelDims, ProcessGroup

Tensor = torch.Tensor


def _all_to_all(x: Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
    """Split ``x`` into ``world`` pieces along ``scatter_dim``, send piece j to rank j, concatenate what arrives
    (in rank order) along ``gather_dim``."""
    world = dist.get_world_size(group)
    send = torch.stack(x.chunk(world, dim=scatter_dim))  # (world, *piece), contiguous
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class AllToAll(torch.autograd.Function):
    """Ulysses' exchange: trade a shard of one dim for a shard of another; backward is the reverse exchange."""

    @staticmethod
    def forward(x: Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.scatter_dim, ctx.gather_dim = inputs

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None

    @staticmethod
    def jvp(ctx, tangent: Tensor, *_):
        return _all_to_all(tangent, ctx.group, ctx.scatter_dim, ctx.gather_dim)


def all_to_all(x: Tensor, group: ProcessGroup | None, scatter_dim: int, gather_dim: int) -> Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    size = x.shape[scatter_dim]
    if size % dist.get_world_size(group):
        raise ValueError(f"all_to_all: dim {scatter_dim} of size {size} does not split over {dist.get_world_size(group)} ranks")
    return AllToAll.apply(x, group, scatter_dim, gather_dim)


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
        send = torch.stack(padded.chunk(world, dim=ctx.dim))  # (world, *local)
        recv = torch.empty_like(send)
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
