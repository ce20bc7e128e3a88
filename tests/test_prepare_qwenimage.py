"""``prompt_template=qwenimage``: Qwen-Image's text encoder (Qwen2.5-VL in QwenImagePipeline's prompt string, its last
hidden states with the template's 34 tokens dropped) in prepare, and in infer.py and the server through the data's
recorded ``text_encoder`` description -- equal to ``QwenImagePipeline.encode_prompt`` on a tiny random encoder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from PIL import Image  # noqa: E402

from ringdit.common.errors import ConfigError  # noqa: E402
from ringdit.media.text import TextEncoder, chat_template, encoder_settings  # noqa: E402
from tests.helpers import sampling_encoding, save_tiny_qwenimage_encoder  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"
TEXT_LEN = 8
PROMPTS = ["a red fox", "a blue cat running sky green field a red fox", ""]  # one longer than TEXT_LEN: cut


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    """A Qwen-Image-shaped folder: text_encoder/ and tokenizer/ (``tests.helpers.save_tiny_qwenimage_encoder``)."""
    return save_tiny_qwenimage_encoder(tmp_path_factory.mktemp("qwenimage"))


def pipeline_encode(encoder: TextEncoder, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """QwenImagePipeline.encode_prompt itself, on the same model and tokenizer: (embeds (N, L', D), mask (N, L'))."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=encoder.model,
                             tokenizer=encoder.tokenizer, transformer=None)
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(prompts, device=torch.device("cpu"), max_sequence_length=TEXT_LEN)
    if mask is None:  # the pipeline drops an all-true mask
        mask = torch.ones(embeds.shape[:2], dtype=torch.long)
    return embeds, mask.bool()


def test_qwenimage_prompt_template_matches_the_pipeline(qwen):
    """Its text = encode_prompt's states on the real tokens (the template's 34 dropped, the long prompt cut at
    max_text_len), zero after them up to max_text_len; text_mask its mask; 'qwenimage' recorded for infer."""
    template = chat_template("qwenimage")
    assert (template.crop, template.layers, template.masked) == (34, (-1,), True)
    encoder = TextEncoder(qwen, max_len=TEXT_LEN, prompt_template="qwenimage")
    prefix = template.text.split("{}")[0]
    assert len(encoder.tokenizer(prefix).input_ids) == template.crop  # the tiny tokenizer splits it as Qwen's does
    cond = encoder(PROMPTS)
    embeds, mask = pipeline_encode(encoder, PROMPTS)
    length = embeds.shape[1]
    assert cond["text"].shape == (3, TEXT_LEN, 16) and length <= TEXT_LEN and mask.sum(1).tolist()[1] == TEXT_LEN
    assert torch.equal(cond["text_mask"][:, :length], mask) and not cond["text_mask"][:, length:].any()
    # the same model over the same real tokens; the pipeline pads to the batch's longest, prepare to max_text_len
    torch.testing.assert_close(cond["text"][:, :length], embeds * mask[..., None], rtol=1e-6, atol=1e-6)
    assert (cond["text"] * ~cond["text_mask"][..., None]).abs().max() == 0  # zero after the real tokens
    described = encoder.describe()
    assert described["prompt_template"] == "qwenimage" and described["class"] == "Qwen2_5_VLForConditionalGeneration"


def test_infer_and_the_server_encode_as_prepare_did(qwen, models, tmp_path):
    """prepare records prompt_template=qwenimage in every shard; infer.py (Codecs.encode) and the server
    (TextEncoder with encoder_settings) read it from that record and encode prompts exactly as prepare did."""
    from ringdit.media.encode_folder import encode_folder
    from tests.helpers import read_prepared

    images = tmp_path / "images"
    images.mkdir()
    for i, caption in enumerate(PROMPTS[:2]):
        Image.new("RGB", (16, 16), (40 * i, 90, 200)).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(caption)
    encode_folder(str(images), str(tmp_path / "out"), str(models["flux"]), str(qwen), size=16,
                  max_text_len=TEXT_LEN, prompt_template="qwenimage", progress=False)
    tensors, metadata = read_prepared(tmp_path / "out" / "shard-00000.safetensors")
    described, stored = json.loads(metadata["text_encoder"]), tensors["text"]
    assert described["prompt_template"] == "qwenimage"
    cond, negative = sampling_encoding(described, PROMPTS[:2], text_len=TEXT_LEN, text_dim=described["dim"])
    assert torch.equal(cond["text"], stored)
    # the server's encoder, as ringdit.serve builds it from the data's description
    served = TextEncoder(described["path"], described["tokenizer"], max_len=TEXT_LEN, **encoder_settings(described))
    assert torch.equal(served(PROMPTS[:2])["text"], stored) and torch.equal(negative["text"], served([""])["text"])


def test_qwenimage_template_errors_are_one_line(qwen, models):
    """Another encoder under the qwenimage template, or max_text_len past its positions: one line each."""
    with pytest.raises(ConfigError, match=r"prompt_template=qwenimage is for Qwen2_5_VLForConditionalGeneration "
                                          r"\(model_type qwen2_5_vl\), but text_encoder=.* is T5EncoderModel"):
        TextEncoder(models["wan"], max_len=TEXT_LEN, prompt_template="qwenimage")
    with pytest.raises(ConfigError, match=r"max_text_len=100 is longer than Qwen2_5_VLForConditionalGeneration takes "
                                          r"\(94 positions after the template\); pass max_text_len=94 or less"):
        TextEncoder(qwen, max_len=100, prompt_template="qwenimage")
