"""Flux's latent packing: 2x2 patches of a (B, C, H, W) latent as the tokens the image transformers read (Flux,
Flux.2, QwenImage), as their pipelines pack VAE latents."""

from __future__ import annotations

from torch import Tensor


def pack_latents(x: Tensor) -> Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): Flux's 2x2 patches as tokens (as FluxPipeline packs VAE latents)."""
    batch, channels, height, width = x.shape
    x = x.view(batch, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(batch, (height // 2) * (width // 2), channels * 4)


def unpack_latents(tokens: Tensor, height: int, width: int) -> Tensor:
    """The inverse of ``pack_latents``."""
    batch, _, packed = tokens.shape
    x = tokens.view(batch, height // 2, width // 2, packed // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(batch, packed // 4, height, width)
