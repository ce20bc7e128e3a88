"""Tile-parallel VAE decode and encode: the spatial tiles of diffusers' tiled decode / encode split over ranks.

diffusers' ``tiled_decode`` (``enable_tiling``) cuts the latent into overlapping spatial tiles, decodes each on its
own (a video VAE decodes every tile over all its frames, with the causal feature cache cleared per tile:
``clear_cache()`` before each tile, so tiles are independent), then blends each tile into its upper and left
neighbours (``blend_v`` / ``blend_h``, in place, row-major order) and keeps its top-left ``stride`` part. Since the
tiles are independent, R ranks that all hold the same latents can decode different tiles at once:

1. the tile grid is computed from the model's own tile settings (``tile_sample_min_height``,
   ``tile_sample_stride_height``, ... for AutoencoderKLWan / AutoencoderKLQwenImage; ``tile_latent_min_size``,
   ``tile_overlap_factor`` for AutoencoderKL), exactly as its ``tiled_decode`` computes it;
2. tile k (row-major) is decoded by rank ``k % R`` -- all of a rank's tiles first;
3. the tiles are sent, one row at a time and in row-major order, to the rank(s) that want the result (``dst``: one
   rank, by point-to-point send / recv; ``dst=None``: every rank, by broadcast), which blend them with the model's
   own ``blend_v`` / ``blend_h`` in diffusers' order and crop them into the output.

The blending is diffusers' (its methods, the same order, the same in-place updates), so the result equals one
process's ``model.decode`` with tiling, bit for bit when each tile's decode computes the same bits on every rank
(same device type, kernels and thread count), else within the rounding of the decoder's kernels.

Memory per rank: the tiles it decodes itself (about 1 / R of all of them; a tile is ``tile_sample_min`` square, so
all tiles together are about (min / stride)^2 = 1.8x the output for Wan's 256 / 192), plus, on the rank(s) that
receive the result (``dst``, or every rank with ``dst=None``), two rows of tiles and the output itself.

Encode (``tiled_encode``) works the same way with pixel tiles in and latent tiles out (moments: mean and log-var).
Models whose tiling would not apply (tiling off, or a latent that fits one tile), and VAE classes whose tiling this
module does not mirror (HunyuanVideo 1.5's, LTX-Video's), are decoded whole, by diffusers, on each receiving rank
(the others do nothing). The transport runs on the group's backend: gloo moves tensors through the CPU, nccl
keeps them on this rank's GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringdit.models.vaes import tile_parallel, vae_kind

VIDEO = tile_parallel("video")  # the VAE classes whose tiled encode / decode this reproduces (ringdit.models.vaes)
IMAGE = tile_parallel("image")


@dataclass(frozen=True)
class TileGrid:
    """Where diffusers cuts the input into tiles and how it reassembles their outputs (output units)."""

    rows: tuple[int, ...]          # each tile row's first input row (height index)
    cols: tuple[int, ...]          # each tile column's first input column
    size: tuple[int, int]          # input tile (height, width)
    blend: tuple[int, int]         # blend_v's and blend_h's extents, in output pixels / latents
    keep: tuple[int, int]          # the top-left (height, width) of each blended tile that is kept
    crop: tuple[int, int] | None   # the output's final (height, width), None: no crop

    def tiles(self) -> list[tuple[int, int]]:
        return [(i, j) for i in range(len(self.rows)) for j in range(len(self.cols))]


def _patch(model) -> int | None:
    """The pixel patch of a VAE whose decoding is AutoencoderKLWan's (Wan 2.2's: config.patch_size), else None."""
    kind = vae_kind(model)
    return getattr(model.config, "patch_size", None) if kind is not None and kind.first_chunk else None


def _tiles(model) -> str | None:
    """Which tiled encode / decode of diffusers this module repeats for ``model`` (``VaeKind.tiles``), or None."""
    kind = vae_kind(model)
    return None if kind is None else kind.tiles


def decode_grid(model, z: torch.Tensor) -> TileGrid | None:
    """The tile grid of ``model.tiled_decode(z)``, or None where ``model.decode`` would not tile ``z``."""
    name, tiles = type(model).__name__, _tiles(model)
    if not getattr(model, "use_tiling", False):
        return None
    if tiles == "video":
        height, width = z.shape[-2:]
        ratio = model.spatial_compression_ratio
        latent_h, latent_w = model.tile_sample_min_height // ratio, model.tile_sample_min_width // ratio
        if not (width > latent_w or height > latent_h):
            return None
        stride_h, stride_w = model.tile_sample_stride_height // ratio, model.tile_sample_stride_width // ratio
        sample_h, sample_w = height * ratio, width * ratio
        keep_h, keep_w = model.tile_sample_stride_height, model.tile_sample_stride_width
        min_h, min_w = model.tile_sample_min_height, model.tile_sample_min_width
        patch = _patch(model)
        if patch is not None:  # the decoder's output is still patchified (Wan 2.2): everything / patch
            sample_h, sample_w, keep_h, keep_w = sample_h // patch, sample_w // patch, keep_h // patch, keep_w // patch
            min_h, min_w = min_h // patch, min_w // patch
        return TileGrid(tuple(range(0, height, stride_h)), tuple(range(0, width, stride_w)), (latent_h, latent_w),
                        (min_h - keep_h, min_w - keep_w), (keep_h, keep_w), (sample_h, sample_w))
    if tiles == "image":  # latent tiles in, pixel tiles out
        return _kl_grid(z, model.tile_latent_min_size, model.tile_sample_min_size, model.tile_overlap_factor)
    raise ValueError(f"tile-parallel decoding knows {', '.join(VIDEO + IMAGE)}, not {name}")


def encode_grid(model, x: torch.Tensor) -> TileGrid | None:
    """The tile grid of ``model``'s tiled encode of ``x`` (pixels, patchified already for Wan 2.2), or None where
    ``model.encode`` would not tile it."""
    name, tiles = type(model).__name__, _tiles(model)
    if not getattr(model, "use_tiling", False):
        return None
    if tiles == "video":
        height, width = x.shape[-2:]
        if not (width > model.tile_sample_min_width or height > model.tile_sample_min_height):
            return None
        ratio = model.spatial_compression_ratio
        if _patch(model) is not None:
            ratio = ratio // _patch(model)
        min_h, min_w = model.tile_sample_min_height // ratio, model.tile_sample_min_width // ratio
        keep_h, keep_w = model.tile_sample_stride_height // ratio, model.tile_sample_stride_width // ratio
        return TileGrid(tuple(range(0, height, model.tile_sample_stride_height)),
                        tuple(range(0, width, model.tile_sample_stride_width)),
                        (model.tile_sample_min_height, model.tile_sample_min_width),
                        (min_h - keep_h, min_w - keep_w), (keep_h, keep_w), (height // ratio, width // ratio))
    if tiles == "image":  # pixel tiles in, latent tiles out
        return _kl_grid(x, model.tile_sample_min_size, model.tile_latent_min_size, model.tile_overlap_factor)
    raise ValueError(f"tile-parallel encoding knows {', '.join(VIDEO + IMAGE)}, not {name}")


def _kl_grid(x: torch.Tensor, in_size: int, out_size: int, overlap_factor: float) -> TileGrid | None:
    """AutoencoderKL's tile grid over ``x`` (N, C, H, W), as its ``tiled_decode`` / ``tiled_encode`` compute it:
    input tiles of ``in_size`` every ``in_size * (1 - overlap)``, output tiles of ``out_size`` blended over
    ``out_size * overlap``; None where it would not tile."""
    if not (x.shape[-1] > in_size or x.shape[-2] > in_size):
        return None
    step = int(in_size * (1 - overlap_factor))
    blend = int(out_size * overlap_factor)
    keep = out_size - blend
    return TileGrid(tuple(range(0, x.shape[2], step)), tuple(range(0, x.shape[3], step)), (in_size, in_size),
                    (blend, blend), (keep, keep), None)


def _decode_tile(model, tile: torch.Tensor) -> torch.Tensor:
    """One latent tile decoded as diffusers' ``tiled_decode`` decodes it (a video: frame by frame, its own cache)."""
    if _tiles(model) == "image":
        if model.config.use_post_quant_conv:
            tile = model.post_quant_conv(tile)
        return model.decoder(tile)
    wan = vae_kind(model).first_chunk  # Qwen-Image's decoder takes no first_chunk
    model.clear_cache()
    frames = []
    for k in range(tile.shape[2]):
        model._conv_idx = [0]
        step = model.post_quant_conv(tile[:, :, k:k + 1])
        extra = {"first_chunk": k == 0} if wan else {}
        frames.append(model.decoder(step, feat_cache=model._feat_map, feat_idx=model._conv_idx, **extra))
    model.clear_cache()
    return torch.cat(frames, dim=2)


