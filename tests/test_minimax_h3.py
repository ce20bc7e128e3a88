"""MiniMax-H3 (diffusers' MiniMaxH3Transformer3DModel, unmodified: text, audio and video rows packed into one
sequence) under ringdit's plan, in float64: the same numbers as the model called directly on one process -- the video
and the audio prediction, and every parameter gradient -- on one process and on 4 gloo CPU ranks under ring 2, ring
4, Ulysses 2 and 2 x 2, and with 7 heads under Ulysses 2 and 4 (uneven: 4 + 3, 2 + 2 + 2 + 1 heads a rank).

The packed sequence is the pipeline's own ``t2va`` layout (``[text | audio | video]``, its positions, tags and
indices): 7 text rows, 2 x 3 audio rows, 3 x 1 x 3 = 9 video rows -- 21 rows, tail-padded on every layout, no
stream's count divisible by 4 --, the audio at a timestep of its own."""

from __future__ import annotations

import os
import re

import pytest
import torch

import ringdit.training  # noqa: F401 - not first imported under capsys by the planner test (test_memory.py)
from ringdit.models import parallelize
from ringdit.models.diffusers.minimax_h3 import minimax_h3_forward, packed_layout
from ringdit.parallel import init_sequence_parallel
from ringdit.plan import main as plan_main
from tests.diffusers_helpers import LAYOUTS, ddp_average
from tests.distributed import run_ranks
from tests.helpers import architecture, assert_same_numbers

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GRID, AUDIO_LEN, TEXT_LEN = (3, 2, 6), 3, 7  # latents (T, H, W) of 1x2x2 patches: 9 video rows; 6 audio rows
PATCH = (1, 2, 2)
UNEVEN = [(1, 2), (1, 4)]  # (ring, ulysses) with 7 heads
# float64 on both sides: what is left is the order of sums (other GEMM shapes, the ring's merges)
OUT_ATOL, GRAD_OF_LARGEST = 1e-13, 1e-12


def tiny(heads: int = 2) -> dict:
    config = architecture("minimax_h3_tiny")
    config["num_attention_heads"] = heads
    return config


def minimax_case(heads=2, seed=0, dims=None):
    """The same weights and inputs on every rank: the unmodified reference, a ringdit model (float64, its transformer
    parallelized), the transformer's inputs and the gradients of both outputs."""
    import diffusers

    from ringdit.models.diffusers import DiffusersTransformer

    torch.manual_seed(seed)
    reference = diffusers.MiniMaxH3Transformer3DModel.from_config(tiny(heads)).double()
    model = DiffusersTransformer("minimax_h3", config=tiny(heads), input_size=GRID, in_channels=4, text_len=TEXT_LEN,
                                 text_dim=16, condition_dropout_prob=0.0)
    model.transformer.load_state_dict(reference.state_dict())
    parallelize(model.double(), dims=dims)  # dims None: one process, attention still routed to ringdit
    g = torch.Generator().manual_seed(seed + 1)
    layout = packed_layout(TEXT_LEN, GRID, AUDIO_LEN, PATCH)
    rows = layout["token_tags"].shape[0]
    row_times = torch.full((rows,), 0.3, dtype=torch.float64)
    row_times[layout["audio_indices"]] = 0.8  # the audio at its own time
    timestep, timestep_indices = torch.unique(row_times, sorted=True, return_inverse=True)
    inputs = dict(hidden_states=torch.randn(2, 9, 16, generator=g, dtype=torch.float64),
                  audio_hidden_states=torch.randn(2, 2 * AUDIO_LEN, 8, generator=g, dtype=torch.float64),
                  encoder_hidden_states=torch.randn(2, TEXT_LEN, 16, generator=g, dtype=torch.float64),
                  timestep=timestep, timestep_indices=timestep_indices, **layout)
    douts = (torch.randn(2, 9, 16, generator=g, dtype=torch.float64),
             torch.randn(2, 2 * AUDIO_LEN, 8, generator=g, dtype=torch.float64))
    return reference, model, inputs, douts


