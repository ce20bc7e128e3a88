"""The DiT: original-checkpoint compatibility, shapes, and sharded-equals-unsharded on CPU ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from hydra.utils import instantiate

from ringdit.commands.cli import model_preset
from ringdit.models import sincos_pos_embed
from ringdit.models import parallelize
from ringdit.parallel import init_sequence_parallel
from tests.distributed import run_ranks
from tests.helpers import assert_same_numbers, original_dit_state_dict_shapes, tiny_dit

# ---- original checkpoints ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "depth", "hidden", "heads", "patch"),
                         [("dit_s", 12, 384, 6, 2), ("dit_b", 12, 768, 12, 4)])
def test_original_dit_state_dict_loads_strictly(name, depth, hidden, heads, patch):
    shapes = original_dit_state_dict_shapes(depth, hidden, heads, patch)
    state = {key: torch.randn(shape) for key, shape in shapes.items()}
    model = instantiate(model_preset(name), patch_size=patch, input_size=32, in_channels=4, num_classes=1000)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes
    model.load_state_dict(state, strict=True)
    torch.testing.assert_close(model.blocks[3].attn.qkv.weight, state["blocks.3.attn.qkv.weight"])


def test_original_size_table():
    """The presets carry the original's sizes (Peebles & Xie, 2023, Table 1) and its shared settings."""
    table = {"dit_xl": (28, 1152, 16), "dit_l": (24, 1024, 16), "dit_b": (12, 768, 12), "dit_s": (12, 384, 6)}
    for name, (depth, hidden, heads) in table.items():
        preset = model_preset(name)
        assert (preset["depth"], preset["hidden_size"], preset["num_heads"]) == (depth, hidden, heads), name
        assert preset["patch_size"] == 2 and preset["learn_sigma"] and preset["class_dropout_prob"] == 0.1, name
    with torch.device("meta"):  # sizes only
        xl = instantiate(model_preset("dit_xl"), input_size=32, in_channels=4, num_classes=1000)
    assert sum(p.numel() for p in xl.parameters() if p.requires_grad) == pytest.approx(675e6, rel=0.01)


def test_pos_embed_matches_the_original_formula_on_square_grids():
    """The original get_2d_sincos_pos_embed, transcribed in numpy (first half: column index, then row)."""
    import numpy as np

    def original(embed_dim, grid_size):
        def one_d(dim, pos):
            omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
            out = np.einsum("m,d->md", pos.reshape(-1), omega)
            return np.concatenate([np.sin(out), np.cos(out)], axis=1)

        grid = np.stack(np.meshgrid(np.arange(grid_size, dtype=np.float32), np.arange(grid_size, dtype=np.float32)))
        grid = grid.reshape([2, 1, grid_size, grid_size])
        return np.concatenate([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])], axis=1)

    ours = sincos_pos_embed(64, (5, 5))[0].numpy()
    np.testing.assert_allclose(ours, original(64, 5).astype(np.float32), atol=1e-6)


def test_any_grid_and_video_shapes():
    model = tiny_dit()
    x = torch.randn(2, 3, 6, 10)  # non-square, not the configured 8x8
    out = model(x, torch.tensor([10.0, 500.0]), torch.tensor([1, 2]))
    assert out.shape == (2, 6, 6, 10)
    video = tiny_dit(video=True)
    x = torch.randn(2, 3, 6, 8, 4)
    assert video(x, torch.tensor([1.0, 2.0]), torch.tensor([0, 9])).shape == (2, 6, 6, 8, 4)
    tokens = patchify(x, (2, 2, 2))
    assert tokens.shape == (2, 3 * 4 * 2, 2 * 2 * 2 * 3)
    torch.testing.assert_close(video.unpatchify(tokens, (3, 4, 2), channels=3), x)


