"""Training MiniMax-H3 (video and stereo audio denoised together, ``Family.joint_latents``): DiffusionModule's loss is
the video's mean squared flow-matching error plus the audio's, both noised at the sample's time, through the
unmodified diffusers model on the pipeline's packing; SGD steps through that loss at ring 2 under DDP, at Ulysses 2
under FSDP and with LoRA at ring 2 equal one process (in the ranks); train.py's SGD steps in float64 on synthetic
data with audio latents equal one process at ring 2; data without the audio latents are refused before anything is
built, and the refusal's advice trains."""

from __future__ import annotations

import os

import pytest
import torch

from ringdit.models.diffusers.minimax_h3 import packed_layout
from tests.diffusers_helpers import check_sgd_layouts, joint_loss_draws, video_audio_batch
from tests.distributed import run_ranks
from tests.helpers import architecture, assert_same_numbers, logged_losses, run

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE, AUDIO_SHAPE, TEXT_LEN = (3, 2, 6), (2, 3, 8), 7  # 9 video, 6 audio and up to 7 text rows: 22 or fewer
MODEL = {"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "minimax_h3",
         "config": architecture("minimax_h3_tiny"), "input_size": list(SHAPE), "in_channels": 4,
         "text_len": TEXT_LEN, "text_dim": 16, "condition_dropout_prob": 0.5}  # half the samples drop their prompt
STEPS, LR = 2, 0.5


def module_and_batch():
    return video_audio_batch(SHAPE, AUDIO_SHAPE, TEXT_LEN)


