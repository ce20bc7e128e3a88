"""Sampling LTX-2's video and audio together (``SamplingPipeline.generate_joint``: the audio latents stepped beside the
video's in one state) against ``LTX2Pipeline``'s own loop: the same noise, prompt states (the pipeline's text
connectors' video and audio outputs), flow-matching Euler scheduler with LTX-2's dynamic shift, fp64 model: the same
video and audio latents."""

from __future__ import annotations

import os

import torch

from ringdit.models import parallelize
from tests.diffusers_helpers import float64_kept
from tests.helpers import architecture

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT_LEN = 6


def tiny_pipeline(reference):
    """LTX2Pipeline around ``reference`` with the tiny VAEs and text connectors of diffusers' own LTX-2 pipeline tests
    (no text encoder: prompt states are given)."""
    import diffusers
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    torch.manual_seed(0)
    connectors = LTX2TextConnectors(
        caption_channels=16, text_proj_in_factor=2, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=4, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=4, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_double_precision=False,
        causal_temporal_positioning=False, rope_type="split").double()
    vae = diffusers.AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1, patch_size_t=1,
        encoder_causal=True, decoder_causal=False).double()
    audio_vae = diffusers.AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8).double()
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(  # LTX2Pipeline's calculate_shift constants
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024, max_image_seq_len=4096)
    return diffusers.LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=None,
                                  tokenizer=None, connectors=connectors, transformer=reference, vocoder=None)


STEPS, SHAPE = 3, (3, 4, 4)  # 3 Euler steps of a 3 x 4 x 4 latent video


def models_and_pipeline():
    """(ringdit's tiny LTX-2 with the unmodified diffusers model's random weights, float64; LTX2Pipeline around that
    model)."""
    import diffusers

    from ringdit.models.diffusers import DiffusersTransformer

    torch.manual_seed(0)
    reference = diffusers.LTX2VideoTransformer3DModel.from_config(architecture("ltx2_tiny")).double()
    model = DiffusersTransformer("ltx2", config=architecture("ltx2_tiny"), input_size=SHAPE, in_channels=4,
                                 text_len=TEXT_LEN, text_dim=16)
    model.transformer.load_state_dict(reference.state_dict())
    return model.double(), tiny_pipeline(reference)


def noise_of(seeds):
    """What generate_joint draws for ``seeds``: the video's noise, then the audio's (the packed (B, 1, L, 4))."""
    from ringdit.diffusion import draw_noise, noise_generators
    from ringdit.models.diffusers.ltx2 import audio_frames

    generators = noise_generators(seeds)
    noise = draw_noise((4, *SHAPE), generators)
    return noise, draw_noise((1, audio_frames(architecture("ltx2_tiny"), SHAPE[0]), 4), generators)


def pipeline_latents(pipe, noise, audio_noise, scale: float, **prompts):
    """LTX2Pipeline's loop (its LTX-2.0 settings: no STG, no modality guidance, no rescale; guidance ``scale`` for
    the video and the audio) -> (video latents, audio latents packed (B, L, 4))."""
    with torch.no_grad(), float64_kept():
        expected, expected_audio = pipe(
            **prompts, latents=noise, audio_latents=audio_noise[:, 0], height=4 * 32, width=4 * 32,
            num_frames=(SHAPE[0] - 1) * 8 + 1, frame_rate=24.0, num_inference_steps=STEPS, guidance_scale=scale,
            stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0, audio_guidance_scale=scale, audio_stg_scale=0.0,
            audio_modality_scale=1.0, audio_guidance_rescale=0.0, spatio_temporal_guidance_blocks=None,
            use_cross_timestep=False, output_type="latent", return_dict=False)
    return expected, expected_audio.transpose(1, 2).flatten(2)  # (B, 2, L, 2) -> the packed (B, L, 4)


def ringdit_latents(model, cond: dict, seeds, scale: float):
    """``SamplingPipeline.generate_joint`` with LTX-2's flow-matching Euler scheduler and dynamic shift ->
    (video latents, {"audio": (B, 1, L, 4)})."""
    from ringdit.diffusion import FlowMatching
    from ringdit.diffusion.pipeline import SamplingPipeline
    from ringdit.parallel import ParallelDims

    pipeline = SamplingPipeline.for_run(
        FlowMatching(shift="resolution", resolution={"base_tokens": 1024, "max_tokens": 4096, "base_shift": 0.95,
                                                     "max_shift": 2.05}),
        {"sampler": "flow_euler", "steps": STEPS, "shift": "resolution", "cfg_scale": scale},
        {"image_size": list(SHAPE), "latent_scale": 1.0, "conditioning": "text"})
    with float64_kept():
        return pipeline.generate_joint(parallelize(model), cond, seeds, dims=ParallelDims(),
                                       device=torch.device("cpu"), shape=SHAPE)