def patchify(x, patch):
    """(B, C, T, H, W) -> (B, N, patch_volume * C), tokens in grid order, each patch's cells channel-last: the layout
    unpatchify reads, written out axis by axis."""
    batch, channels = x.shape[:2]
    grid = [size // p for size, p in zip(x.shape[2:], patch)]
    tokens = []
    for t in range(grid[0]):
        for h in range(grid[1]):
            for w in range(grid[2]):
                cell = x[:, :, t * patch[0]:(t + 1) * patch[0], h * patch[1]:(h + 1) * patch[1],
                         w * patch[2]:(w + 1) * patch[2]]  # (B, C, pt, ph, pw)
                tokens.append(cell.permute(0, 2, 3, 4, 1).reshape(batch, -1))
    return torch.stack(tokens, dim=1)


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match=r"input size \(7, 8\) is not divisible by the patch size \(2, 2\)"):
        tiny_dit()(torch.randn(1, 3, 7, 8), torch.zeros(1), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden_size=64 is not divisible by num_heads=5"):
        tiny_dit(num_heads=5)
    with pytest.raises(ValueError, match=r"input_size \(9, 9\) is not divisible by the patch size"):
        tiny_dit(input_size=9)


def test_label_drop_uses_the_null_class():
    model = tiny_dit()
    x, t = torch.randn(2, 3, 8, 8), torch.tensor([3.0, 3.0])
    dropped = model(x, t, torch.tensor([4, 5]), drop_labels=torch.tensor([True, True]))
    null = model(x, t, torch.tensor([model.null_label] * 2))
    torch.testing.assert_close(dropped, null)


def test_gradient_checkpointing_gives_the_same_gradients():
    plain, ckpt = tiny_dit(), tiny_dit(activation_checkpointing=True)
    x, t, y = torch.randn(2, 3, 8, 8), torch.tensor([5.0, 900.0]), torch.tensor([1, 2])
    for model in (plain, ckpt):
        model(x, t, y).square().mean().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        if a.requires_grad:  # every trainable parameter has a gradient on both sides (none lost it)
            assert a.grad is not None and b.grad is not None, f"{name} has no gradient"
            torch.testing.assert_close(a.grad, b.grad, msg=name)


# ---- sharded equals unsharded -----------------------------------------------------------------------------------


def fp64_close(actual, expected, msg):
    """Equal up to fp64 rounding: a layout changes the GEMM shapes (tokens per rank) and the ring's merge order, so
    the order of the sums, not the math. In fp32 that reordering costs ~2e-7 (outputs) and ~5e-7 (gradients) of a
    tensor's max measured on one machine -- another CPU's kernels may differ more; in fp64 (u = 1.1e-16) ~1e-15.
    1e-10 of max leaves 10^5 of headroom and stays 10^3 below fp32's rounding: a token dropped, padded in or counted
    twice, or a wrongly scaled gradient, is off by O(1)."""
    assert_same_numbers(actual, expected, rtol=1e-10, of_max=1e-10, where=msg)


def check_sharded_dit(rank, world, ring, ulysses, video, spatial):
    model = tiny_dit(video=video).double()  # fp64: see fp64_close
    g = torch.Generator().manual_seed(1)
    shape = (2, 3, *spatial)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    target = torch.randn(2, 6, *spatial, generator=g, dtype=torch.float64)
    t, y, drop = torch.tensor([37.0, 912.0]), torch.tensor([3, 7]), torch.tensor([False, True])

    reference = copy.deepcopy(model)  # one device, not parallelized
    ref_out = reference(x, t, y, drop)
    ref_loss = (ref_out - target).square().mean()
    ref_loss.backward()

    dims = init_sequence_parallel(ring, ulysses)
    parallelize(model, model.parallel_plan, dims, backend="torch_flash")
    out = model(x, t, y, drop)  # gathered: the whole prediction on every rank
    fp64_close(out, ref_out, f"output ({ring}x{ulysses})")
    loss = (out - target).square().mean()  # the whole sample's loss, as DiffusionModule computes it
    logged = loss.detach().clone()
    dist.all_reduce(logged)
    fp64_close(logged / world, ref_loss.detach(), f"loss ({ring}x{ulysses})")  # what gets logged
    loss.backward()
    for (name, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        if not p.requires_grad:
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad)  # DDP: average over every rank, sequence-parallel ranks included
        fp64_close(grad / world, ref.grad, f"{name} ({ring}x{ulysses})")
    assert dims.sp_degree == ring * ulysses


SHARDED_CASES = [  # (ring, ulysses, video, spatial size)
    (2, 1, False, (10, 6)),  # 15 tokens over 2 ranks: padded
    (4, 1, False, (8, 8)),  # 16 tokens
    (2, 2, False, (6, 10)),  # 15 tokens over 4 ranks
    (4, 1, True, (6, 8, 4)),  # video: 3 x 4 x 2 = 24 tokens
    (2, 2, True, (4, 6, 6)),  # video: 2 x 3 x 3 = 18 tokens, padded
]


def check_all_sharded_cases(rank, world):
    for case in SHARDED_CASES:  # one group of processes for all cases: spawning dominates the test's time
        check_sharded_dit(rank, world, *case)


def test_sharded_dit_equals_one_device():
    run_ranks(check_all_sharded_cases, 4)
