"""LTX-2 (``diffusers.LTX2VideoTransformer3DModel``): video and audio generated together by one transformer, run
under ringdit's plan with diffusers' weights and modules.

What the plan has to know about this model, read from its ``forward`` and ``LTX2VideoTransformerBlock``:

- Two predicted token streams of their own lengths: the video tokens (``proj_in`` of the packed VAE latents,
  ``(B, S, C)``) and the audio tokens (``audio_proj_in`` of the packed audio-VAE latents, ``(B, L, C_a * M)``: one
  token per latent audio frame, every mel bin on the channels). Every block runs self-attention over each stream
  (``attn1`` over the video, ``audio_attn1`` over the audio), cross-attention from each to its own projection of the
  text (``attn2``, ``audio_attn2``: the text is replicated, the attention local), then audio-to-video attention
  (``audio_to_video_attn``: video queries, audio keys) and video-to-audio attention (``video_to_audio_attn``: audio
  queries, video keys) between the two sharded streams: each rank's queries attend to every rank's keys of the
  other stream, gathered (``stream_cross_attention``).
- Both streams are cut at the model's input: the tokens, their RoPE coordinates (``video_coords`` ``(B, 3, S, 2)``,
  ``audio_coords`` ``(B, 1, L, 2)``: the token dim is 2) and a per-token timestep where one is given. The coordinates
  are cut rather than the rotations because the rotations' layout depends on ``rope_type`` (``(B, S, D)``
  interleaved, ``(B, H, S, D / H)`` split, LTX-2's); the model turns each rank's coordinates into its tokens'
  rotations, for self- and for the cross-modal attention (its ``cross_attn_rope`` reads the coordinates' time axis).
  The forward here always passes both coordinates and the audio timestep: left out, the model would build them from
  whole-sequence sizes, or take the (cut) video timestep for the audio.
- The video prediction is gathered at ``proj_out``, the audio prediction at ``audio_proj_out``.

Each stream has its own timestep: ``timestep`` for the video, ``audio_timestep`` for the audio (their modulation and
output scale / shift), and ``sigma`` / ``audio_sigma`` (LTX-2.3's prompt modulation). Which of them the cross-modal
attention's modulation reads is ``use_cross_timestep``: the model's docstring calls ``False`` LTX-2.0's behaviour and
``True`` the newer one, so it follows the architecture (``cross_attn_mod``, LTX-2.3's prompt modulation); with one
time for both streams, as ``LTX2Pipeline`` samples, the two agree.

Audio latents are ``(B, C_a, L, M)`` (the audio VAE's channels, latent frames and mel bins), packed to tokens as
``LTX2Pipeline._pack_audio_latents`` packs them without a patch (``audio_in_channels = C_a * M``). They are denoised
with the video (``Family.joint_latents``): training noises them at the sample's time and adds their error to the loss,
sampling steps them beside the video in ``(B, 1, L, C_a * M)`` -- the same tokens -- with L from the clip's duration
(``audio_frames``).

The cross-modal attention gathers the other stream's keys and values whole on every rank: for the video-to-audio
attention that is the whole video's (B, S, audio heads x head dim) twice per block, kept for the backward -- at 121
frames of 1080p, 32 640 tokens x 2048 x 2 bf16 x 2 per block, about 0.27 GB a block on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from ringdit.models.conditioning import AUDIO_KEY as AUDIO  # the audio latents' key, the stream's name
from ringdit.models.diffusers.family import Family, PipelineTimesteps
from ringdit.models.diffusers.ltx_video import pack_video, unpack_video
from ringdit.models.parallel_plan import TOKENS, ParallelPlan, StreamPlan

Tensor = torch.Tensor

FPS = 24  # LTX2Pipeline's frame_rate: its RoPE's time axis is in seconds at it, and its videos play at it


def pack_audio(latents: Tensor) -> Tensor:
    """(B, C, L, M) -> (B, L, C * M): one token per latent audio frame, as LTX2Pipeline packs without a patch."""
    return latents.transpose(1, 2).flatten(2, 3)


def unpack_audio(tokens: Tensor, mel_bins: int) -> Tensor:
    """The inverse of ``pack_audio``: (B, L, C * M) -> (B, C, L, M)."""
    return tokens.unflatten(2, (-1, mel_bins)).transpose(1, 2)


def ltx2_forward(transformer: nn.Module, video: Tensor, audio: Tensor, t: Tensor, audio_t: Tensor, cond: dict,
                 fps: float = FPS) -> tuple[Tensor, Tensor]:
    """Both streams' predictions: video (B, C, T, H, W) and audio (B, C_a, L, M) latents, t and audio_t (B,) model
    times in 0..1000 (sigma x 1000; the video's may be per token, (B, S)), cond: text (B, N, D) and audio_text
    (B, N, D) (the LTX-2 text connectors' video and audio prompt states; the audio's defaults to the video's) and
    text_mask (B, N) True on real tokens -> (video prediction (B, C, T, H, W), audio prediction (B, C_a, L, M))."""
    config = transformer.config
    patch, patch_t = config.patch_size, config.patch_size_t
    batch, _, frames, height, width = video.shape
    grid = (frames // patch_t, height // patch, width // patch)
    # the pipeline's coordinates (LTX2Pipeline step 6), built whole here so that the plan cuts them with the tokens
    video_coords = transformer.rope.prepare_video_coords(batch, frames, height, width, video.device, fps=fps)
    audio_coords = transformer.audio_rope.prepare_audio_coords(batch, audio.shape[2], audio.device)
    text, mask = cond["text"], cond.get("text_mask")
    # in float32, as LTX2Pipeline hands over its scheduler's timesteps: the model scales them in their own dtype (the
    # cross-modal gate's t x 1/1000) before its embeddings round them to float32
    t, audio_t = t.to(torch.float32), audio_t.to(torch.float32)
    # the sample's noise level (LTX-2.3's prompt modulation, and the cross-modal modulation's other-stream time):
    # per-token video times (an image-to-video clip's clean frames at 0) give their noisy tokens' time, as
    # LTX2ImageToVideoPipeline passes the scheduler's t
    sigma = t if t.dim() == 1 else t.amax(dim=1)
    video_out, audio_out = transformer(
        hidden_states=pack_video(video, patch, patch_t), audio_hidden_states=pack_audio(audio),
        encoder_hidden_states=text, audio_encoder_hidden_states=cond.get("audio_text", text),
        timestep=t, audio_timestep=audio_t, sigma=sigma, audio_sigma=audio_t,
        encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
        video_coords=video_coords, audio_coords=audio_coords,
        use_cross_timestep=bool(config.cross_attn_mod or config.audio_cross_attn_mod), return_dict=False,
    )
    return unpack_video(video_out, grid, patch, patch_t), unpack_audio(audio_out, audio.shape[3])


def audio_latents(cond: dict, video: Tensor, channels: int) -> Tensor:
    """``cond["audio"]`` (B, C_a, L, M), checked against the video latents (B, C, T, H, W) and the model's
    ``channels`` (audio_in_channels = C_a x M): LTX-2 denoises both."""
    audio = cond.get(AUDIO)
    if audio is None:
        raise ValueError("model.family=ltx2 generates video and audio together, but the conditioning has no 'audio' "
                         "latents (B, C_audio, L, mel bins); give the data's audio latents")
    if audio.dim() != 4 or audio.shape[0] != video.shape[0]:
        raise ValueError(f"the audio latents {tuple(audio.shape)} do not fit the video latents {tuple(video.shape)}: "
                         f"LTX-2's audio latents are (B, C_audio, L, mel bins), one per video")
    if audio.shape[1] * audio.shape[3] != channels:
        raise ValueError(f"the audio latents {tuple(audio.shape)} carry {audio.shape[1]} x {audio.shape[3]} channels "
                         f"x mel bins per frame but model.config.audio_in_channels is {channels}: encode the sound "
                         f"with the model's own audio VAE")
    return audio


def audio_frames(config: dict, latent_frames: int, fps: float = FPS) -> int:
    """The audio latent frames of a clip of ``latent_frames`` video latent frames, as LTX2Pipeline counts them: the
    clip's duration (its pixel frames, 8 per latent frame after the first, at ``fps``) times the audio latents per
    second (sampling rate / hop length / the audio VAE's temporal compression, audio_scale_factor), rounded."""
    pixel_frames = (latent_frames - 1) * config["vae_scale_factors"][0] + 1
    per_second = config["audio_sampling_rate"] / config["audio_hop_length"] / config["audio_scale_factor"]
    return round(pixel_frames / fps * per_second)


def _joint_shapes(config: dict, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The audio latents a sample of video latents ``shape`` (T, H, W) is sampled with: (1, L, audio_in_channels) --
    one channel of every channel x mel bin, which packs to the tokens (B, L, C_a * M) the model sees as (C_a, L, M)
    would; the decoder unpacks them with its own mel bins."""
    return {AUDIO: (1, audio_frames(config, shape[0]), config["audio_in_channels"])}


def _ltx2_joint_forward(transformer: nn.Module, x: Tensor, t: Tensor, cond: dict) -> tuple[Tensor, dict]:
    """x (B, C, T, H, W) video latents, t (B,) in 0..1000, cond as ``ltx2_forward``'s with the noisy audio latents at
    ``cond["audio"]`` (B, C_a, L, M) and their own time at ``cond["audio_time"]`` (B,) (default t) -> (the video
    prediction (B, C, T, H, W), {"audio": the audio prediction (B, C_a, L, M)})."""
    audio = audio_latents(cond, x, transformer.config.audio_in_channels).to(x.dtype)
    video_out, audio_out = ltx2_forward(transformer, x, audio, t, cond.get("audio_time", t), cond)
    return video_out, {AUDIO: audio_out}


LTX2 = Family(
    name="ltx2",
    model_class="LTX2VideoTransformer3DModel",
    plan=ParallelPlan(
        blocks=("transformer_blocks",),
        self_attention=("transformer_blocks.*.attn1", "transformer_blocks.*.audio_attn1"),
        cross_attention=("transformer_blocks.*.attn2", "transformer_blocks.*.audio_attn2"),  # to the text
        # video tokens (B, S, C), a per-token timestep (B, S) (a per-sample (B,) stays whole), coords (B, 3, S, 2)
        split_inputs={"": {"hidden_states": 1, "timestep": 1, "video_coords": 2}},
        gather_outputs={"proj_out": {None: 1}},  # (B, S, C)
        # audio tokens (B, L, C_a * M), their timestep, coords (B, 1, L, 2); predicted at audio_proj_out (B, L, C')
        streams={AUDIO: StreamPlan(inputs={"": {"audio_hidden_states": 1, "audio_timestep": 1, "audio_coords": 2}},
                                   gather={"audio_proj_out": {None: 1}})},
        attention_streams={"transformer_blocks.*.audio_attn1": (AUDIO,)},
        stream_cross_attention={"transformer_blocks.*.audio_to_video_attn": AUDIO,  # video queries, audio keys
                                "transformer_blocks.*.video_to_audio_attn": TOKENS},  # audio queries, video keys
    ),
    forward=_ltx2_joint_forward,
    joint_latents=(AUDIO,),  # the sound: noised with the video, predicted, in the loss, sampled with it
    joint_shapes=_joint_shapes,
    # its audio tokens, one per latent audio frame of the clip's duration: a sequence of their own, cut over the ranks
    # (audio_attn1) and attended from the video's (audio_to_video_attn); the grid's T is latent frames (patch_size_t 1)
    stream_tokens=lambda config, grid: {AUDIO: audio_frames(config, grid[0] * config["patch_size_t"])},
    video=True,
    vae_factors=(8, 32),  # LTX-2's video VAE (the transformer's vae_scale_factors)
    fps=FPS,
    clip_frames=121,  # LTX2Pipeline's num_frames
    condition_keys=("text", "text_mask", "audio_text", AUDIO, "audio_time"),
    text_dim="caption_channels",
    text_connectors="gemma3",  # LTX2Pipeline: Gemma3ForConditionalGeneration's states through its LTX2TextConnectors
    latent_channels=lambda config: config["in_channels"] // (config["patch_size_t"] * config["patch_size"] ** 2),
    patch_shape=lambda config: (config["patch_size_t"], config["patch_size"], config["patch_size"]),
    # LTX2Pipeline's calculate_shift defaults (its scheduler config's, read with these fallbacks)
    resolution_shift={"base_tokens": 1024, "max_tokens": 4096, "base_shift": 0.95, "max_shift": 2.05},
    # LTX2Pipeline: sigmas linspace(1, 1 / steps, steps); it steps the scheduler on noise_pred.float()
    pipeline_timesteps=PipelineTimesteps(sigmas="to_last", float32_prediction=True),
)
