"""Training LTX-2 (video and audio denoised together, ``Family.joint_latents``): DiffusionModule's loss is the video's
mean squared flow-matching error plus the audio's, both noised at the sample's time, through the unmodified diffusers
model; SGD steps through that loss at ring 2 under DDP, at Ulysses 2 under FSDP and with LoRA at ring 2 equal one
process (in the ranks); data without the audio latents, or audio for a model that makes no sound, are refused before
anything is built, and the refusal's advice composes."""

from __future__ import annotations

import os

import pytest
import torch

from tests.diffusers_helpers import check_sgd_layouts, joint_loss_draws, video_audio_batch
from tests.distributed import run_ranks
from tests.helpers import architecture, assert_same_numbers

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE, AUDIO_SHAPE, TEXT_LEN = (3, 3, 3), (2, 5, 2), 7  # 27 video and 5 audio tokens: padded at ring 2
MODEL = {"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "ltx2",
         "config": architecture("ltx2_tiny"), "input_size": list(SHAPE), "in_channels": 4, "text_len": TEXT_LEN,
         "text_dim": 16, "condition_dropout_prob": 0.5}  # half the samples drop their prompt, none their audio
STEPS, LR = 2, 0.5


def module_and_batch():
    return video_audio_batch(SHAPE, AUDIO_SHAPE, TEXT_LEN)


def test_the_loss_is_the_video_and_the_audio_flow_matching_errors_through_the_unmodified_model():
    """One process, float64: the module's loss equals the sum of the two mean squared errors computed here with the
    diffusers model called directly on the same draws (the sample's time, the video's noise, then the audio's)."""
    loss, reference, x0, cond, t, noise, audio_noise, x_t, audio_t = joint_loss_draws(
        MODEL, "LTX2VideoTransformer3DModel", "ltx2_tiny", module_and_batch, 27)
    video_out, audio_out = reference(
        hidden_states=x_t.permute(0, 2, 3, 4, 1).reshape(2, -1, 4), 
        audio_hidden_states=audio_t.transpose(1, 2).flatten(2),
        encoder_hidden_states=cond["text"], audio_encoder_hidden_states=cond["text"], timestep=t * 1000,
        audio_timestep=t * 1000, sigma=t * 1000, encoder_attention_mask=cond["text_mask"],
        audio_encoder_attention_mask=cond["text_mask"], num_frames=3, height=3, width=3, fps=24.0,
        audio_num_frames=5, return_dict=False)
    video_out = video_out.reshape(2, *SHAPE, 4).permute(0, 4, 1, 2, 3)
    audio_out = audio_out.unflatten(2, (2, 2)).transpose(1, 2)
    expected = ((video_out - (noise - x0)) ** 2).mean() + ((audio_out - (audio_noise - cond["audio"])) ** 2).mean()
    # diffusion_loss squares the errors in float32 (as it trains): the same sum up to float32 rounding
    assert_same_numbers(loss, expected, of_max=1e-6, where="joint loss")


def audio_trains(name, kind, weights):
    if kind == "lora":  # the audio stream's and the cross-modal attention's adapters train too
        assert any(".audio_to_video_attn." in key for key in weights), sorted(weights)[:3]
    else:  # the audio output layer trains: the audio's error reaches it
        assert not torch.equal(weights["transformer.audio_proj_out.weight"], build_untrained_audio_proj_out()), name


def check_training(rank, world):
    check_sgd_layouts(world, MODEL, module_and_batch, STEPS, LR, check=audio_trains)


def build_untrained_audio_proj_out() -> torch.Tensor:
    from ringdit.models.build import build_model

    return build_model(MODEL, seed=7)[0].transformer.audio_proj_out.weight.detach()


def test_ltx2_sgd_steps_equal_one_process_under_ddp_fsdp_and_lora():
    run_ranks(check_training, 2)


@pytest.mark.parametrize(("overrides", "message"), [
    (["model=ltx2_tiny"], "model.family=ltx2 generates video and audio together, but the data has no 'audio' "
                          "latents .* e.g. data=synthetic_text_latents data.audio=\\[2,5,2\\]"),
    (["model=wan_tiny", "data.audio=[2,5,2]"], "the data hold the clips' 'audio' latents, but model.family=wan "
                                               "generates no sound"),
    (["model=ltx2_tiny", "data.audio=[2,5]"], "data.audio=\\[2, 5\\]: give the audio latents' \\[channels, frames, "
                                              "mel bins\\]"),
], ids=["video without audio", "audio for a silent model", "audio of another shape"])
def test_audio_data_that_do_not_fit_the_model_are_refused_before_anything_is_built(overrides, message, tmp_path):
    from tests.families import assert_refused_before_spawning

    common = ["data=synthetic_text_latents", "data.num_samples=8", "data.batch_size=2"]
    assert_refused_before_spawning(tmp_path, [*common, *overrides], message)


def test_the_refusals_advice_composes(tmp_path):
    """The advice of the refusal above (data.audio=[2,5,2]) gives data the tiny model takes."""
    from tests.helpers import prepare_train

    prepare_train(["model=ltx2_tiny", "data=synthetic_text_latents", "data.num_samples=8", "data.batch_size=2",
                   "data.audio=[2,5,2]", "logger=none", f"data.cache_dir={tmp_path / 'data'}"], tmp_path / "run")


# ---- train.py: video and audio latents, previews, one process against a ring of 2 -----------------------------------

LTX2_RUN = ["model=ltx2_tiny", "data=synthetic_text_latents", "data.audio=[2,5,2]", "data.num_samples=16",
            "data.batch_size=4", "trainer.max_steps=2", "logger=csv", "scheduler=constant", "optimizer=sgd",
            "optimizer.lr=0.5", "trainer.val_check_interval=2", "callbacks.sample_grid.steps=2",
            "trainer.precision=64-true"]  # 3 x 8 x 8 = 192 video and 5 audio tokens: the audio padded at ring 2


def test_train_py_sgd_steps_on_video_and_audio_equal_one_process_at_ring_2(tmp_path):
    """train.py on synthetic latents with audio (float64): the losses of a ring of 2 equal one process's; the runs
    sample their previews (video and audio denoised together) at step 2 on the way."""
    from tests.families import assert_sgd_steps_equal_one_process_and_ring2

    assert_sgd_steps_equal_one_process_and_ring2(tmp_path, LTX2_RUN, steps=2)
