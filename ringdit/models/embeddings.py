"""Embedders of the DiT, named and shaped as in facebookresearch/DiT so its checkpoints load unchanged.

Position embeddings are the fixed sin-cos tables of the original, computed for the actual token grid: 2-D for
images (any height and width, not only squares) and 3-D for video (a temporal table next to the spatial one).
"""

from __future__ import annotations

import math

import torch
from torch import nn

Tensor = torch.Tensor


def sincos_1d(embed_dim: int, positions: Tensor) -> Tensor:
    """(N,) positions -> (N, embed_dim): [sin(pos * w), cos(pos * w)] with w = 1 / 10000^(2i / embed_dim)."""
    if embed_dim % 2:
        raise ValueError(f"a sin-cos embedding needs an even size, got {embed_dim}")
    omega = 1.0 / 10000 ** (torch.arange(embed_dim // 2, dtype=torch.float64) / (embed_dim / 2.0))
    angles = positions.to(torch.float64).reshape(-1, 1) * omega  # (N, D/2)
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


def sincos_2d(embed_dim: int, height: int, width: int) -> Tensor:
    """(H * W, embed_dim) for a row-major H x W grid, matching the original's get_2d_sincos_pos_embed for squares.

    As in the original (its meshgrid puts w first), the first half of the channels encodes the column and the
    second half the row.
    """
    if embed_dim % 4:
        raise ValueError(f"a 2-D sin-cos embedding needs a size divisible by 4, got {embed_dim}")
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    return torch.cat([sincos_1d(embed_dim // 2, cols), sincos_1d(embed_dim // 2, rows)], dim=1)


def sincos_3d(embed_dim: int, frames: int, height: int, width: int) -> Tensor:
    """(T * H * W, embed_dim) for a (t, h, w)-ordered video grid: a quarter of the channels encode time, the rest
    the 2-D position within the frame."""
    if embed_dim % 16:
        raise ValueError(f"a 3-D sin-cos embedding needs a size divisible by 16, got {embed_dim}")
    temporal = 4 * (embed_dim // 16)
    spatial = embed_dim - temporal
    time_emb = sincos_1d(temporal, torch.arange(frames)).repeat_interleave(height * width, dim=0)
    space_emb = sincos_2d(spatial, height, width).repeat(frames, 1)
    return torch.cat([time_emb, space_emb], dim=1)


def sincos_pos_embed(embed_dim: int, grid: tuple[int, ...]) -> Tensor:
    """Fixed position table (1, N, embed_dim) in fp32 for a 2-D (h, w) or 3-D (t, h, w) token grid."""
    table = sincos_2d(embed_dim, *grid) if len(grid) == 2 else sincos_3d(embed_dim, *grid)
    return table.float().unsqueeze(0)


class PatchEmbed(nn.Module):
    """Non-overlapping patches -> tokens: (B, C, H, W) -> (B, h*w, D), or (B, C, T, H, W) -> (B, t*h*w, D)."""

    def __init__(self, patch_size: int, in_channels: int, hidden_size: int, temporal_patch_size: int | None = None):
        super().__init__()
        self.patch_size = patch_size
        self.temporal_patch_size = temporal_patch_size
        if temporal_patch_size is None:
            self.proj = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size)
        else:
            kernel = (temporal_patch_size, patch_size, patch_size)
            self.proj = nn.Conv3d(in_channels, hidden_size, kernel_size=kernel, stride=kernel)

    @property
    def patch_shape(self) -> tuple[int, ...]:
        p = self.patch_size
        return (p, p) if self.temporal_patch_size is None else (self.temporal_patch_size, p, p)

    def grid(self, x: Tensor) -> tuple[int, ...]:
        """The token grid of an input: (h, w) or (t, h, w)."""
        spatial = x.shape[2:]
        if len(spatial) != len(self.patch_shape):
            kind = "images (B, C, H, W)" if self.temporal_patch_size is None else "videos (B, C, T, H, W)"
            raise ValueError(f"this DiT takes {kind}, got a tensor of shape {tuple(x.shape)}")
        for size, patch in zip(spatial, self.patch_shape):
            if size % patch:
                raise ValueError(
                    f"input size {tuple(spatial)} is not divisible by the patch size {self.patch_shape}; "
                    f"resize or crop the data to a multiple of the patch size"
                )
        return tuple(size // patch for size, patch in zip(spatial, self.patch_shape))

    def forward(self, x: Tensor) -> Tensor:
        # (B, D, *grid) -> (B, N, D), contiguous: cheaper for every later op, and torch.compile'd blocks (inductor
        # on CPU, torch 2.13) compute wrong LayerNorm input gradients for the transposed layout.
        return self.proj(x).flatten(2).transpose(1, 2).contiguous()


class TimestepEmbedder(nn.Module):
    """Scalar timesteps -> vectors: sinusoidal features followed by a 2-layer MLP."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size, bias=True),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size, bias=True),
        )
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000) -> Tensor:
        """(B,) possibly fractional timesteps -> (B, dim) [cos, sin] features (GLIDE's convention)."""
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
        return embedding

    def forward(self, t: Tensor) -> Tensor:
        features = self.timestep_embedding(t, self.frequency_embedding_size)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """Class labels -> vectors, with one extra "null" row for classifier-free guidance.

    The caller decides which labels are dropped (``drop``): every rank of a sequence-parallel group must drop the
    same ones, so no random draw happens here.
    """

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float):
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), hidden_size)

    @property
    def null_label(self) -> int:
        if self.dropout_prob <= 0:
            raise ValueError("this model has no null class (class_dropout_prob=0): classifier-free guidance is off")
        return self.num_classes

    def forward(self, labels: Tensor, drop: Tensor | None = None) -> Tensor:
        if drop is not None:
            labels = torch.where(drop, torch.full_like(labels, self.null_label), labels)
        return self.embedding_table(labels)
