"""``prompt_template=minimax_h3``: prepare's text states are MiniMaxH3ModularPipeline's prompt encoding -- the prompt
verbatim, tokenized without special tokens, through Qwen3-VL, ``hidden_states[50]`` (the pipeline's own
``get_qwen3vl_prompt_embeds`` with its ``text_encoder_layer``) -- on a tiny random Qwen3VLForConditionalGeneration of
51 decoder layers (the pipeline refuses fewer), each prompt's real tokens equal, the padding after them zeroed and
masked out."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from ringdit.common.errors import ConfigError  # noqa: E402
from ringdit.media.text import TextEncoder  # noqa: E402
from tests.helpers import WORDS  # noqa: E402
from tests.minimax_h3_helpers import tiny_qwen3_vl  # noqa: E402

@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("minimax_text")
    tiny_qwen3_vl(root)
    return root


def processor(tokenizer):
    """transformers' Qwen3VLProcessor over the tokenizer (its mm_token_type_ids: all text here), built without its
    image and video processors (torchvision), which a text prompt does not use."""
    from transformers import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, argument: None
    try:
        return Qwen3VLProcessor(tokenizer=tokenizer)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def test_text_states_are_the_pipelines_prompt_encoding(qwen3_vl):
    """Each caption's states = get_qwen3vl_prompt_embeds(token ids of MiniMaxH3TextEncoderStep, layer 50) on its
    real tokens; zero after them, text_mask marking them; the width the encoder's."""
    from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline

    encoder = TextEncoder(qwen3_vl, max_len=12, prompt_template="minimax_h3")
    prompts = [WORDS[5], " ".join(WORDS[6:9])]  # words (the first are special tokens)
    out = encoder(prompts)
    assert out["text"].shape == (2, 12, 16) and encoder.dim == 16
    layer = MiniMaxH3ModularPipeline.text_encoder_layer.fget(None)
    for row, prompt in enumerate(prompts):
        ids = encoder.tokenizer(prompt, add_special_tokens=False)["input_ids"]  # MiniMaxH3TextEncoderStep's
        with torch.no_grad():
            expected = get_qwen3vl_prompt_embeds(encoder.model, processor(encoder.tokenizer), ids, {},
                                                 text_encoder_layer=layer)[0].float()  # (n, 16)
        n = len(ids)
        assert n < 12 and out["text_mask"][row].tolist() == [True] * n + [False] * (12 - n)
        torch.testing.assert_close(out["text"][row, :n], expected, rtol=1e-5, atol=1e-5)
        assert out["text"][row, n:].abs().max() == 0
    assert (out["text"][0, 0] - out["text"][1, 0]).abs().max() > 0  # each caption its own states


def test_the_template_refuses_another_encoder(qwen3_vl, tmp_path):
    """prompt_template=minimax_h3 with a T5: one line naming the template and the encoder it needs."""
    from transformers import T5Config, T5EncoderModel

    T5EncoderModel(T5Config(vocab_size=len(WORDS), d_model=16, d_ff=32, d_kv=4, num_layers=1, num_heads=2)
                   ).save_pretrained(tmp_path / "t5")
    with pytest.raises(ConfigError, match="prompt_template=minimax_h3 is for Qwen3VLForConditionalGeneration"):
        TextEncoder(tmp_path / "t5", qwen3_vl / "tokenizer", max_len=8, prompt_template="minimax_h3")