def assert_equal_latents(samples, joint, expected, expected_audio, what: str) -> None:
    """The video and the audio latents within 1e-10 of the largest value (the error printed with ``-s``)."""
    for name, got, want in (("video", samples, expected), ("audio", joint["audio"][:, 0], expected_audio)):
        error = (got.double() - want.double()).abs().max() / want.abs().max()
        print(f"{what} {name}: {error.item():.3e} of the largest value")
        assert error <= 1e-10, (name, error)


def test_sampling_video_and_audio_equals_ltx2_pipelines_loop():
    """3 Euler steps of a 3 x 4 x 4 latent video (48 tokens, 17 pixel frames at 24 fps: 18 audio latent frames),
    guidance 1 (the pipeline guides in x0 space: another rounding than guiding the velocity). float64, <= 1e-10 of
    the largest value, with ``.float()`` keeping float64 on both sides: LTX2Pipeline rounds each prediction to float32
    (``noise_pred.float()``, and ringdit with it: ``PipelineTimesteps.float32_prediction``), where a 1e-16 difference
    of the two sides' attention kernels flips an element's rounding now and then (6.5e-8 of the largest value after 3
    steps, measured); kept in float64, the loops compare at float64 precision."""
    seeds = [3]
    model, pipe = models_and_pipeline()
    g = torch.Generator().manual_seed(5)
    states = torch.randn(1, TEXT_LEN, 32, generator=g, dtype=torch.float64)  # (B, L, caption_channels x 2 layers)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])  # Gemma pads on the left
    noise, audio_noise = noise_of(seeds)
    with torch.no_grad(), float64_kept():
        video_text, audio_text, text_mask = pipe.connectors(states, mask)
    expected = pipeline_latents(pipe, noise, audio_noise, 1.0, prompt_embeds=states, prompt_attention_mask=mask)
    cond = {"text": video_text, "audio_text": audio_text, "text_mask": text_mask.bool()}
    assert_equal_latents(*ringdit_latents(model, cond, seeds, 1.0), *expected, "unguided")


def test_guided_sampling_equals_ltx2_pipelines_loop_with_the_models_empty_prompt():
    """Guidance 3 (video and audio): the pipeline runs its text connectors on [negative ; prompt] and guides in x0
    space (``convert_velocity_to_x0``, the delta formulation, back to velocity); ringdit guides the velocity with the
    connectors' negative outputs as the model's empty prompt (``set_null_condition``: its ``null_audio_text`` too).
    x0 = x - sigma v is affine in v with weights that sum to one, so both are the same guidance: float64, <= 1e-10 of
    the largest value (measured 6.3e-16 / 4.1e-16), for the video and the audio latents of two prompts."""
    seeds, scale = [3, 8], 3.0
    model, pipe = models_and_pipeline()
    g = torch.Generator().manual_seed(5)
    states = torch.randn(2, TEXT_LEN, 32, generator=g, dtype=torch.float64)  # two prompts
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]])  # Gemma pads on the left
    negative = torch.randn(1, TEXT_LEN, 32, generator=g, dtype=torch.float64)  # the empty prompt's states
    negative_mask = torch.tensor([[0, 0, 0, 0, 0, 1]])
    noise, audio_noise = noise_of(seeds)
    with torch.no_grad(), float64_kept():
        video_text, audio_text, text_mask = pipe.connectors(states, mask)
        null_video, null_audio, null_mask = pipe.connectors(negative, negative_mask)
    expected = pipeline_latents(pipe, noise, audio_noise, scale, prompt_embeds=states, prompt_attention_mask=mask,
                                negative_prompt_embeds=negative.expand(2, -1, -1),
                                negative_prompt_attention_mask=negative_mask.expand(2, -1))
    model.set_null_condition({"text": null_video[0], "audio_text": null_audio[0], "text_mask": null_mask[0].bool()})
    assert torch.equal(model.null_condition(2)["audio_text"][0], null_audio[0])  # not the video's states
    cond = {"text": video_text, "audio_text": audio_text, "text_mask": text_mask.bool()}
    assert_equal_latents(*ringdit_latents(model, cond, seeds, scale), *expected, "guided")
