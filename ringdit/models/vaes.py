"""The VAE kinds ringdit encodes with (prepare) and decodes with (infer, previews, the server): one record per
diffusers VAE class, the facts the code outside this module asks for instead of keeping its own table."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VaeKind:
    class_name: str        # the diffusers class its folder's config.json names
    video: bool            # (B, 3, T, H, W) in, (B, C, T', H', W') out; else (B, 3, H, W) in, (B, C, H', W') out
    frame_pad: int = 1     # latent frames padded at the front (copies of the first) to a multiple of this, which
    #                        decoding drops again (CogVideoX 1.5: 2, its transformer's temporal patch); 1: none
    tiles: str | None = None  # the tiled encode / decode of diffusers that ringdit.media.parallel_vae spreads over
    #                           ranks: "video" (Wan's, frame by frame with its cache) or "image" (AutoencoderKL's);
    #                           None: this VAE tiles on one process only
    latent_patch: int = 1  # the side of the latent patches its normalisation (latents_mean / std, batch norm) is
    #                        per: AutoencoderKLFlux2's batch norm is over 2x2-patchified channels; 1: per latent cell
    pipeline: str = ""     # the diffusers pipeline whose latent handling this follows, where messages name it
    # how its enable_tiling takes a tile size (ringdit.media.vae's tile=): "strides" (tile_sample_min_* and strides,
    # 3/4 of the tile), "sizes" (sample and latent tile sizes, its own overlap), "overlap" (sample tile sizes and
    # overlap factors of a quarter), "attributes" (AutoencoderKL's tile_sample_min_size / tile_latent_min_size),
    # "min_overlap" (sample tile sizes and minimum overlaps of a quarter: AutoencoderKLMiniMaxH3's);
    # None: by whether it is a video VAE, "strides" or "attributes"
    tile_setting: str | None = None
    # AutoencoderKLWan's decoding: its decoder takes first_chunk, its pixels may be patchified (config.patch_size:
    # Wan 2.2's) and its decode clamps to [-1, 1] -- what ringdit.media.parallel_vae repeats per tile
    first_chunk: bool = False
    # AutoencoderKLMiniMaxH3's time: clip_length-frame chunks of tokens_chunk_size latent frames, token_drop of them
    # dropped at the end (17n + 5 frames -> 5n + 2 latent frames: ringdit.models.frame_rule's chunk rule)
    chunks: bool = False
    # the pixels its encode takes and its decode gives: "signed" ([-1, 1]) or "imagenet" (AutoencoderKLMiniMaxH3's
    # ImageNet-normalised [0, 1]: (x - mean) / std with the ImageNet mean and std, as its modular pipeline encodes)
    pixels: str = "signed"

    @property
    def tiles_by(self) -> str:
        """``tile_setting``, its default resolved."""
        return self.tile_setting or ("strides" if self.video else "attributes")


VAE_KINDS = {kind.class_name: kind for kind in (
    VaeKind("AutoencoderKLWan", video=True, tiles="video", first_chunk=True),
    VaeKind("AutoencoderKLQwenImage", video=True, tiles="video"),  # Wan's code, Qwen-Image's weights
    VaeKind("AutoencoderKLLTXVideo", video=True),
    VaeKind("AutoencoderKLLTX2Video", video=True),  # LTX-2's: LTX-Video's latents_mean / std and tiling, 8x / 32x
    VaeKind("AutoencoderKLHunyuanVideo15", video=True, tile_setting="sizes"),
    # MiniMax-H3's: its enable_tiling takes tile sizes and minimum overlaps ("min_overlap"); tiling on by default
    VaeKind("AutoencoderKLMiniMaxH3", video=True, tile_setting="min_overlap", chunks=True, pixels="imagenet",
            pipeline="MiniMaxH3ModularPipeline"),
    VaeKind("AutoencoderKLCogVideoX", video=True, frame_pad=2, tile_setting="overlap"),
    VaeKind("AutoencoderKL", video=False, tiles="image"),
    VaeKind("AutoencoderKLFlux2", video=False, tiles="image", latent_patch=2,  # tiles: AutoencoderKL's code
            pipeline="Flux2Pipeline"),
)}


def vae_kind(model) -> VaeKind | None:
    """The record of a built diffusers VAE (None: a class ringdit does not know)."""
    return VAE_KINDS.get(type(model).__name__)


def tile_parallel(tiles: str) -> tuple[str, ...]:
    """The VAE classes whose ``tiles`` ("video" or "image") ringdit.media.parallel_vae reproduces."""
    return tuple(name for name, kind in VAE_KINDS.items() if kind.tiles == tiles)
