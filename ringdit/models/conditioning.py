"""The conditioning vocabulary, one for the data that store it and the models that read it: what a data set says it
conditions on (its ``describe()``'s ``conditioning``), and the names of the text-conditioning tensors a shard of
``data=text_latents`` holds and a model takes (with their empty-prompt values, the null condition)."""

from __future__ import annotations

import math

from ringdit.common.errors import ConfigError

TEXT = "text"  # describe()["conditioning"] of data carrying prompts' text states; absent: class labels (or none)

# HunyuanVideo 1.5's glyph text, optional, per sample: the ByT5 states of the prompt's quoted text and their mask
GLYPH_KEYS = ("glyph_text", "glyph_text_mask")
# image-to-video conditioning, optional, per sample (ringdit.models.diffusers.image_to_video reads them)
IMAGE_KEYS = ("image_latents", "image_condition", "image_embeds")
# a control video's latents, optional, per sample (Wan VACE: ringdit.models.diffusers.wan_vace reads them)
CONTROL_KEY = "control"
# a reference image's latents, optional, per sample (Qwen-Image-Edit: ringdit.models.diffusers.qwenimage_edit reads them)
REFERENCE_KEY = "reference"
# a clip's sound as audio-VAE latents, optional, per sample: denoised with the video by a family that generates both
# (LTX-2's (N, C_audio, L, mel bins): ringdit.models.diffusers.ltx2, Family.joint_latents)
AUDIO_KEY = "audio"
# the per-sample tensors a shard may hold beside the text
SAMPLE_KEYS = (*IMAGE_KEYS, CONTROL_KEY, REFERENCE_KEY, AUDIO_KEY)
# a text condition key -> the name of the empty prompt's value (a shard's tensor, a model's buffer)
NULL_KEYS = {"text": "null_text", "text_mask": "null_text_mask", "pooled": "null_pooled",
             "glyph_text": "null_glyph_text", "glyph_text_mask": "null_glyph_text_mask",
             # LTX-2's audio prompt states (its text connectors' audio output), where a family reads them
             "audio_text": "null_audio_text"}


def text_conditioned(data: dict) -> bool:
    """Whether a model trained on ``data`` (a data module's ``describe()``, as a checkpoint records it) is prompted
    with text -- its prompts are encoded, its samples are named by captions -- rather than given class labels."""
    return data.get("conditioning") == TEXT


def check_guidance_scale(value, setting: str = "model.guidance") -> float | None:
    """A guidance embedding's input (Flux-dev's guidance, a DiT's ``guidance_embed``): None, or a finite number >= 0
    (the pipelines feed the scale as it is: 3.5 to sample Flux-dev, 1.0 to fine-tune it)."""
    if value is None:
        return None
    try:
        scale = float(value)
    except (TypeError, ValueError):
        scale = math.nan
    if isinstance(value, bool) or not math.isfinite(scale) or scale < 0:
        raise ConfigError(f"{setting}={value!r} is the guidance scale the model's guidance embedding is fed; it must be "
                          f"a finite number >= 0, e.g. {setting}=3.5 to sample Flux-dev or {setting}=1.0 to fine-tune")
    return scale
