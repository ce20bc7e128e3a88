"""The tiny MiniMax-H3 components its prepare, prompt and VAE tests share: Qwen3-VL with a word-level tokenizer
holding Qwen's special tokens, and the video VAE."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers import WORDS

VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]  # Qwen3-VL's config names them


def tiny_tokenizer():
    """A word-level fast tokenizer with Qwen's special and vision tokens, each word one token, adding no special
    tokens (as Qwen2TokenizerFast), padding on the right."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *VISION]
    vocab = {word: i for i, word in enumerate([*special, *WORDS])}
    tokenizer = Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]"), behavior="removed", invert=True)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|endoftext|>", unk_token="<unk>",
                                   additional_special_tokens=special[1:]), vocab


def tiny_qwen3_vl(root: Path) -> None:
    """root/text_encoder/ (Qwen3-VL, 51 decoder layers of 16 features: minimax_h3_tiny's text_dim) and
    root/tokenizer/ (a word-level tokenizer with Qwen's special tokens)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer, vocab = tiny_tokenizer()
    torch.manual_seed(0)
    config = Qwen3VLConfig(
        text_config={"vocab_size": len(vocab), "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 51,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                     "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 16,
                       "deepstack_visual_indexes": [0]},
        image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"])
    Qwen3VLForConditionalGeneration(config).save_pretrained(root / "text_encoder")
    tokenizer.save_pretrained(root / "tokenizer")


MEAN, STD = (0.1, -0.2, 0.05, 0.0), (0.5, 1.5, 0.8, 1.2)  # away from 0 / 1 so that the normalisation is seen


def tiny_vae(folder: Path):
    """AutoencoderKLMiniMaxH3, tiny and random: 4 latent channels (model=minimax_h3_tiny's in_channels), 8x in space
    (each temporal downsampling beside a spatial one, as in the released config), 4x in time, the released
    clip_length 17 and token_drop 3."""
    from diffusers import AutoencoderKLMiniMaxH3

    torch.manual_seed(0)
    model = AutoencoderKLMiniMaxH3(
        latent_channels=4, block_out_channels=(8, 8, 8), layers_per_block=1, spatial_downsample_factors=(2, 2, 2),
        temporal_downsample_factors=(1, 2, 2), norm_num_groups=4, decoder_num_layers=1,
        decoder_num_attention_heads=2, decoder_attention_head_dim=8, decoder_num_register_tokens=1,
        decoder_ffn_mult=1, latents_mean=MEAN, latents_std=STD)
    model.save_pretrained(folder)
    return model.eval()


AUDIO_MEAN, AUDIO_STD = [0.1 * i for i in range(8)], [0.5 + 0.1 * i for i in range(8)]


def tiny_audio_vae(folder: Path, sampling_rate: int = 32000):
    """MiniMax-H3's audio VAE, tiny and random: 8 latent channels (model=minimax_h3_tiny's audio_in_channels), the
    released hop of 800 samples at 32 kHz in three strides, its latents_mean / std away from 0 / 1."""
    from diffusers import AutoencoderKLMiniMaxH3Audio

    torch.manual_seed(0)
    model = AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4, encoder_rates=(8, 10, 10), latent_dim=16, latent_channels=8, num_attention_heads=2,
        decoder_dim=16, decoder_rates=(8, 10, 10), decoder_kernel_sizes=(16, 20, 20), resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1,),), latents_mean=AUDIO_MEAN, latents_std=AUDIO_STD, sampling_rate=sampling_rate)
    model.save_pretrained(folder)
    return model.eval()