def test_the_loss_is_the_video_and_the_audio_flow_matching_errors_through_the_unmodified_model():
    """One process, float64: the module's loss equals the sum of the two mean squared errors computed here with the
    diffusers model called directly on the pipeline's packing of the same draws (the sample's time, the video's
    noise, then the audio's): timestep 1 - sigma, the velocities pointing to the data."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    loss, reference, x0, cond, t, noise, audio_noise, x_t, audio_t = joint_loss_draws(
        MODEL, "MiniMaxH3Transformer3DModel", "minimax_h3_tiny", module_and_batch, 9)
    video_errors, audio_errors = [], []
    layout = packed_layout(TEXT_LEN, SHAPE, 3, (1, 2, 2))  # the batch's longest prompt: 7 rows, the first's last 2 0
    for i in range(2):
        timestep = torch.tensor([1 - t[i].item()], dtype=torch.float64)  # every row at the sample's time
        indices = torch.zeros(layout["token_tags"].shape, dtype=torch.long)
        with torch.no_grad():
            v_video, v_audio = reference(patchify_video_latents(x_t[i : i + 1], (1, 2, 2))[None],
                                         audio_t[i : i + 1].reshape(1, 6, 8),
                                         (cond["text"][i] * cond["text_mask"][i, :, None])[None], timestep, indices,
                                         return_dict=False, **layout)
        video = -v_video.reshape(1, 3, 1, 3, 4, 2, 2).permute(0, 4, 1, 2, 5, 3, 6).reshape(1, 4, *SHAPE)
        video_errors.append((video - (noise[i] - x0[i])) ** 2)
        audio_errors.append((-v_audio.reshape(1, *AUDIO_SHAPE) - (audio_noise[i] - cond["audio"][i])) ** 2)
    expected = torch.cat(video_errors).mean() + torch.cat(audio_errors).mean()
    # diffusion_loss squares the errors in float32 (as it trains): the same sum up to float32 rounding
    assert_same_numbers(loss.detach(), expected, of_max=1e-6, where="joint loss")


def refiner_swiglu_and_audio_train(name, kind, weights):
    if kind == "lora":  # DiffSynth's targets, attention and SwiGLU, the refiner's too
        assert any(".token_refiner." in key for key in weights), sorted(weights)[:3]
        assert any(".ff.net.0.proj." in key for key in weights) and any(".ff.net.2." in key for key in weights)
    else:  # the audio head trains: the audio's error reaches it
        assert "transformer.audio_proj_out.weight" in weights, name


def check_training(rank, world):
    check_sgd_layouts(world, MODEL, module_and_batch, STEPS, LR, check=refiner_swiglu_and_audio_train)


def test_minimax_h3_sgd_steps_equal_one_process_under_ddp_fsdp_and_lora():
    run_ranks(check_training, 2)


TRAIN = ["model=minimax_h3_tiny", "data=synthetic_text_latents", "data.audio=[2,3,8]", "data.num_samples=8",
         "data.batch_size=2", "data.frames=3", "data.size=6", "trainer.max_steps=2", "logger=csv",
         "scheduler=constant", "optimizer=sgd", "optimizer.lr=0.5", "trainer.val_check_interval=2",
         "trainer.precision=64-true", "callbacks.sample_grid.steps=2"]


def test_train_py_sgd_steps_in_float64_equal_one_process_at_ring_2(tmp_path):
    """train.py on synthetic data with audio latents (a tone per prompt), float64: the losses of 2 SGD steps and the
    trained weights at ring 2 equal one process's to float64 rounding (a layout reorders sums only). The packed
    sequences hold 27 video, 6 audio and the batch's longest prompt's text rows (3 to 8): odd counts are tail-padded."""
    from ringdit.checkpoints.weights import read_weights

    data = [f"data.cache_dir={tmp_path / 'data'}"]
    for name, layout in (("ring1", []), ("ring2", ["ring_degree=2"])):
        run("train.py", tmp_path / name, *TRAIN, *data, *layout, env={"HF_HUB_OFFLINE": "1"})
    reference, parallel = logged_losses(tmp_path / "ring1"), logged_losses(tmp_path / "ring2")
    assert sorted(reference) == sorted(parallel) == [0, 1]
    for step in reference:
        assert parallel[step] == pytest.approx(reference[step], rel=1e-12), f"step {step}"
    ref_weights, weights = ({key: value for key, value in read_weights(tmp_path / name / "checkpoints" / "last.ckpt",
                                                                      prefer="model")[0].items()
                             if value.is_floating_point()} for name in ("ring1", "ring2"))
    assert any("audio_proj_out" in key for key in ref_weights), sorted(ref_weights)[:5]
    largest = max(value.abs().max() for value in ref_weights.values())
    assert_same_numbers(weights, ref_weights, atol=1e-12 * largest, where="ring 2 weights")


@pytest.mark.parametrize(("overrides", "message"), [
    (["model=minimax_h3_tiny"], "model.family=minimax_h3 generates video and audio together, but the data has no "
                                "'audio' latents .* e.g. data=synthetic_text_latents data.audio=\\[2,5,8\\]"),
], ids=["video without audio"])
def test_audio_data_that_do_not_fit_the_model_are_refused_before_anything_is_built(overrides, message, tmp_path):
    from tests.families import assert_refused_before_spawning

    common = ["data=synthetic_text_latents", "data.num_samples=8", "data.batch_size=2"]
    assert_refused_before_spawning(tmp_path, [*common, *overrides], message)


def test_the_refusals_advice_composes(tmp_path):
    """The advice of the refusal above (data.audio=[2,5,8]) gives data the tiny model takes."""
    from tests.helpers import prepare_train

    prepare_train(["model=minimax_h3_tiny", "data=synthetic_text_latents", "data.num_samples=8", "data.batch_size=2",
                   "data.audio=[2,5,8]", "logger=none", f"data.cache_dir={tmp_path / 'data'}"], tmp_path / "run")


def test_a_ulysses_degree_above_the_heads_is_refused_and_its_advice_composes(tmp_path):
    """The tiny model's 2 heads cannot be placed on 4 Ulysses ranks (a rank would hold none): one line before any
    rank starts, with degrees on the same 4 ranks; that advice composes. (A degree that does not divide the heads is
    placed unevenly: tests/test_minimax_h3.py's 7 heads over 2 and 4 ranks.)"""
    from tests.families import assert_refused_before_spawning
    from tests.helpers import prepare_train

    common = ["model=minimax_h3_tiny", "data=synthetic_text_latents", "data.audio=[2,3,8]", "data.num_samples=8",
              "data.batch_size=2", "logger=none"]
    message = (r"ulysses_degree=4 is more than the model's num_heads=2: .* use ulysses_degree=2 with ring_degree "
               r"multiplied by 2 \(the same ranks\)")
    assert_refused_before_spawning(tmp_path / "refused", [*common, "ulysses_degree=4"], message)
    prepare_train([*common, "ring_degree=2", "ulysses_degree=2", f"data.cache_dir={tmp_path / 'data'}"],
                  tmp_path / "run")
