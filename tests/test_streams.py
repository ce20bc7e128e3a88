"""Several token streams in one plan (``ParallelPlan.streams``): a toy model of video, audio, a control video and
masked text -- self-attention over each of video, audio and control, joint attention over ``[text ; video ;
audio]`` with the text masked, cross-attention between the two sharded streams (video queries to audio keys and
back), per-stream positions, a control hint added to the video, video and audio both predicted -- in float64 under
ring 2, Ulysses 2 and 2 x 2 against the same model unsharded: outputs and every parameter gradient.

Lengths 7 (video and control), 5 (audio) and 3 (text) divide no degree: every stream is tail-padded, on four ranks
the last rank's audio chunk is all padding."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from ringdit.models import parallelize
from ringdit.models.parallel_plan import ParallelPlan, StreamPlan
from ringdit.parallel import init_sequence_parallel
from tests.diffusers_helpers import ddp_average
from tests.distributed import run_ranks
from tests.helpers import assert_same_numbers
from tests.toy_attention import DIM, Attention

VIDEO, AUDIO, TEXT_LEN = 7, 5, 3
OUT_ATOL, GRAD_OF_MAX = 1e-13, 1e-12  # float64: only the order of sums differs


class JointAttention(Attention):
    """Attention over ``[text ; video ; audio]``, the text keys masked by ``text_mask`` (B, L)."""

    def forward(self, text, video, audio, text_mask):
        keys = torch.cat([text_mask, text_mask.new_ones(video.shape[:2]), text_mask.new_ones(audio.shape[:2])], 1)
        out = super().forward(torch.cat([text, video, audio], 1), attn_mask=keys[:, None, None, :])
        return out.split([text.shape[1], video.shape[1], audio.shape[1]], dim=1)


class Positions(nn.Module):
    """A learned (1, S, D) position table of a stream (made whole, as RoPE modules make their rotations)."""

    def __init__(self, length):
        super().__init__()
        self.table = nn.Parameter(torch.randn(1, length, DIM))

    def forward(self):
        return self.table


class Block(nn.Module):
    def __init__(self, first=False):
        super().__init__()
        self.first = first
        self.control_attn, self.video_attn, self.audio_attn = Attention(), Attention(), Attention()
        self.video_to_audio, self.audio_to_video, self.joint = Attention(), Attention(), JointAttention()
        self.hint = nn.Linear(DIM, DIM)

    def forward(self, video, audio, control, text, text_mask):
        if self.first:  # the control stream starts from the video, as VACE's first block does
            control = control + video
        control = control + self.control_attn(control)
        video = video + self.video_attn(video) + self.hint(control)  # VACE's hint: a per-token add
        audio = audio + self.audio_attn(audio)
        video, audio = video + self.video_to_audio(video, audio), audio + self.audio_to_video(audio, video)
        text_out, video_out, audio_out = self.joint(text, video, audio, text_mask)
        return video + video_out, audio + audio_out, control, text + text_out


class StreamsModel(nn.Module):
    """(video (B, 7, D), audio (B, 5, D), control (B, 7, D), text (B, 3, D), text_mask (B, 3)) -> (video, audio)
    predictions (B, 7, D), (B, 5, D)."""

    parallel_plan = ParallelPlan(
        blocks=("blocks",),
        self_attention=("blocks.*.video_attn", "blocks.*.audio_attn", "blocks.*.control_attn"),
        joint_attention=("blocks.*.joint",),
        attention_streams={"blocks.*.audio_attn": ("audio",), "blocks.*.control_attn": ("control",),
                           "blocks.*.joint": ("text", "tokens", "audio")},
        stream_cross_attention={"blocks.*.video_to_audio": "audio", "blocks.*.audio_to_video": "tokens"},
        # video and audio cut at the model's input, their position tables' outputs with them; the control video and
        # the text where the blocks start
        split_inputs={"": {0: 1}}, split_outputs={"video_positions": {None: 1}},
        gather_outputs={"video_out": {None: 1}},
        text_inputs={"blocks.0": {3: 1}, "blocks.*.joint": {3: 1}}, text_mask=("blocks.0", 4),
        streams={"audio": StreamPlan(inputs={"": {1: 1}}, outputs={"audio_positions": {None: 1}},
                                     gather={"audio_out": {None: 1}}),
                 "control": StreamPlan(inputs={"blocks.0": {2: 1}})},
    )

    def __init__(self):
        super().__init__()
        self.video_positions, self.audio_positions = Positions(VIDEO), Positions(AUDIO)
        self.blocks = nn.ModuleList([Block(first=True), Block()])
        self.video_out, self.audio_out = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, video, audio, control, text, text_mask):
        video = video + self.video_positions()
        audio = audio + self.audio_positions()
        for block in self.blocks:
            video, audio, control, text = block(video, audio, control, text, text_mask)
        return self.video_out(video), self.audio_out(audio)


def streams_case(dims=None):
    """The reference model, a parallelized copy with the same weights (float64), inputs and output gradients."""
    torch.manual_seed(0)
    reference = StreamsModel().double()
    model = StreamsModel().double()
    model.load_state_dict(reference.state_dict())
    parallelize(model, dims=dims, backend="math")
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, n, DIM, generator=g, dtype=torch.float64) for n in (VIDEO, AUDIO, VIDEO, TEXT_LEN)]
    text_mask = torch.tensor([[True, True, False], [False, True, True]])  # right-padded, and a masked first token
    douts = [torch.randn(2, n, DIM, generator=g, dtype=torch.float64) for n in (VIDEO, AUDIO)]
    return reference, model, (*inputs, text_mask), douts


def forward_backward(model, inputs, douts):
    model.zero_grad()
    outs = model(*inputs)
    sum((out * dout).sum() for out, dout in zip(outs, douts)).backward()
    return [out.detach() for out in outs], {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_matches(got, expected, where):
    (outs, grads), (ref_outs, ref_grads) = got, expected
    for name, out, ref in zip(("video", "audio"), outs, ref_outs):
        assert_same_numbers(out, ref, atol=OUT_ATOL, where=f"{where} {name} output")
    # within 1e-12 of the largest gradient (a key bias's gradient is zero up to rounding: no relative bound of its own)
    largest = max(grad.abs().max() for grad in ref_grads.values())
    assert_same_numbers(grads, ref_grads, atol=GRAD_OF_MAX * largest, where=f"{where} gradient")


def check_stream_layouts(rank, world):
    for ring, ulysses in ((2, 1), (1, 2), (2, 2)):
        reference, model, inputs, douts = streams_case(init_sequence_parallel(ring, ulysses))
        expected = forward_backward(reference, inputs, douts)
        outs, grads = forward_backward(model, inputs, douts)
        ddp_average(grads)  # DDP's average over the dp x sp ranks
        assert_matches((outs, grads), expected, f"ring {ring} x ulysses {ulysses}")


def test_streams_match_the_unsharded_model_under_every_layout():
    run_ranks(check_stream_layouts, 4)


def test_streams_on_one_process_match_the_unsharded_model():
    reference, model, inputs, douts = streams_case()
    assert_matches(forward_backward(model, inputs, douts), forward_backward(reference, inputs, douts), "one process")


def test_a_plan_naming_a_stream_it_does_not_describe_is_refused():
    plan = replace(StreamsModel.parallel_plan, attention_streams={"blocks.*.audio_attn": ("sound",)})
    with pytest.raises(ValueError, match="attention_streams name the stream 'sound' for blocks.0.audio_attn, which "
                                         "it does not describe; its streams: \\['audio', 'control', 'text', "
                                         "'tokens'\\]"):
        parallelize(StreamsModel(), plan)
    plan = replace(StreamsModel.parallel_plan, stream_cross_attention={"blocks.*.video_to_audio": "sound"})
    with pytest.raises(ValueError, match="stream_cross_attention names the stream 'sound' for "
                                         "blocks.0.video_to_audio"):
        parallelize(StreamsModel(), plan)
    plan = replace(StreamsModel.parallel_plan, streams={"text": StreamPlan()})
    with pytest.raises(ValueError, match="streams name 'text', which its split_\\* / text_\\* fields describe"):
        parallelize(StreamsModel(), plan)
