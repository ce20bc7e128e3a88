"""Sampling MiniMax-H3's video and audio together (``SamplingPipeline.generate_joint`` with ``sampler=minimax_h3``:
diffusers' ``MiniMaxH3Scheduler`` for the video at ``shift`` and one for the audio at ``joint_shift``) against its
modular pipeline's own blocks -- ``MiniMaxH3SetTimestepsStep`` (the two schedules, the per-row timestep plan) and
``MiniMaxH3DenoiseStep`` (the transformer on the packed rows, the prediction rounded to float32, each stream's
scheduler step) --, the transformer in float64, for the same noise and prompt states: the same video and audio
latents, as the released pipeline samples them (video at shift 12, audio at 3). The latents are float32 on both sides,
as the pipeline keeps them (its prepare step casts the noise to float32, its scheduler steps in the latents' dtype)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from ringdit.models import parallelize
from ringdit.models.diffusers.minimax_h3 import audio_frames, packed_layout
from tests.helpers import architecture

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT_LEN, SHIFT, AUDIO_SHIFT = 5, 12.0, 3.0


def pipeline_loop(transformer, noise, audio_noise, text, steps: int, shape: tuple[int, ...], audio_len: int):
    """The modular pipeline's timesteps and denoise blocks run on the packed rows of ``noise`` (1, C, T, H, W) and
    ``audio_noise`` (1, 2, L, C_a) -> (video latents (1, C, T, H, W), audio latents (1, 2, L, C_a))."""
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines import PipelineState
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (MiniMaxH3SetTimestepsStep,
                                                                       patchify_video_latents)
    from diffusers.modular_pipelines.minimax_h3.denoise import MiniMaxH3DenoiseStep

    layout = packed_layout(TEXT_LEN, shape, audio_len, (1, 2, 2))
    components = SimpleNamespace(transformer=transformer, scheduler=MiniMaxH3Scheduler(shift=SHIFT),
                                 audio_scheduler=MiniMaxH3Scheduler(shift=AUDIO_SHIFT),
                                 _execution_device=torch.device("cpu"), keyframe_noise_aug=0.0)
    state = PipelineState()
    for key, value in {"num_inference_steps": steps + 1, "num_condition_video_rows": 0, "num_condition_audio_rows": 0,
                       "latents": patchify_video_latents(noise, (1, 2, 2)),  # (12, 16) rows
                       "audio_latents": audio_noise.reshape(2 * audio_len, -1).clone(),  # channel-major rows (stepped in place)
                       "prompt_embeds": text, **{key: layout[key] for key in ("video_indices", "audio_indices",
                                                                               "text_indices")}}.items():
        state.set(key, value)
    for key, value in layout.items():  # what the transformer reads by name
        state.set(key, value, "denoiser_input_fields")
    components, state = MiniMaxH3SetTimestepsStep()(components, state)
    components, state = MiniMaxH3DenoiseStep()(components, state)
    video = state.get("latents").reshape(1, 2, 2, 3, 4, 1, 2, 2).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return video.reshape(1, 4, *shape), state.get("audio_latents").reshape(1, 2, audio_len, -1)


def test_sampling_video_and_audio_equals_the_pipelines_loop():
    """3 steps (4 sigmas, the terminal 0 among them) of a 2 x 4 x 6 latent video (12 rows) with its 2 x L audio
    rows: ringdit's sampler=minimax_h3 at shift 12, audio at joint_shift 3, and the pipeline's blocks."""
    import diffusers

    from ringdit.diffusion import FlowMatching, draw_noise, noise_generators
    from ringdit.diffusion.pipeline import SamplingPipeline
    from ringdit.models.diffusers import DiffusersTransformer
    from ringdit.parallel import ParallelDims

    steps, seeds, shape = 3, [3], (2, 4, 6)
    config = architecture("minimax_h3_tiny")
    torch.manual_seed(0)
    reference = diffusers.MiniMaxH3Transformer3DModel.from_config(config).double()
    model = DiffusersTransformer("minimax_h3", config=config, input_size=shape, in_channels=4, text_len=TEXT_LEN,
                                 text_dim=16, condition_dropout_prob=0.0)
    model.transformer.load_state_dict(reference.state_dict())
    text = torch.randn(1, TEXT_LEN, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    audio_len = audio_frames(shape[0])
    generators = noise_generators(seeds)
    noise = draw_noise((4, *shape), generators)  # what generate_joint draws: the video's, then the audio's (float32,
    audio_noise = draw_noise((2, audio_len, 8), generators)  # as the pipeline's latents are)
    expected, expected_audio = pipeline_loop(reference, noise, audio_noise, text, steps, shape, audio_len)

    settings = {"sampler": "minimax_h3", "steps": steps, "shift": SHIFT, "joint_shift": {"audio": AUDIO_SHIFT},
                "cfg_scale": 1.0}
    pipeline = SamplingPipeline.for_run(FlowMatching(shift=SHIFT), settings,
                                        {"image_size": list(shape), "latent_scale": 1.0, "conditioning": "text"})
    model = parallelize(model.double())
    samples, joint = pipeline.generate_joint(model, {"text": text}, seeds, dims=ParallelDims(),
                                             device=torch.device("cpu"), shape=shape)
    for name, got, want, start in (("video", samples, expected, noise), ("audio", joint["audio"], expected_audio,
                                                                          audio_noise)):
        scale = want.abs().max()
        assert (want - start).abs().max() > 0.3 * scale, name  # the loop moved the latents well away from the noise
        assert got.dtype == want.dtype == torch.float32, name
        assert (got.double() - want.double()).abs().max() <= 1e-10 * scale, (name, (got - want).abs().max() / scale)
    # the audio's own shift matters: at the video's shift the audio differs
    pipeline.settings["joint_shift"] = None
    _, same_shift = pipeline.generate_joint(model, {"text": text}, seeds, dims=ParallelDims(),
                                            device=torch.device("cpu"), shape=shape)
    assert (same_shift["audio"] - expected_audio).abs().max() > 1e-3 * expected_audio.abs().max()
