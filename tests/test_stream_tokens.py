"""``python -m ringdit.plan`` counts every token stream a multi-stream model attends over (issue 56): the sequence it
lays out is the one the model's forward builds -- Qwen-Image-Edit's image and reference tokens packed in one
sequence, Wan VACE's video tokens and its control video's through the VACE blocks -- counted from the tiny model's
forward at a small size, and the published model's count at its size follows the same rule."""

from __future__ import annotations

from math import prod

import pytest
import torch
from hydra import compose, initialize_config_dir

from ringdit.commands.cli import CONF_DIR, register_resolvers
from ringdit.models.build import build_model
from ringdit.models.diffusers import DiffusersTransformer
from ringdit.plan.shapes import planned_model
from tests.helpers import architecture

TEXT_LEN = 7


def plan_size(*overrides: str):
    """The planner's ``ModelSize`` for ``python -m ringdit.plan overrides``."""
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("plan", overrides=list(overrides))
    return planned_model(cfg)[0]


def forward_sequences(family: str, preset: str, shape: tuple[int, ...], cond: dict) -> dict[str, int]:
    """{module: tokens of the sequence it receives} from one forward of the tiny model on latents of ``shape``."""
    model = DiffusersTransformer(family, config=architecture(preset), input_size=list(shape[1:]), in_channels=shape[0],
                                 text_len=TEXT_LEN)
    seen = {}
    watch = {"qwenimage_edit": {"img_in": 0}, "wan_vace": {"blocks.0": 0, "vace_blocks.0": 2}}[family]
    for name, index in watch.items():
        def hook(module, args, name=name, index=index):
            seen[name] = args[index].shape[1]  # (B, S, ...) the tokens the module takes
        model.transformer.get_submodule(name).register_forward_pre_hook(hook)
    with torch.no_grad():
        model(torch.randn(1, *shape), torch.tensor([0.5]), cond)
    return seen


def test_qwenimage_edit_counts_the_reference_tokens_its_forward_joins():
    # tiny: 32 px through the 8x VAE = 4 x 4 latents, 2 x 2 tokens, and a reference of the image's size
    latent = (4, 4, 4)  # qwenimage_tiny: 16 input channels = 4 latent channels x 2 x 2
    cond = {"text": torch.randn(1, TEXT_LEN, 16), "text_mask": torch.ones(1, TEXT_LEN, dtype=torch.bool),
            "reference": torch.randn(1, *latent)}
    sequence = forward_sequences("qwenimage_edit", "qwenimage_edit_tiny", latent, cond)["img_in"]
    grid = prod(s // 2 for s in latent[1:])
    assert sequence == 2 * grid  # the image's tokens and the reference's
    assert plan_size("model=qwenimage_edit_tiny", "data.size=[32,32]").tokens == sequence
    # the published model at 1024 px: 64 x 64 image tokens, and as many again by the same rule
    size = plan_size("model=qwenimage_edit", "data.size=[1024,1024]")
    assert size.tokens == sequence // grid * 64 * 64 == 8192
    assert dict(size.stream_tokens) == {"reference": 4096}


def test_wan_vace_counts_the_control_tokens_through_its_vace_blocks():
    # tiny: 9 frames x 32 px through Wan's 4x / 8x VAE = 3 x 4 x 4 latents, 3 x 2 x 2 tokens
    latent = (4, 3, 4, 4)
    cond = {"text": torch.randn(1, TEXT_LEN, 16), "control": torch.randn(1, 72, *latent[1:])}
    seen = forward_sequences("wan_vace", "wan_vace_tiny", latent, cond)
    grid = 3 * 2 * 2
    assert seen == {"blocks.0": grid, "vace_blocks.0": grid}  # the video's tokens, and the control's as many
    size = plan_size("model=wan_vace_tiny", "data.size=[32,32]", "data.frames=9")
    assert (size.tokens, dict(size.stream_tokens)) == (seen["blocks.0"], {"control": seen["vace_blocks.0"]})
    # the control tokens' cost: the VACE blocks are blocks the planner counts, each over as many tokens
    tiny = architecture("wan_vace_tiny")
    assert size.depth == tiny["num_layers"] + len(tiny["vace_layers"])
    # Wan2.1-VACE-1.3B at 480 x 832 x 81 frames: 21 x 30 x 52 video tokens, and as many control tokens
    size = plan_size("model=wan_vace_1_3b", "data.size=[480,832]")
    assert (size.tokens, dict(size.stream_tokens)) == (21 * 30 * 52, {"control": seen["vace_blocks.0"] // grid
                                                                      * 21 * 30 * 52})
    assert size.depth == 30 + 15


@pytest.mark.parametrize("preset", ["wan_tiny", "qwenimage_tiny"])
def test_a_model_of_one_stream_counts_its_grid_alone(preset):
    size = plan_size(f"model={preset}", "data.size=[32,32]",
                     *(["data.frames=9"] if preset == "wan_tiny" else []))
    assert size.stream_tokens == () and size.tokens == (3 * 2 * 2 if preset == "wan_tiny" else 2 * 2)
