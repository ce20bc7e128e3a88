"""Sampling MiniMax-H3's video and audio together (``SamplingPipeline.generate_joint`` with the flow-matching Euler
sampler, the audio stepped beside the video) against the loop of its modular pipeline (``MiniMaxH3LoopDenoiser`` +
``MiniMaxH3LoopSchedulerStep``: diffusers' ``MiniMaxH3Scheduler`` for the video and for the audio, the transformer
called on the packed rows with the per-row timestep plan), float64, for the same noise and prompt states: the same
video and audio latents.

Two things of the released pipeline the sampler does not do, said here so that the comparison is read right: its
audio scheduler shifts by 3.0 where the video's shifts by 12.0 (ringdit steps both streams at the same times: the
reference loop here runs both of its schedulers at one shift), and its schedulers keep their sigmas in float32
(ringdit's times are float64): the two loops then differ by that rounding, 1.1e-8 (video) and 2.4e-8 (audio) of the
largest value after 3 steps (measured; the samples are 0.47 and 0.67 of it away from their noise)."""

from __future__ import annotations

import os

import torch

from ringdit.models import parallelize
from ringdit.models.diffusers.minimax_h3 import audio_frames, packed_layout
from tests.helpers import architecture

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT_LEN, SHIFT = 5, 12.0


def test_sampling_video_and_audio_equals_the_pipelines_scheduler_loop():
    """3 steps (4 sigmas, the terminal 0 among them) of a 2 x 4 x 6 latent video (12 rows) with its 2 x L audio
    rows: ringdit's flow Euler at shift 12 and the pipeline's MiniMaxH3Scheduler at shift 12, video and audio."""
    import diffusers
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (MiniMaxH3SetTimestepsStep,
                                                                       patchify_video_latents)

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
    noise = draw_noise((4, *shape), generators).double()  # what generate_joint draws: the video's, then the audio's
    audio_noise = draw_noise((2, audio_len, 8), generators).double()

    # the pipeline's loop: its layout, row timestep plan, transformer call and the two schedulers' steps
    layout = packed_layout(TEXT_LEN, shape, audio_len, (1, 2, 2))
    video_scheduler, audio_scheduler = MiniMaxH3Scheduler(shift=SHIFT), MiniMaxH3Scheduler(shift=SHIFT)
    video_scheduler.set_timesteps(steps + 1)
    audio_scheduler.set_timesteps(steps + 1)
    latents = patchify_video_latents(noise, (1, 2, 2))  # (12, 16) rows
    audio_latents = audio_noise.reshape(2 * audio_len, 8)  # channel-major rows
    with torch.no_grad():
        for t, audio_t in zip(video_scheduler.timesteps, audio_scheduler.timesteps):
            timestep, indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
                layout["video_indices"], layout["audio_indices"], 0, 0, TEXT_LEN, float(t), float(audio_t), 1.0,
                1.0)
            v_video, v_audio = reference(latents[None], audio_latents[None], text, timestep.double(), indices,
                                         return_dict=False, **layout)
            latents = video_scheduler.step(v_video[0], t, latents, return_dict=False)[0]
            audio_latents = audio_scheduler.step(v_audio[0], audio_t, audio_latents, return_dict=False)[0]
    expected = latents.reshape(1, 2, 2, 3, 4, 1, 2, 2).permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(1, 4, *shape)
    expected_audio = audio_latents.reshape(1, 2, audio_len, 8)

    pipeline = SamplingPipeline.for_run(FlowMatching(shift=SHIFT),
                                        {"sampler": "euler", "steps": steps, "shift": SHIFT, "cfg_scale": 1.0},
                                        {"image_size": list(shape), "latent_scale": 1.0, "conditioning": "text"})
    model = parallelize(model.double())
    samples, joint = pipeline.generate_joint(model, {"text": text}, seeds, dims=ParallelDims(),
                                             device=torch.device("cpu"), shape=shape)
    for name, got, want in (("video", samples, expected), ("audio", joint["audio"], expected_audio)):
        scale = want.abs().max()
        # the schedulers' float32 sigmas against ringdit's float64 times (see the module's docstring)
        assert (got.double() - want).abs().max() <= 1e-7 * scale, (name, (got - want).abs().max() / scale)
