"""Builders shared by the tests of Qwen-Image-Edit's prompt encoding (``prompt_template=qwenimage_edit``): a tiny
random Qwen2_5_VLForConditionalGeneration folder with its tokenizer and image processor, transformers' own
``Qwen2VLProcessor`` for the pipelines, a few pictures, and what an edit pipeline's own call encodes for a prompt and
its image.

The pipelines' processor is transformers' own ``Qwen2VLProcessor``, built here from the folder's tokenizer and image
processor; transformers 5 checks its video processor's class, which needs torchvision (not installed), so the check is
skipped for that one absent argument while the processor is built (``vl_processor``): its ``__call__`` is
unchanged."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from ringdit.media.edit_prompt import edit_template
from ringdit.media.text import TextEncoder, chat_template
from tests.helpers import WORDS

VISION = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]


def tiny_tokenizer():
    """Qwen-Image-Edit's prompt strings split as Qwen's BPE splits them at the templates: the special and vision
    tokens whole, each word, punctuation mark and newline one token; no special tokens added."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *VISION]
    templates = [edit_template(chat_template(name)) for name in ("qwenimage_edit", "qwenimage_edit_plus")]
    text = "".join(template.text + template.picture for template in templates)
    pieces = sorted(set(re.findall(r"\w+|[^\w\s]|\n", re.sub(r"<\|\w+\|>", " ", text))) - set(WORDS))
    vocab = {word: i for i, word in enumerate([*special, *WORDS, *pieces])}
    tokenizer = Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]|\n"), behavior="removed", invert=True)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|endoftext|>", unk_token="<unk>",
                                   additional_special_tokens=special[1:]), vocab


def save_edit_folder(root: Path) -> Path:
    """A Qwen-Image-Edit-shaped folder: text_encoder/ (a tiny random Qwen2_5_VLForConditionalGeneration whose image
    token is the tokenizer's), tokenizer/ and processor/ (a Qwen2VLImageProcessor of 14-pixel patches merged 2 x 2,
    at most 112 x 112 pixels: a few image tokens)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    tokenizer, vocab = tiny_tokenizer()
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": len(vocab), "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 512,
                     "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 16,
                       "fullatt_block_indexes": [0]},
        image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"])
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(root / "text_encoder")
    tokenizer.save_pretrained(root / "tokenizer")
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112, patch_size=14, merge_size=2,
                             temporal_patch_size=2).save_pretrained(root / "processor")
    return root


def vl_processor(encoder: TextEncoder):
    """transformers' Qwen2VLProcessor of the folder's tokenizer and image processor, built without a video processor
    (see the module docstring)."""
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = (
        lambda self, name, value: None if name == "video_processor" and value is None else check(self, name, value))
    try:
        return Qwen2VLProcessor(image_processor=encoder.edit.image_processor, tokenizer=encoder.tokenizer,
                                video_processor=None)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def images(count: int):
    from PIL import Image

    rng = np.random.RandomState(0)
    sizes = [(96, 64), (64, 64), (40, 100)]  # (W, H): each its own aspect ratio
    return [Image.fromarray((rng.rand(h, w, 3) * 255).astype(np.uint8)) for w, h in sizes[:count]]


def write_image(path: Path, size: tuple[int, int], seed: int) -> None:
    """A random RGB image of ``size`` (W, H)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def write_edit_pairs(images: Path, references: Path) -> None:
    """Four captioned 16x16 images and their 32x32 reference images (what ``prepare reference=`` reads)."""
    images.mkdir()
    references.mkdir()
    for i, caption in enumerate(["a red fox", "a blue cat", "a green field", "a blue sky"]):
        write_image(images / f"{i}.png", (16, 16), seed=i)
        write_image(references / f"{i}.png", (32, 32), seed=10 + i)
        (images / f"{i}.txt").write_text(caption)


def pipeline_encoding(encoder: TextEncoder, pipeline: str, prompt: str, picture) -> torch.Tensor:
    """(L, D) what the diffusers edit ``pipeline``'s own call encodes for ``prompt`` and ``picture`` (its
    ``encode_prompt`` on the image as the call resizes it, with ``encoder``'s Qwen2.5-VL, tokenizer and processor;
    stopped once encoded: no VAE, no transformer). The pipeline encodes its negative prompt by the same call."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = getattr(diffusers, pipeline)(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None,
                                        text_encoder=encoder.model, tokenizer=encoder.tokenizer,
                                        processor=vl_processor(encoder), transformer=None)
    encoded = []

    def encode_then_stop(*args, **kwargs):
        encoded.append(type(pipe).encode_prompt(pipe, *args, **kwargs))
        raise StopIteration

    pipe.encode_prompt = encode_then_stop
    with torch.no_grad(), pytest.raises(StopIteration):
        pipe(image=picture, prompt=prompt, num_inference_steps=1, output_type="latent")
    embeds, mask = encoded[-1]
    assert mask is None or mask.all()  # one prompt: every state real
    return embeds[0].float()