def _encode_tile(model, tile: torch.Tensor) -> torch.Tensor:
    """One pixel tile encoded as diffusers' tiled encode does (a video: 1 frame, then 4 at a time, its own cache)."""
    if _tiles(model) == "image":
        tile = model.encoder(tile)
        return model.quant_conv(tile) if model.config.use_quant_conv else tile
    model.clear_cache()
    steps = []
    for k in range(1 + (tile.shape[2] - 1) // 4):
        model._enc_conv_idx = [0]
        frames = tile[:, :, :1] if k == 0 else tile[:, :, 1 + 4 * (k - 1):1 + 4 * k]
        out = model.encoder(frames, feat_cache=model._enc_feat_map, feat_idx=model._enc_conv_idx)
        steps.append(model.quant_conv(out))
    model.clear_cache()
    return torch.cat(steps, dim=2)


def _transport_device(group, like: torch.device) -> torch.device:
    return like if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _run(model, x: torch.Tensor, grid: TileGrid, work, group, dst: int | None) -> torch.Tensor | None:
    """Rank ``k % R`` runs ``work`` on input tile k; the receiving rank(s) blend the tiles as diffusers does."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    tiles = grid.tiles()
    th, tw = grid.size
    mine = {}
    for k, (i, j) in enumerate(tiles):
        if k % world == rank:
            r, c = grid.rows[i], grid.cols[j]
            mine[k] = work(model, x[..., r:r + th, c:c + tw])
    described = [None] * world  # every tile's (shape, dtype), for the receivers' buffers
    dist.all_gather_object(described, {k: (tuple(t.shape), t.dtype) for k, t in mine.items()}, group=group)
    layout = {k: spec for part in described for k, spec in part.items()}
    receives = dst is None or rank == dst
    transport = _transport_device(group, x.device)
    out = _allocate(grid, layout, x.device) if receives else None
    top, previous, columns = 0, None, len(grid.cols)
    for i in range(len(grid.rows)):
        row = []
        for j in range(columns):
            k = i * columns + j
            owner, tile = k % world, mine.pop(k, None)
            if dst is None:  # every rank receives every tile
                buffer = tile.to(transport) if tile is not None else torch.empty(
                    layout[k][0], dtype=layout[k][1], device=transport)
                dist.broadcast(buffer, src=dist.get_global_rank(group, owner), group=group)
                tile = buffer.to(x.device) if tile is None else tile
            elif owner != dst and rank == owner:
                dist.send(tile.to(transport).contiguous(), dst=dist.get_global_rank(group, dst), group=group)
                tile = None
            elif owner != dst and rank == dst:
                buffer = torch.empty(layout[k][0], dtype=layout[k][1], device=transport)
                dist.recv(buffer, src=dist.get_global_rank(group, owner), group=group)
                tile = buffer.to(x.device)
            row.append(tile)
        if not receives:
            continue
        kept = []
        for j in range(columns):  # diffusers' blending loop (in place, row-major), one row at a time
            tile = row[j]
            if i > 0:
                tile = model.blend_v(previous[j], tile, grid.blend[0])
            if j > 0:
                tile = model.blend_h(row[j - 1], tile, grid.blend[1])
            row[j] = tile
            kept.append(tile[..., :grid.keep[0], :grid.keep[1]])
        strip = torch.cat(kept, dim=-1)[..., :out.shape[-1]]
        height = min(strip.shape[-2], out.shape[-2] - top)
        out[..., top:top + height, :] = strip[..., :height, :]
        top += height
        previous = row  # the row before it is no longer needed
    return out


def _allocate(grid: TileGrid, layout: dict, device: torch.device) -> torch.Tensor:
    """The output, as diffusers' ``torch.cat(result_rows)`` then its crop: each row keeps ``keep`` (or less, its
    tiles' own size) of every tile."""
    columns = len(grid.cols)
    height = sum(min(grid.keep[0], layout[i * columns][0][-2]) for i in range(len(grid.rows)))
    width = sum(min(grid.keep[1], layout[j][0][-1]) for j in range(columns))
    if grid.crop is not None:
        height, width = min(height, grid.crop[0]), min(width, grid.crop[1])
    shape, dtype = layout[0]
    return torch.empty(*shape[:-2], height, width, dtype=dtype, device=device)


def parallel_decode(model, z: torch.Tensor, group=None, dst: int | None = 0) -> torch.Tensor | None:
    """``model.decode(z).sample`` (diffusers, tiling enabled) with its tiles split over the ranks of ``group``
    (default: the default process group), every rank passing the same ``z``. Returns the pixels on rank ``dst`` of
    the group (``dst=None``: on every rank), None on the others. ``model.enable_slicing()``: the samples of a batch
    one at a time, as diffusers does."""
    return _per_sample(model, z, group, dst, decode=True)


def parallel_encode(model, x: torch.Tensor, group=None, dst: int | None = 0) -> torch.Tensor | None:
    """The moments ``h`` of ``model.encode(x).latent_dist`` (``DiagonalGaussianDistribution(h)``) with the tiles of
    diffusers' tiled encode split over the ranks of ``group``; see ``parallel_decode``."""
    return _per_sample(model, x, group, dst, decode=False)


def _per_sample(model, x, group, dst, decode: bool):
    group = dist.group.WORLD if group is None else group
    if getattr(model, "use_slicing", False) and x.shape[0] > 1:
        parts = [_one(model, part, group, dst, decode) for part in x.split(1)]
        return None if parts[0] is None else torch.cat(parts)
    return _one(model, x, group, dst, decode)


def _one(model, x, group, dst, decode: bool):
    receives = dst is None or dist.get_rank(group) == dst
    if dist.get_world_size(group) == 1:
        return _whole(model, x, decode)
    kind, given = vae_kind(model), x
    if _tiles(model) is None:  # tiling this module does not mirror (HunyuanVideo 1.5's, LTX-Video's VAE):
        return _whole(model, given, decode) if receives else None  # diffusers' own (tiled) pass where it is wanted
    if not decode and _patch(model) is not None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

        x = patchify(x, patch_size=_patch(model))  # as AutoencoderKLWan._encode does before tiling
    grid = decode_grid(model, x) if decode else encode_grid(model, x)
    if grid is None:  # diffusers would not tile it: decoded / encoded whole where it is wanted
        return _whole(model, given, decode) if receives else None
    with torch.no_grad():
        out = _run(model, x, grid, _decode_tile if decode else _encode_tile, group, dst)
    if out is None or not decode:
        return out
    if kind.first_chunk:
        if _patch(model) is not None:
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

            out = unpatchify(out, patch_size=_patch(model))
        out = out.clamp(-1.0, 1.0)
    return out


def _whole(model, x, decode: bool) -> torch.Tensor:
    with torch.no_grad():
        return model.decode(x).sample if decode else model.encode(x).latent_dist.parameters