def forward_backward(transformer, inputs, douts):
    transformer.zero_grad()
    outs = transformer(**inputs, return_dict=False)
    sum((out * dout).sum() for out, dout in zip(outs, douts)).backward()
    return [out.detach() for out in outs], {name: p.grad.clone() for name, p in transformer.named_parameters()}


def assert_matches(got, expected, where):
    (outs, grads), (ref_outs, ref_grads) = got, expected
    for name, out, ref in zip(("video", "audio"), outs, ref_outs):
        assert_same_numbers(out, ref, atol=OUT_ATOL, where=f"{where} {name} output")
    # within 1e-12 of the largest gradient (the bound; a layout reorders sums only, ~1e-16 of it)
    largest = max(grad.abs().max() for grad in ref_grads.values())
    assert_same_numbers(grads, ref_grads, atol=GRAD_OF_LARGEST * largest, where=f"{where} gradient")


def check_layouts(rank, world):
    for heads, layouts in ((2, LAYOUTS), (7, UNEVEN)):
        for ring, ulysses in layouts:
            reference, model, inputs, douts = minimax_case(heads, dims=init_sequence_parallel(ring, ulysses))
            expected = forward_backward(reference, inputs, douts)
            outs, grads = forward_backward(model.transformer, inputs, douts)
            ddp_average(grads)  # DDP's average over the dp x sp ranks
            assert_matches((outs, grads), expected, f"{heads} heads, ring {ring} x ulysses {ulysses}")


def test_minimax_h3_matches_unmodified_diffusers_under_every_layout():
    run_ranks(check_layouts, 4)


@pytest.mark.parametrize("heads", [2, 7])
def test_minimax_h3_one_process_equals_diffusers(heads):
    reference, model, inputs, douts = minimax_case(heads)
    assert_matches(forward_backward(model.transformer, inputs, douts), forward_backward(reference, inputs, douts),
                   "one process")


