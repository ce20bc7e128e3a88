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
    watch = {"qwenimage_edit": {"img_in": 0}, "wan_vace": {"blocks.0": 0, "vace_blocks.0": 2},
             "ltx2": {"proj_in": 0, "audio_proj_in": 0}, "minimax_h3": {"transformer_blocks.0": 0}}[family]
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


def test_ltx2_counts_its_audio_tokens_a_sequence_of_their_own():
    # tiny: 9 frames x 32 px through LTX-2's 8x / 32x VAE = 2 x 1 x 1 latents; its audio, 9 frames at 24 fps of
    # 16 kHz sound at hop 160, 4x down: round(9 / 24 x 25) = 9 latent audio frames, one token each
    latent = (4, 2, 1, 1)
    audio = round(9 / 24 * 16000 / 160 / 4)
    cond = {"text": torch.randn(1, TEXT_LEN, 16), "text_mask": torch.ones(1, TEXT_LEN, dtype=torch.bool),
            "audio": torch.randn(1, 2, audio, 2)}
    seen = forward_sequences("ltx2", "ltx2_tiny", latent, cond)
    assert seen == {"proj_in": 2, "audio_proj_in": audio}
    size = plan_size("model=ltx2_tiny", "data.size=[32,32]", "data.frames=9")
    assert (size.tokens, dict(size.stream_tokens)) == (seen["proj_in"], {"audio": seen["audio_proj_in"]})
    # LTX-2 at 121 frames of 1088 x 1920: 16 x 34 x 60 video tokens and round(121 / 24 x 25) = 126 audio tokens, as
    # LTX2Pipeline sizes its audio latents
    size = plan_size("model=ltx2", "data.size=[1088,1920]", "data.frames=121")
    assert (size.tokens, dict(size.stream_tokens)) == (16 * 34 * 60, {"audio": 126})


def test_minimax_h3_counts_the_audio_rows_it_packs_with_the_video():
    # tiny: latents (C, 7, 4, 4) -- 7 = 5 + 2 latent frames, 17 + 5 = 22 pixel frames, 40 audio latents a second at
    # 24 fps: round(22 / 24 x 40) = 37 per stereo channel, 74 rows packed with the video's and the text's
    arch = architecture("minimax_h3_tiny")
    channels, patch = arch["in_channels"], arch["patch_size"]
    latent = (channels, 7, 4, 4)
    audio = round(22 / 24 * 40)
    cond = {"text": torch.randn(1, TEXT_LEN, arch["text_dim"]), "text_mask": torch.ones(1, TEXT_LEN, dtype=torch.bool),
            "audio": torch.randn(1, 2, audio, arch["audio_in_channels"])}
    video = prod(s // p for s, p in zip(latent[1:], patch))
    seen = forward_sequences("minimax_h3", "minimax_h3_tiny", latent, cond)["transformer_blocks.0"]
    assert seen == TEXT_LEN + 2 * audio + video  # [text | audio | video], the pipeline's t2va layout
    size = plan_size("model=minimax_h3_tiny", "data.latent=false", "data.frames=7", "data.size=[4,4]")
    assert (size.tokens, dict(size.stream_tokens)) == (seen - TEXT_LEN, {"audio": 2 * audio})
    # MiniMax-H3 at 243 frames (72 x 48 x 84 latents): 72 x 24 x 42 video rows and 2 x round(243 / 24 x 40) audio rows
    size = plan_size("model=minimax_h3", "data.latent=false", "data.frames=72", "data.size=[48,84]")
    assert (size.tokens, dict(size.stream_tokens)) == (72 * 24 * 42 + 810, {"audio": 810})


@pytest.mark.parametrize("preset", ["wan_tiny", "qwenimage_tiny"])
def test_a_model_of_one_stream_counts_its_grid_alone(preset):
    size = plan_size(f"model={preset}", "data.size=[32,32]",
                     *(["data.frames=9"] if preset == "wan_tiny" else []))
    assert size.stream_tokens == () and size.tokens == (3 * 2 * 2 if preset == "wan_tiny" else 2 * 2)
