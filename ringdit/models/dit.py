"""Diffusion Transformer with adaLN-Zero blocks (Peebles & Xie, 2023), for images and video.

The model math is written for one device and follows facebookresearch/DiT ``models.py`` (same parameter names and
shapes, so original checkpoints load with strict key checking). Sequence parallelism attaches at exactly two places:

- every attention runs through ``USPAttention`` (ring / Ulysses across the sequence-parallel group);
- the token sequence is sharded after patch + position embedding (``shard_sequence``) and gathered at the output
  (``gather_sequence``) -- or left sharded, for a loss computed on each rank's own tokens (``forward_tokens``).

The mesh comes from outside: ``ringdit.parallel.set_parallel_dims(model, dims)`` hands it to the DiT and to every
attention layer (the strategy does this); until then the model runs on one process.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ringdit.attention import USPAttention
from ringdit.models.embeddings import LabelEmbedder, PatchEmbed, TimestepEmbedder, sincos_pos_embed
from ringdit.parallel import ParallelDims, gather_sequence, shard_sequence

Tensor = torch.Tensor


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN: per-sample affine of normalised tokens. x (B, N, D), shift/scale (B, D)."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class Attention(nn.Module):
    """Multi-head self-attention with timm's parameter names (qkv, proj); the kernel is USPAttention's."""

    def __init__(self, dim: int, num_heads: int, attention_backend: str | None = None):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden_size={dim} is not divisible by num_heads={num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.attn = USPAttention(num_heads, self.head_dim, backend=attention_backend)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, valid_len: int | None = None) -> Tensor:
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, self.head_dim).unbind(2)  # (B, N, H, Dh)
        out = self.attn(q, k, v, valid_len=valid_len)  # (B, N, H, Dh)
        return self.proj(out.reshape(batch, tokens, dim))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DiTBlock(nn.Module):
    """Transformer block whose LayerNorms are modulated by the conditioning, with zero-initialised gates."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0, attention_backend: str | None = None):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads, attention_backend)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size, bias=True))

    def forward(self, x: Tensor, c: Tensor, valid_len: int | None = None) -> Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa), valid_len)
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    def __init__(self, hidden_size: int, patch_volume: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_volume * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    """Class-conditional DiT over image latents/pixels ``(B, C, H, W)`` or videos ``(B, C, T, H, W)``.

    Args mirror the original; additions: ``input_size`` may be ``(H, W)`` or ``(T, H, W)``,
    ``temporal_patch_size`` makes it a video model, ``attention_backend`` picks the kernel,
    ``activation_checkpointing`` recomputes each block in backward (``gradient_checkpointing``: its older name). Any grid divisible by the patch works at run
    time; ``input_size`` only fixes the stored ``pos_embed`` (the original's parameter) and the default shape.
    """

    def __init__(
        self,
        input_size: int | tuple[int, ...] = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        hidden_size: int = 1152,
        depth: int = 28,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        class_dropout_prob: float = 0.1,
        num_classes: int = 1000,
        learn_sigma: bool = True,
        temporal_patch_size: int | None = None,
        attention_backend: str | None = None,
        activation_checkpointing: bool = False,
        gradient_checkpointing: bool = False,
    ):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.learn_sigma = learn_sigma
        self.num_classes = num_classes
        self.class_dropout_prob = class_dropout_prob
        self.activation_checkpointing = activation_checkpointing or gradient_checkpointing
        self.input_size = _input_shape(input_size, video=temporal_patch_size is not None)

        self.x_embedder = PatchEmbed(patch_size, in_channels, hidden_size, temporal_patch_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        _check_divisible(self.input_size, self.x_embedder.patch_shape)
        self.default_grid = tuple(s // p for s, p in zip(self.input_size, self.x_embedder.patch_shape))
        # Fixed sin-cos table for the default grid, a frozen parameter as in the original checkpoints.
        self.pos_embed = nn.Parameter(sincos_pos_embed(hidden_size, self.default_grid), requires_grad=False)
        self.blocks = nn.ModuleList(
            [DiTBlock(hidden_size, num_heads, mlp_ratio, attention_backend) for _ in range(depth)]
        )
        self.final_layer = FinalLayer(hidden_size, math.prod(self.x_embedder.patch_shape), self.out_channels)
        self.dims = ParallelDims()
        self.initialize_weights()

    def set_parallel_dims(self, dims: ParallelDims) -> None:
        """Where the token sequence splits and gathers (the attention layers get ``dims`` on their own)."""
        self.dims = dims

    def initialize_weights(self) -> None:
        """The original's init: xavier linears, zeroed adaLN modulation and output layer (adaLN-Zero)."""

        def basic_init(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.constant_(module.bias, 0)

        self.apply(basic_init)
        weight = self.x_embedder.proj.weight.data
        nn.init.xavier_uniform_(weight.view([weight.shape[0], -1]))
        nn.init.constant_(self.x_embedder.proj.bias, 0)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for module in [*(block.adaLN_modulation[-1] for block in self.blocks), self.final_layer.adaLN_modulation[-1]]:
            nn.init.constant_(module.weight, 0)
            nn.init.constant_(module.bias, 0)
        nn.init.constant_(self.final_layer.linear.weight, 0)
        nn.init.constant_(self.final_layer.linear.bias, 0)

    # ---- tokens <-> pixels -----------------------------------------------------------------------------------------
    def patchify(self, x: Tensor) -> Tensor:
        """(B, C, [T,] H, W) -> (B, N, patch_volume * C), the layout of the model's output tokens."""
        grid, patch = self.x_embedder.grid(x), self.x_embedder.patch_shape
        batch, channels = x.shape[:2]
        # split every spatial axis into (grid, patch): (B, C, g0, p0, g1, p1, ...)
        x = x.reshape(batch, channels, *[n for pair in zip(grid, patch) for n in pair])
        dims = len(grid)
        order = [0, *range(2, 2 + 2 * dims, 2), *range(3, 3 + 2 * dims, 2), 1]  # (B, g..., p..., C)
        return x.permute(order).reshape(batch, math.prod(grid), math.prod(patch) * channels)

    def unpatchify(self, tokens: Tensor, grid: tuple[int, ...], channels: int | None = None) -> Tensor:
        """(B, N, patch_volume * C) -> (B, C, [T,] H, W); the inverse of ``patchify``."""
        channels = channels or self.out_channels
        patch = self.x_embedder.patch_shape
        batch, dims = tokens.shape[0], len(grid)
        x = tokens.reshape(batch, *grid, *patch, channels)  # (B, g..., p..., C)
        order = [0, 1 + 2 * dims, *[i for d in range(dims) for i in (1 + d, 1 + dims + d)]]  # (B, C, g0, p0, ...)
        return x.permute(order).reshape(batch, channels, *[g * p for g, p in zip(grid, patch)])

    def position_embedding(self, grid: tuple[int, ...]) -> Tensor:
        if grid == self.default_grid:
            return self.pos_embed
        return _cached_pos_embed(self.pos_embed.shape[-1], grid).to(self.pos_embed.device)

    # ---- forward ----------------------------------------------------------------------------------------------------
    def forward_tokens(self, x: Tensor, t: Tensor, y: Tensor, drop_labels: Tensor | None = None) -> Tensor:
        """This sequence-parallel rank's output tokens ``(B, N_local, patch_volume * out_channels)``.

        x: (B, C, [T,] H, W) -- the whole sample, identical on every rank of the group; t: (B,) timesteps in the
        embedder's scale (0..1000); y: (B,) labels; drop_labels: (B,) bool, True where the label is replaced by
        the null class (classifier-free guidance training).
        """
        grid = self.x_embedder.grid(x)
        tokens = self.x_embedder(x) + self.position_embedding(grid)  # (B, N, D)
        c = self.t_embedder(t) + self.y_embedder(y, drop_labels)  # (B, D)
        sharded = self.dims.sp_degree > 1
        valid_len = tokens.shape[1] if sharded else None  # the padding that makes N divisible is not attended
        tokens = shard_sequence(tokens, dims=self.dims)  # (B, N_local, D)
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                tokens = checkpoint(block, tokens, c, valid_len, use_reentrant=False)
            else:
                tokens = block(tokens, c, valid_len)
        return self.final_layer(tokens, c)  # (B, N_local, patch_volume * out_channels)

    def forward(self, x: Tensor, t: Tensor, y: Tensor, drop_labels: Tensor | None = None) -> Tensor:
        """(B, C, [T,] H, W) -> (B, out_channels, [T,] H, W), gathered from all sequence-parallel ranks."""
        grid = self.x_embedder.grid(x)
        tokens = self.forward_tokens(x, t, y, drop_labels)  # (B, N_local, patch_volume * out_channels)
        tokens = gather_sequence(tokens, dim=1, length=math.prod(grid), dims=self.dims)
        return self.unpatchify(tokens, grid)

    @property
    def null_label(self) -> int:
        return self.y_embedder.null_label


def _input_shape(input_size, video: bool) -> tuple[int, ...]:
    size = (input_size, input_size) if isinstance(input_size, int) else tuple(int(s) for s in input_size)
    expected = 3 if video else 2
    if len(size) != expected:
        what = "(T, H, W) for a video model" if video else "an int or (H, W) for an image model"
        raise ValueError(f"input_size must be {what}, got {input_size!r}")
    return size


def _check_divisible(size: tuple[int, ...], patch: tuple[int, ...]) -> None:
    if any(s % p for s, p in zip(size, patch)):
        raise ValueError(
            f"input_size {size} is not divisible by the patch size {patch}; choose a patch size that divides it"
        )


@lru_cache(maxsize=16)
def _cached_pos_embed(embed_dim: int, grid: tuple[int, ...]) -> Tensor:
    return sincos_pos_embed(embed_dim, grid)
