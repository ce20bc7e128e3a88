"""DMD2's GAN head (Yin et al. 2024, section 4.3): a small classifier on the critic's (fake score's) intermediate
features that tells real images from the student's, both noised to a time t, trained with the non-saturating GAN
loss; the student gets the generator's side of it.

DMD2 reads the bottleneck of its UNet. A DiT has no bottleneck: the head reads the token stream after one of the
model's repeated blocks (``distill.gan_block``; default the middle one, the bottleneck's place in the depth), through
``FeatureTap`` (a forward hook on that block, where the model kind's ``cache_blocks`` / diffusers' block registry says
the tokens are). ``GANHead`` projects every token (LayerNorm, Linear, SiLU: per-token features that see local
artifacts, as DMD2's convolutions do), averages them over the sample's tokens and maps the average to one logit.

Under sequence parallelism a block's output is this rank's token shard: the head sums its own real tokens (the tail
padding of the last shard left out) and the group's sum comes from ``gather_sequence`` of the per-rank sums, one
small vector per rank. Its backward follows ringdit's convention (the objective is the sum of the ranks' losses:
``ringdit.parallel.collectives``), so DDP's average is the one-device gradient, as for the models' own losses.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ringdit.attention import USPAttention
from ringdit.caching.blocks import block_io, repeated_blocks_of
from ringdit.common.errors import ConfigError
from ringdit.models.parallel_plan import ParallelPlan
from ringdit.parallel import gather_sequence
from ringdit.parallel.collectives import chunk_length

Tensor = torch.Tensor


def feature_block(model: nn.Module, index: int | None) -> tuple[nn.Module, object]:
    """The repeated block whose output the head reads (``index``: into the model's blocks, negative from the end;
    None: the middle one) and where its token stream is (a ``BlockIO``); a ConfigError when the model kind does not
    say (works on a meta model: the config-time check)."""
    blocks = repeated_blocks_of(model)
    chosen = len(blocks) // 2 if index is None else index
    if not -len(blocks) <= chosen < len(blocks):
        raise ConfigError(f"distill.gan_block={index} is not a block of this model ({len(blocks)} repeated blocks); "
                          f"give an index in [{-len(blocks)}, {len(blocks) - 1}], or null for the middle one")
    block = blocks[chosen]
    try:
        io = block_io(block, model.cache_blocks)
    except ConfigError:
        raise ConfigError(f"distill.gan_loss=true: the blocks of this model ({type(block).__name__}) do not say where "
                          f"their token stream is (the model kind's cache_blocks, or diffusers' block registry), so "
                          f"the GAN head has no features to read; declare cache_blocks in its family, or distil "
                          f"with distill.gan_loss=false") from None
    return block, io


def feature_width(block: nn.Module) -> int:
    """The width of ``block``'s token stream: its sequence-parallel attention's heads x head size."""
    for module in block.modules():
        if isinstance(module, USPAttention):
            return module.num_heads * module.head_size
    raise ConfigError(f"distill.gan_loss=true: the block {type(block).__name__} has no sequence-parallel attention to "
                      f"read its width from; distil with distill.gan_loss=false")


class FeatureTap:
    """Keeps the token shard ``(B, N_local, D)`` leaving ``model``'s feature block in the forwards run inside
    ``capture()`` (and only those: activation checkpointing's recomputation in backward runs outside)."""

    def __init__(self, model: nn.Module, index: int | None):
        self.model = model
        block, self.io = feature_block(model, index)
        self.width = feature_width(block)
        self._armed = False
        self.tokens: Tensor | None = None
        block.register_forward_hook(self._keep)

    def _keep(self, block: nn.Module, args, output) -> None:
        if self._armed:
            self.tokens = self.io.outputs(output)[0]

    @contextlib.contextmanager
    def capture(self) -> Iterator[FeatureTap]:
        self._armed, self.tokens = True, None
        try:
            yield self
        finally:
            self._armed = False

    def valid_tokens(self) -> Tensor:
        """``(N_local,)`` True on this rank's real tokens (False on the last shard's tail padding)."""
        state = self.model._ringdit_sequence  # the forward's token count and the mesh (ringdit.models.parallelize)
        local, dims = self.tokens.shape[1], state.dims
        length = state.length if state.length is not None else local
        first = dims.sp_rank * chunk_length(length, dims.sp_degree) if dims.sp_degree > 1 else 0
        return torch.arange(first, first + local, device=self.tokens.device) < length

    def features(self) -> tuple[Tensor, Tensor, int, object]:
        """(tokens ``(B, N_local, D)``, their validity ``(N_local,)``, the global token count, the mesh)."""
        if self.tokens is None:
            raise RuntimeError("the GAN head's feature block did not run in the captured forward")
        state = self.model._ringdit_sequence
        valid = self.valid_tokens()
        return self.tokens, valid, state.length or self.tokens.shape[1], state.dims


class GANHead(nn.Module):
    """tokens ``(B, N_local, D)`` (this rank's shard) -> one realism logit per sample ``(B,)``: a per-token projection,
    the mean over the sample's tokens (summed over the sequence-parallel group), a linear map."""

    # FSDP (``RingFSDPStrategy.shard_model``) shards each layer as a unit, like a model's repeated blocks
    parallel_plan = ParallelPlan(blocks=("layers",))

    def __init__(self, hidden_size: int, width: int | None = None):
        super().__init__()
        width = width or max(hidden_size // 4, 16)
        # norm, per-token projection, output
        self.layers = nn.ModuleList([nn.LayerNorm(hidden_size), nn.Linear(hidden_size, width), nn.Linear(width, 1)])

    def reset_parameters(self, generator: torch.Generator) -> None:
        """The same initial weights on every rank (FSDP shards what each rank holds, unbroadcast) and every layout."""
        with torch.no_grad():
            for linear in self.layers[1:]:
                bound = 1 / linear.in_features ** 0.5  # nn.Linear's default, drawn from ``generator``
                # on the CPU, as its generator (configure_model may default to the GPU); float32 draws whatever the
                # default dtype (64-true makes it float64): the same weights in every precision
                draw = torch.rand(linear.weight.shape, generator=generator, device="cpu", dtype=torch.float32)
                linear.weight.copy_(draw * 2 * bound - bound)
                linear.bias.zero_()

    def forward(self, tokens: Tensor, valid: Tensor, length: int, dims) -> Tensor:
        norm, project, out = self.layers
        dtype = project.weight.dtype
        per_token = F.silu(project(norm(tokens.to(dtype))))  # (B, N_local, W)
        local_sum = (per_token * valid[None, :, None].to(per_token.dtype)).sum(dim=1, keepdim=True)  # (B, 1, W)
        # the group's sum: every rank's partial sum side by side (B, sp, W), then summed; autograd as the model's gather
        pooled = gather_sequence(local_sum, dim=1, dims=dims).sum(dim=1) / length  # (B, W)
        return out(pooled).squeeze(-1)  # (B,)


def critic_gan_loss(real_logits: Tensor, fake_logits: Tensor) -> Tensor:
    """The non-saturating GAN loss of the head (the discriminator): real -> 1, fake -> 0."""
    return F.softplus(-real_logits).mean() + F.softplus(fake_logits).mean()


def generator_gan_loss(fake_logits: Tensor) -> Tensor:
    """The student's side: make the head call its samples real (non-saturating: -log sigmoid)."""
    return F.softplus(-fake_logits).mean()
