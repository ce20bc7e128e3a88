"""Tile-parallel VAE decode / encode (ringdit.media.parallel_vae) on 2 gloo CPU ranks equals one process's tiled
decode / encode.

Tolerance: the blending is diffusers' own ``blend_v`` / ``blend_h`` in its order, and each tile is decoded by the
same kernels on one thread (tests/distributed.py sets one thread per rank, as the reference here runs), so the
result is expected to be bit-identical; ``atol=1e-6`` (pixels lie in [-1, 1]; a few fp32 ulps) only leaves room for
a kernel that picks another summation order on another core count.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks

ATOL = 1e-6


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    from diffusers import AutoencoderKLWan

    folder = tmp_path_factory.mktemp("wan_vae")
    torch.manual_seed(0)
    AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                     temperal_downsample=[False, True, True]).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def kl_folder(tmp_path_factory):
    from diffusers import AutoencoderKL

    folder = tmp_path_factory.mktemp("kl_vae")
    torch.manual_seed(0)
    AutoencoderKL(block_out_channels=[8, 8], down_block_types=["DownEncoderBlock2D"] * 2,
                  up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4, norm_num_groups=4,
                  layers_per_block=1).save_pretrained(folder)
    return str(folder)


def _check_decode(rank, world, folder, shape, tile, expect_tiles):
    from ringdit.media.parallel_vae import decode_grid
    from ringdit.media.vae import VAE

    torch.set_num_threads(1)
    vae = VAE(folder, None, tile=tile)
    latents = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    raw = latents / vae._view(vae.scale, latents) + vae._view(vae.shift, latents)
    assert len(decode_grid(vae.model, raw).tiles()) == expect_tiles
    reference = vae.decode(latents)  # this process alone: diffusers' tiled decode
    for dst in (0, 1, None):
        pixels = vae.decode(latents, group=dist.group.WORLD, dst=dst)
        if dst is not None and rank != dst:
            assert pixels is None
            continue
        assert pixels.shape == reference.shape
        torch.testing.assert_close(pixels, reference, rtol=0, atol=ATOL)


def _check_encode(rank, world, folder, shape, tile):
    from ringdit.media.vae import VAE

    torch.set_num_threads(1)
    vae = VAE(folder, None, tile=tile)
    pixels = torch.rand(*shape, generator=torch.Generator().manual_seed(2)) * 2 - 1
    reference = vae.encode(pixels)
    latents = vae.encode(pixels, group=dist.group.WORLD, dst=None)
    assert latents.shape == reference.shape
    torch.testing.assert_close(latents, reference, rtol=0, atol=ATOL)


def _check_both(rank, world, folder, latent_shape, pixel_shape, tile, expect_tiles):
    _check_decode(rank, world, folder, latent_shape, tile, expect_tiles)
    _check_encode(rank, world, folder, pixel_shape, tile)


def test_wan_decode_and_encode_2x2_tiles_over_2_ranks(wan_folder):
    # tile 32 px (latent 4), stride 24 px (latent 3): a 6 x 6 latent is 2 x 2 tiles; 2 latent frames = 5 frames.
    # Encode: 5 frames of 48 x 48 pixels, 2 x 2 pixel tiles of 32 (stride 24)
    run_ranks(_check_both, 2, wan_folder, (1, 16, 2, 6, 6), (1, 3, 5, 48, 48), 32, 4)


def test_wan_decode_odd_tile_count(wan_folder):
    # a 3 x 9 latent: 1 row of 3 tiles over 2 ranks (rank 0 decodes two); a batch of 2 (one sample at a time)
    run_ranks(_check_decode, 2, wan_folder, (2, 16, 2, 3, 9), 32, 3)


def test_image_vae_decode_and_encode_over_2_ranks(kl_folder):
    # AutoencoderKL (2x): tile 16 px = latent 8, stride 6 latents (overlap 25 %): a 14 x 20 latent is 3 x 4 tiles;
    # encode: 28 x 40 pixels, stride 12 px: 3 x 4 tiles
    run_ranks(_check_both, 2, kl_folder, (1, 4, 14, 20), (1, 3, 28, 40), 16, 12)


def test_one_rank_group_is_the_plain_decode(wan_folder):
    from ringdit.media.vae import VAE

    vae = VAE(wan_folder, None, tile=32)
    latents = torch.randn(1, 16, 2, 6, 6, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(vae.decode(latents, group=None), vae.decode(latents), rtol=0, atol=0)


def _check_whole_where_wanted(rank, world, folder):
    from ringdit.media.vae import VAE

    torch.set_num_threads(1)
    vae = VAE(folder, None)
    latents = torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    reference = vae.decode(latents)  # this process alone
    for dst in (0, 1, None):
        pixels = vae.decode(latents, group=dist.group.WORLD, dst=dst)
        if dst is not None and rank != dst:
            assert pixels is None
        else:
            torch.testing.assert_close(pixels, reference, rtol=0, atol=0)


def test_a_vae_whose_tiling_is_not_mirrored_is_decoded_whole_where_wanted(tmp_path):
    """HunyuanVideo 1.5's VAE (a training preview over every rank): diffusers' own decode on the receiving rank."""
    from tests.helpers import tiny_video_vae

    tiny_video_vae("hunyuan_video15", tmp_path / "vae")
    run_ranks(_check_whole_where_wanted, 2, str(tmp_path / "vae"))
