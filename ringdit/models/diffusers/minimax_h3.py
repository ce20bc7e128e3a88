"""MiniMax-H3 (``diffusers.MiniMaxH3Transformer3DModel``, the 33 B joint video + audio model): video, audio and text
packed into ONE sequence that every block attends over, run under ringdit's plan with diffusers' weights and modules.

What the plan has to know about this model, read from its ``forward`` and ``MiniMaxH3TransformerBlock``:

- The three streams enter through their own projections (``proj_in``, ``audio_proj_in``, ``context_embedder`` and
  the text's ``token_refiner``, which attends over the text alone) and are then scattered into one packed buffer by
  sequence-wide indices (``text_indices``, ``audio_indices``, ``video_indices``); every later row carries its own
  stream's facts with it: its modality tag and timestep index (one AdaLN row per (timestep, modality),
  ``adaln_indices``), its ``(t, h, w)`` rotary position. Blocks treat all rows alike (one set of weights, full
  self-attention over the whole packed document, no mask), so the packed sequence is what the ranks split: it is cut
  where it first exists, at ``transformer_blocks.0``, and everything indexed per row is cut with it -- every block's
  ``adaln_indices``, the rotations ``rope`` makes from the position ids, ``norm_out``'s ``timestep_indices`` --, tail
  padding masked by ring / Ulysses as for any token sequence. Each rank then holds whole rows of whatever streams fall
  in its chunk, each row with its own tag, position and timestep: a row's stream is data carried with it, not a place
  in the chunk. The layout balances the ranks to one row (a cut per stream would pad each stream on its own: up to
  three tails instead of one), and it is the layout diffusers' own ``_cp_plan`` for this class uses.
- The prediction heads (``proj_out``, ``audio_proj_out``) run over every row; both are gathered whole, and the
  model's forward then selects each stream's rows with its sequence-wide indices.
- The token refiner runs whole on every rank (its attention over the prompt alone, a few hundred rows: not planned).

The packed layout is MiniMax-H3's ``t2va`` one, built by diffusers' own ``build_packed_sequence``: ``[text | audio |
video]``, text on the time axis at its row index, the stereo audio channel-major on the video's clock, the video's
frames at the VAE's 17 / 5 frame rhythm. Conventions of the released model (``MiniMaxH3Scheduler``): its timestep is
``1 - sigma`` (1 = clean) and it predicts the data-ward velocity ``x0 - noise``; ringdit's flow objective uses
``sigma`` x 1000 and ``noise - x0``, so the forward here converts both ways. The model is guidance-distilled (its
pipeline runs no unconditional pass). Its pipeline samples with ``MiniMaxH3Scheduler`` (``sampler=minimax_h3``), the
audio on a schedule of its own (``diffusion.sampling.joint_shift={audio: 3.0}`` beside the video's ``shift=12``).

The audio is denoised with the video (``joint_latents``): training noises it at the sample's time (or its own,
``audio_time``) and adds its error to the loss. Audio latents are ``(B, 2, L, C_a)``: the mono audio VAE's latents
(``C_a`` = audio_in_channels, ``L`` latent frames at 40 per second) of the two stereo channels, packed channel-major
into ``2 L`` rows as the pipeline packs them.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ringdit.models.conditioning import AUDIO_KEY as AUDIO  # the soundtrack's latents (B, 2, L, C_a)
from ringdit.models.diffusers.family import ChatTemplate, Family, PipelineTimesteps
from ringdit.models.parallel_plan import ParallelPlan

Tensor = torch.Tensor

AUDIO_TIME = "audio_time"  # the audio's model time (B,) in 0..1000, sigma x 1000; absent: the video's
STEREO = 2  # MINIMAX_H3_AUDIO_CHANNELS: the soundtrack's channels, packed channel-major
AUDIO_RATE = 40  # MINIMAX_H3_AUDIO_LATENTS_PER_SECOND: its audio VAE's latents a second (32 kHz / 800)
VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2  # the modality tags of the packed rows (the model's AdaLN table order)
FPS = 24  # MINIMAX_H3_FPS: its videos play at it, and its rotary time axis counts at it


@functools.lru_cache(maxsize=16)
def packed_layout(text_len: int, grid: tuple[int, int, int], audio_len: int, patch: tuple[int, int, int]
                  ) -> dict[str, Tensor]:
    """The ``t2va`` packed layout of ``text_len`` text rows, ``grid`` (T, H, W) latents and ``audio_len`` audio latents
    per stereo channel, as the pipeline builds it: position_ids (S, 3) float64, token_tags (S,), video_indices,
    audio_indices, text_indices. Cached: a run packs a handful of shapes, every step."""
    # start-up time: diffusers' modular pipelines import peft, transformers and torchao (~1000 modules, seconds), and
    # the families' registry imports this module at every command's start
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep  # its t2va packing

    frames, height, width = grid
    tags = torch.full((text_len,), TEXT_TAG, dtype=torch.long)
    positions, tags, video, audio, text, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        tags, frames, height, width, audio_len, patch, STEREO, AUDIO_TAG, VIDEO_TAG)
    return {"position_ids": positions, "token_tags": tags, "video_indices": video, "audio_indices": audio,
            "text_indices": text}


def patchify(latents: Tensor, patch: tuple[int, int, int]) -> Tensor:
    """(B, C, T, H, W) -> (B, N, C * pt * ph * pw): rows frame-major then row-major, as the pipeline packs them."""
    batch, channels, frames, height, width = latents.shape
    pt, ph, pw = patch
    rows = latents.reshape(batch, channels, frames // pt, pt, height // ph, ph, width // pw, pw)
    return rows.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(batch, -1, channels * pt * ph * pw)


def unpatchify(rows: Tensor, shape: tuple[int, ...], patch: tuple[int, int, int]) -> Tensor:
    """The inverse of ``patchify``: (B, N, C * pt * ph * pw) -> (B, C, T, H, W) of latents ``shape`` (C, T, H, W)."""
    channels, frames, height, width = shape
    pt, ph, pw = patch
    cells = rows.reshape(rows.shape[0], frames // pt, height // ph, width // pw, channels, pt, ph, pw)
    return cells.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(rows.shape[0], channels, frames, height, width)


def audio_rows(audio: Tensor) -> Tensor:
    """(B, 2, L, C_a) -> (B, 2 L, C_a): channel-major rows."""
    return audio.flatten(1, 2)


def rows_to_audio(rows: Tensor) -> Tensor:
    """The inverse of ``audio_rows``: (B, 2 L, C_a) -> (B, 2, L, C_a)."""
    return rows.unflatten(1, (STEREO, -1))


def real_tokens_first(text: Tensor, mask: Tensor) -> Tensor:
    """text (B, L, D) and mask (B, L) True on real tokens -> (B, L', D): each prompt's real tokens first, in order, then
    zeros, cut to the longest prompt's L' tokens."""
    mask = mask.bool()
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # (B, L): real positions first, in order
    packed = text.gather(1, order[..., None].expand_as(text)) * mask.gather(1, order)[..., None].to(text.dtype)
    return packed[:, : max(int(mask.sum(dim=1).max()), 1)]


def soundtrack(cond: dict, video: Tensor, channels: int) -> Tensor:
    """``cond["audio"]`` (B, 2, L, C_a), checked against the video latents (B, C, T, H, W) and the model's
    audio_in_channels: MiniMax-H3 generates video and sound together."""
    audio = cond.get(AUDIO)
    if audio is None:
        raise ValueError("model.family=minimax_h3 packs video, audio and text into one sequence, but the conditioning "
                         "has no 'audio' latents (B, 2, L, audio_in_channels); give the data's audio latents")
    if audio.dim() != 4 or audio.shape[0] != video.shape[0] or audio.shape[1] != STEREO:
        raise ValueError(f"the audio latents {tuple(audio.shape)} do not fit the video latents {tuple(video.shape)}: "
                         f"MiniMax-H3's are (B, 2, L, audio_in_channels), both stereo channels of one clip's sound")
    if audio.shape[3] != channels:
        raise ValueError(f"the audio latents have {audio.shape[3]} channels but model.config.audio_in_channels is "
                         f"{channels}: encode the sound with the model's audio VAE")
    return audio


def audio_frames(latent_frames: int) -> int:
    """The audio latents (per stereo channel) of a clip of ``latent_frames`` video latents, as the pipeline sizes them:
    its VAE's 17 n + 5 pixel frames per 5 n + 2 latent frames (another count: 17 / 5 frames each), 40 audio latents a
    second at 24 fps (``audio_latent_num_frames``)."""
    chunks, rest = divmod(latent_frames - 2, 5)
    frames = 17 * chunks + 5 if rest == 0 and chunks >= 0 else round(latent_frames * 17 / 5)
    return max(1, round(frames / FPS * AUDIO_RATE))


def _joint_shapes(config: dict, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The audio latents a sample of video latents ``shape`` (T, H, W) is sampled with: (2, L, audio_in_channels)."""
    return {AUDIO: (STEREO, audio_frames(shape[0]), config["audio_in_channels"])}


def minimax_h3_forward(transformer: nn.Module, video: Tensor, audio: Tensor, t: Tensor, audio_t: Tensor,
                       text: Tensor, text_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Both streams' predictions in ringdit's flow convention (``noise - x0``): video (B, C, T, H, W) and audio
    (B, 2, L, C_a) latents, t and audio_t (B,) model times in 0..1000 (sigma x 1000), text (B, L_text, D) with an
    optional text_mask (B, L_text) True on real tokens -> (video (B, C, T, H, W), audio (B, 2, L, C_a)).

    The model's structural inputs (timesteps, tags, positions, indices) describe one layout that all samples of a
    call share, so each sample is its own call, its text rows at its video's timestep (the pipeline's rule). The model
    takes no text mask, and the pipeline packs a prompt without padding: the text is cut to the batch's longest
    prompt, every prompt's real tokens first (one sample a batch: exactly its own tokens). All calls of a batch then
    pack as many rows, which the plan's record of the sequence (kept for recomputation in backward) needs."""
    patch = tuple(transformer.config.patch_size)
    video_rows, sound_rows = patchify(video, patch), audio_rows(audio)
    prompts = text if text_mask is None else real_tokens_first(text, text_mask)  # (B, L', D)
    layout = {key: value.to(video.device) for key, value in
              packed_layout(prompts.shape[1], tuple(video.shape[2:]), audio.shape[2], patch).items()}
    video_out, audio_out = [], []
    for i in range(video.shape[0]):
        # the model's timestep: 1 - sigma per row (text and video at the video's, audio at its own), as its
        # (distinct sorted values, index per row) pair
        rows = torch.full(layout["token_tags"].shape, 1 - float(t[i]) / 1000, dtype=torch.float64, device=video.device)
        rows[layout["audio_indices"]] = 1 - float(audio_t[i]) / 1000
        timestep, timestep_indices = torch.unique(rows, sorted=True, return_inverse=True)
        v_video, v_audio = transformer(
            hidden_states=video_rows[i : i + 1], audio_hidden_states=sound_rows[i : i + 1],
            encoder_hidden_states=prompts[i : i + 1], timestep=timestep.to(video.dtype),
            timestep_indices=timestep_indices, return_dict=False, **layout)
        video_out.append(-v_video)  # its data-ward velocity x0 - noise, negated
        audio_out.append(-v_audio)
    return (unpatchify(torch.cat(video_out), video.shape[1:], patch), rows_to_audio(torch.cat(audio_out)))


def _minimax_h3_joint_forward(transformer: nn.Module, x: Tensor, t: Tensor, cond: dict) -> tuple[Tensor, dict]:
    """x (B, C, T, H, W) video latents, t (B,) in 0..1000, cond: text (B, L, D) [, text_mask (B, L)], audio
    (B, 2, L_a, C_a) the noisy soundtrack's latents at model time ``cond["audio_time"]`` (B,) (default t) -> (the video
    prediction (B, C, T, H, W), {"audio": the audio prediction (B, 2, L_a, C_a)})."""
    audio = soundtrack(cond, x, transformer.config.audio_in_channels).to(x.dtype)
    video, sound = minimax_h3_forward(transformer, x, audio, t, cond.get(AUDIO_TIME, t), cond["text"],
                                      cond.get("text_mask"))
    return video, {AUDIO: sound}


def _chat_template() -> ChatTemplate:
    """MiniMaxH3ModularPipeline's ``t2va`` prompt encoding (MiniMaxH3TextEncoderStep): the prompt verbatim -- no chat
    template, no special tokens, no system message -- through Qwen3-VL, its hidden states after decoder layer
    ``text_encoder_layer`` (50, read from the pipeline), every real token kept (prepare pads a batch to max_len: the
    states after the real tokens zeroed and text_mask marking them, which the forward drops)."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline

    layer = int(MiniMaxH3ModularPipeline.text_encoder_layer.fget(None))  # a constant property: 50
    return ChatTemplate("minimax_h3", "", 0, (layer,), masked=True, generation_prompt=False,
                        model_types=("qwen3_vl",), text="{}")


MINIMAX_H3 = Family(
    name="minimax_h3",
    model_class="MiniMaxH3Transformer3DModel",
    plan=ParallelPlan(
        blocks=("transformer_blocks", "token_refiner.refiner_blocks"),
        self_attention=("transformer_blocks.*.attn",),  # the refiner's attention (text only) runs whole: unplanned
        # the packed rows (B, S, D) where the blocks start, and what is indexed per row: every block's adaln_indices
        # (S,) (each block reads the forward's whole copy) and norm_out's timestep_indices (S,), positionally passed
        split_inputs={"transformer_blocks.0": {0: 1}, "transformer_blocks.*": {2: 0}, "norm_out": {2: 0}},
        split_outputs={"rope": {0: 0, 1: 0}},  # (cos, sin), each (S, rotary dims): every row's own rotation
        gather_outputs={"proj_out": {None: 1}, "audio_proj_out": {None: 1}},  # (B, S, C): both heads, every row
        forward_packed=(AUDIO,),  # its audio rows are in the packed sequence the blocks take (stream_tokens counts them)
    ),
    forward=_minimax_h3_joint_forward,
    # its loop steps MiniMaxH3Scheduler (sampler=minimax_h3) on the prediction rounded to float32 (``.float()``)
    scheduler="MiniMaxH3Scheduler",
    pipeline_timesteps=PipelineTimesteps(float32_prediction=True),
    joint_latents=(AUDIO,),  # the sound: noised with the video, predicted, in the loss
    audio_frame=lambda config: (STEREO, config["audio_in_channels"]),  # one latent frame: (2, C_a)
    audio_latent_rate=AUDIO_RATE,  # prepared sound of another rate is refused (data_checks.check_audio_latent_rate)
    joint_shapes=_joint_shapes,
    # its audio rows, both stereo channels' latent frames, packed with the video's into the one sequence the ranks split
    # (the text's rows too, which the planner does not count); the grid's T is in temporal patches
    stream_tokens=lambda config, grid: {AUDIO: STEREO * audio_frames(grid[0] * config["patch_size"][0])},
    video=True,
    # its VAE: 16x spatial; in time 17 n + 5 frames -> 5 n + 2 latents, which no one factor describes: the planner
    # lays it out in latent cells (data.latent=false data.frames=<latent frames>; 243 frames are 72)
    vae_factors=(4, 16),
    fps=FPS,
    condition_keys=("text", "text_mask", AUDIO, AUDIO_TIME),
    chat_template=_chat_template,  # prompt_template=minimax_h3: Qwen3-VL's hidden_states[50] of the bare prompt
    text_dim="text_dim",
    patch_shape=lambda config: tuple(config["patch_size"]),
    # DiffSynth-Studio's MiniMax-H3 LoRA scripts (examples/minimax_h3/model_training/lora/MiniMax-H3-FL2VA.sh:
    # lora_target_modules attn.qkv_proj, attn.out_proj, mlp.fc1, mlp.fc2): every attention projection and both
    # SwiGLU layers, by diffusers' names (the token refiner's blocks match too)
    lora_targets=("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"),
)
