"""Losses over a token sequence sharded across a sequence-parallel group."""

from __future__ import annotations

import torch

from ringdit.parallel.mesh import ParallelDims

Tensor = torch.Tensor


def sharded_mean(values_local: Tensor, length: int, dim: int = 1, *, dims: ParallelDims) -> Tensor:
    """The mean of ``values`` over the whole sample, computed from this rank's shard of the sequence.

    ``values_local`` is this rank's chunk (``shard_sequence`` layout, tail padding included) of a tensor whose
    full sequence dim has ``length`` real entries; the padding is left out. The result is scaled by the SP degree:
    each rank holds ``sp x (its share of the mean)``, so that (a) the average over the SP group is the mean, and
    (b) DDP's gradient average over all dp x sp ranks equals the gradient of the one-device mean, given that the
    ranks' parameter gradients are partial sums (see ringdit.parallel.collectives).
    """
    local_len = values_local.shape[dim]
    real = max(0, min(local_len, length - dims.sp_rank * local_len)) if dims.sp_degree > 1 else length
    total = values_local.numel() // local_len * length  # elements of the full, unpadded tensor
    return values_local.narrow(dim, 0, real).sum() * (dims.sp_degree / total)
