"""LTX-2 (diffusers' LTX2VideoTransformer3DModel, unmodified: video and audio streams, their self-attention, text
cross-attention, audio-to-video and video-to-audio attention between the two sharded streams) under ringdit's plan,
in float64: the same numbers as the model called directly on one process -- both predictions and every parameter
gradient -- on one process and on 4 gloo CPU ranks under ring 2, ring 4, Ulysses 2 and 2 x 2. The video tokens
(3 x 3 x 3 = 27), the audio tokens (5) and the text (7, one sample's last 3 masked) are tail-padded on every layout;
the video's timestep is per token (the first latent frame clean, as LTX-2's image-to-video samples), the audio's its
own per sample."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from ringdit.models import parallelize
from ringdit.models.diffusers.ltx2 import LTX2, ltx2_forward
from ringdit.parallel import init_sequence_parallel
from tests.diffusers_helpers import LAYOUTS, ddp_average
from tests.distributed import run_ranks
from tests.helpers import architecture, assert_same_numbers

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = (3, 3, 3)  # (T, H, W) video latents: 27 tokens of LTX-2's 1x1x1 patches, padded on every layout
AUDIO_SHAPE = (2, 5, 2)  # (C_a, L, M) audio latents: 5 tokens of 2 x 2 = audio_in_channels 4, padded too
TEXT_LEN, TEXT_DIM, FPS = 7, 16, 24.0
# float64 on both sides: what is left is the order of sums (other GEMM shapes, the ring's merges, the gathers)
OUT_ATOL, GRAD_OF_LARGEST = 1e-13, 1e-12
# float32, as LTX2Pipeline passes its scheduler's timesteps (and the family's forward does)
T = torch.tensor([30.0, 810.0])  # the video's noise level per sample (sigma x 1000)
AUDIO_T = torch.tensor([500.0, 120.0])  # the audio's own


def video_timesteps() -> torch.Tensor:
    """(B, S) per-token times: 0 on the first latent frame's tokens (a clean conditioning frame), T elsewhere."""
    first = torch.zeros(SHAPE, dtype=torch.bool)
    first[0] = True
    return torch.where(first.flatten(), 0.0, T[:, None])


# LTX-2.3's architecture switches on the tiny model: per-head gates on every attention, the prompt's cross-attention
# modulated by the time (prompt_adaln), and the cross-modal modulation reading the other stream's time
LTX23 = {"gated_attn": True, "audio_gated_attn": True, "cross_attn_mod": True, "audio_cross_attn_mod": True}


def ltx2_case(seed=0, overrides=None):
    """The same weights and inputs on every rank: the unmodified reference, a copy (float64), inputs, douts."""
    import diffusers

    torch.manual_seed(seed)
    config = {**architecture("ltx2_tiny"), **(overrides or {})}
    reference = diffusers.LTX2VideoTransformer3DModel.from_config(config).double()
    model = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(seed + 1)
    video = torch.randn(2, 4, *SHAPE, generator=g, dtype=torch.float64)
    audio = torch.randn(2, *AUDIO_SHAPE, generator=g, dtype=torch.float64)
    text, audio_text = (torch.randn(2, TEXT_LEN, TEXT_DIM, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(2, TEXT_LEN, dtype=torch.bool)
    mask[1, 4:] = False  # the second prompt is 4 tokens, padded to 7
    douts = (torch.randn(2, 4, *SHAPE, generator=g, dtype=torch.float64),
             torch.randn(2, *AUDIO_SHAPE, generator=g, dtype=torch.float64))
    return reference, model, (video, audio, {"text": text, "audio_text": audio_text, "text_mask": mask}), douts


def reference_call(reference, video, audio, cond):
    """The unmodified model as LTX2ImageToVideoPipeline calls it (packed tokens, sizes rather than coordinates), each
    stream at its own time (the pipeline's are equal: it passes sigma alone)."""
    batch, channels, frames, height, width = video.shape
    tokens = video.permute(0, 2, 3, 4, 1).reshape(batch, -1, channels)  # 1x1x1 patches: (B, T*H*W, C)
    audio_tokens = audio.transpose(1, 2).flatten(2, 3)  # (B, L, C_a * M)
    out, audio_out = reference(
        hidden_states=tokens, audio_hidden_states=audio_tokens, encoder_hidden_states=cond["text"],
        audio_encoder_hidden_states=cond["audio_text"], timestep=video_timesteps(), audio_timestep=AUDIO_T, sigma=T,
        audio_sigma=AUDIO_T, encoder_attention_mask=cond["text_mask"], audio_encoder_attention_mask=cond["text_mask"],
        num_frames=frames, height=height, width=width, fps=FPS, audio_num_frames=audio.shape[2],
        use_cross_timestep=bool(reference.config.cross_attn_mod), return_dict=False)
    return (out.reshape(batch, frames, height, width, channels).permute(0, 4, 1, 2, 3),
            audio_out.unflatten(2, (channels // 2, -1)).transpose(1, 2))


def forward_backward(call, module, douts):
    module.zero_grad()
    outs = call()
    sum((out * dout).sum() for out, dout in zip(outs, douts)).backward()
    return [out.detach() for out in outs], {name: p.grad.clone() for name, p in module.named_parameters()}


def run_both(reference, model, video, audio, cond, douts):
    expected = forward_backward(lambda: reference_call(reference, video, audio, cond), reference, douts)
    got = forward_backward(lambda: ltx2_forward(model, video, audio, video_timesteps(), AUDIO_T, cond, fps=FPS),
                           model, douts)
    return got, expected


def assert_matches(got, expected, where=""):
    (outs, grads), (ref_outs, ref_grads) = got, expected
    for name, out, ref in zip(("video", "audio"), outs, ref_outs):
        assert_same_numbers(out, ref, atol=OUT_ATOL, where=f"{where} {name} prediction")
    largest = max(grad.abs().max() for grad in ref_grads.values())
    assert_same_numbers(grads, ref_grads, atol=GRAD_OF_LARGEST * largest, where=f"{where} gradient")


def check_layouts(rank, world):
    for ring, ulysses in LAYOUTS:
        reference, model, inputs, douts = ltx2_case()
        parallelize(model, LTX2.plan, dims=init_sequence_parallel(ring, ulysses))
        (outs, grads), expected = run_both(reference, model, *inputs, douts)
        ddp_average(grads)  # DDP's average over the dp x sp ranks
        assert_matches((outs, grads), expected, f"ring {ring} x ulysses {ulysses}")


def test_ltx2_matches_unmodified_diffusers_under_every_layout():
    run_ranks(check_layouts, 4)


def test_ltx2_one_process_equals_diffusers():
    reference, model, inputs, douts = ltx2_case()
    parallelize(model, LTX2.plan)  # one process: attention still routed to ringdit
    assert_matches(*run_both(reference, model, *inputs, douts), "one process")


def check_ltx23_ring(rank, world):
    reference, model, inputs, douts = ltx2_case(overrides=LTX23)
    parallelize(model, LTX2.plan, dims=init_sequence_parallel(2, 1))
    (outs, grads), expected = run_both(reference, model, *inputs, douts)
    ddp_average(grads)
    assert_matches((outs, grads), expected, "LTX-2.3 switches, ring 2")


def test_ltx23_architecture_switches_match_unmodified_diffusers_at_ring_2():
    """Gated attention, time-modulated prompt cross-attention and the cross-modal modulation at the other stream's
    time (use_cross_timestep, which the family's forward turns on with cross_attn_mod, as the reference is called
    here), each stream at its own time: ring 2 equals the unmodified model, forward and every gradient."""
    run_ranks(check_ltx23_ring, 2)