def pipeline_call(reference, x, audio, text, t, audio_t):
    """The unmodified model on one sample as the pipeline packs it (its layout, patchify and channel-major audio), its
    timestep 1 - sigma per row, its data-ward velocities negated -> ringdit's predictions: video (1, C, T, H, W), audio
    (1, 2, L, C_a)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    layout = packed_layout(text.shape[1], GRID, AUDIO_LEN, PATCH)
    rows = torch.full(layout["token_tags"].shape, 1 - t / 1000, dtype=torch.float64)
    rows[layout["audio_indices"]] = 1 - audio_t / 1000
    timestep, indices = torch.unique(rows, sorted=True, return_inverse=True)
    video_rows = patchify_video_latents(x, PATCH)[None]  # (1, 9, 16)
    sound_rows = audio.reshape(1, 2 * AUDIO_LEN, 8)  # channel-major: (1, 2, L, 8) -> (1, 2 L, 8)
    with torch.no_grad():
        v_video, v_audio = reference(video_rows, sound_rows, text, timestep, indices, return_dict=False, **layout)
    return (-v_video.reshape(1, 3, 1, 3, 4, 2, 2).permute(0, 4, 1, 2, 5, 3, 6).reshape(1, 4, *GRID),
            -v_audio.reshape(1, 2, AUDIO_LEN, 8))


def test_the_denoiser_packs_as_the_pipeline_and_converts_time_and_velocity():
    """ringdit's (x, t, cond) call equals the unmodified model on the pipeline's layout: timestep 1 - sigma (text and
    video at the video's, the soundtrack at its own, the video's by default), the velocities negated (the model's
    point to the data), each sample its own call; the text cut to the batch's longest prompt (the model takes no
    mask): one sample a batch is exactly its own prompt, a shorter prompt of a batch keeps zero rows up to the
    longest."""
    reference, model, _, _ = minimax_case()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, *GRID, generator=g, dtype=torch.float64)
    audio = torch.randn(2, 2, AUDIO_LEN, 8, generator=g, dtype=torch.float64)  # (B, stereo, L, C_a)
    text = torch.randn(2, TEXT_LEN, 16, generator=g, dtype=torch.float64)
    mask = torch.ones(2, TEXT_LEN, dtype=torch.bool)
    mask[0, 6:] = mask[1, 4:] = False  # prompts of 6 and 4 real tokens
    t, audio_t = torch.tensor([300.0, 900.0], dtype=torch.float64), torch.tensor([0.0, 250.0], dtype=torch.float64)
    cond = {"text": text, "text_mask": mask, "audio": audio, "audio_time": audio_t}
    with torch.no_grad():
        got = model(x, t, cond)
        alone = model(x[1:], t[1:], {key: value[1:] for key, value in cond.items()})
    for i in range(2):  # in a batch: the longest prompt's 6 rows, the second prompt's last 2 zero
        prompt = (text[i] * mask[i, :, None])[None, :6]
        video, sound = pipeline_call(reference, x[i : i + 1], audio[i : i + 1], prompt, t[i].item(),
                                     audio_t[i].item())
        assert_same_numbers(got[0][i : i + 1], video, atol=OUT_ATOL, where=f"sample {i} video")
        assert_same_numbers(got[1]["audio"][i : i + 1], sound, atol=OUT_ATOL, where=f"sample {i} audio")
    video, sound = pipeline_call(reference, x[1:], audio[1:], text[1:, :4], t[1].item(), audio_t[1].item())
    assert_same_numbers(alone[0], video, atol=OUT_ATOL, where="one sample: its own 4 tokens")
    with torch.no_grad():  # no audio_time: the audio at the video's time
        same = model(x[:1], t[:1], {"text": text[:1], "audio": audio[:1]})
    video, sound = pipeline_call(reference, x[:1], audio[:1], text[:1], t[0].item(), t[0].item())
    assert_same_numbers(same[1]["audio"], sound, atol=OUT_ATOL, where="audio at the video's time")


def test_both_predictions_come_back_in_the_latents_shapes():
    _, model, _, _ = minimax_case()
    x, audio = torch.randn(1, 4, *GRID, dtype=torch.float64), torch.randn(1, 2, AUDIO_LEN, 8, dtype=torch.float64)
    video, sound = minimax_h3_forward(model.transformer, x, audio, torch.tensor([500.0]), torch.tensor([500.0]),
                                      torch.randn(1, TEXT_LEN, 16, dtype=torch.float64))
    assert video.shape == x.shape and sound.shape == audio.shape


def test_conditioning_without_audio_or_with_other_channels_is_refused():
    _, model, _, _ = minimax_case()
    x, text = torch.zeros(1, 4, *GRID, dtype=torch.float64), torch.zeros(1, TEXT_LEN, 16, dtype=torch.float64)
    t = torch.tensor([500.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="model.family=minimax_h3 packs video, audio and text into one sequence, but "
                                         "the conditioning has no 'audio' latents"):
        model(x, t, {"text": text})
    with pytest.raises(ValueError, match="the audio latents have 4 channels but model.config.audio_in_channels is 8"):
        model(x, t, {"text": text, "audio": torch.zeros(1, 2, AUDIO_LEN, 4, dtype=torch.float64)})
    with pytest.raises(ValueError, match=r"the audio latents \(1, 1, 3, 8\) do not fit the video latents"):
        model(x, t, {"text": text, "audio": torch.zeros(1, 1, AUDIO_LEN, 8, dtype=torch.float64)})


def test_the_planner_lays_out_ulysses_degrees_that_do_not_divide_the_56_heads(capsys):
    """MiniMax-H3's 56 heads cap an even Ulysses split at 8 (56 = 8 x 7); the planner lays out 16 too, its step time
    counting the busiest rank's 4 heads (4 / 3.5 = 1.14x an even split's attention), and says how it places them."""
    assert plan_main(["model=minimax_h3", "gpus=32", "ulysses_degree=16", "data.latent=false", "data.frames=72",
                 "data.size=[48,84]", "show=2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^ +\d+ +\d+ +16 fsdp ", out, flags=re.M), out  # layouts of ulysses=16 in the table
    assert ("Uneven heads: ulysses=16 places the 56 heads 8 ranks x 4 + 8 x 3; its attention takes 1.14x an even "
            "split's (counted in s/sample)") in out
