"""What infer.py's samples are conditioned on, from its ``InferSpec``: a class id each, or prompt embeddings -- read
from ``text_embeds``, the training data's held-out prompts, or ``prompts`` / a prompt file encoded with the data's
text encoder --, the negative prompt(s) guidance steers away from, and ``image=``'s first frames for image-to-video
(an edit model's reference image).
"""

from __future__ import annotations

import logging

import torch

from ringdit.data.datasets import data_source
from ringdit.data.text_latents import TextLatentsDataModule, read_prompts
from ringdit.common.errors import ConfigError
from ringdit.media.control_pixels import encode_control, encode_reference
from ringdit.media.frames import open_image
from ringdit.media.image_condition import first_frame_inputs
from ringdit.media.text import data_text_encoder
from ringdit.models.conditioning import CONTROL_KEY, REFERENCE_KEY
from ringdit.sampling.sampler import Codecs
from ringdit.spec import InferSpec

log = logging.getLogger("ringdit.infer")


def sample_conditions(spec: InferSpec) -> tuple[list | dict, list[str] | None, dict | None, tuple | None]:
    """(conditions of the ``num_samples`` samples: class ids, or a text model's tensors (with image-to-video's first
    frames), their captions (text models), the negative (1, ...) or None for the empty prompt, per-sample negatives
    or None: see ``text_conditions``)."""
    if spec.conditioning.labels is not None:
        return list(spec.conditioning.labels), None, None, None
    pictures = image_pictures(spec)
    count = spec.num_samples
    each = [pictures[i % len(pictures)] for i in range(count)] if pictures else None  # sample i: image i % n
    conditions, captions, negative, per_sample = text_conditions(spec, each)
    if spec.image is not None:  # image-to-video: the given first frames (else the held-out prompts' own)
        conditions = {**conditions, **image_conditions(spec, pictures, count)}
    if spec.control is not None:  # a control-video model: the given control clip, for every sample
        conditions = {**conditions, CONTROL_KEY: control_conditions(spec, spec.num_samples)}
    return conditions, captions, negative, per_sample


def text_conditions(spec: InferSpec, pictures: list | None = None) -> tuple[dict, list[str], dict | None,
                                                                            tuple | None]:
    """A text model's (conditions cycled to num_samples, captions, negative (1, ...) or None for the empty prompt,
    per-sample negatives or None: (each sample's negative prompt (N, ...), whether it has its own (N,)), from a
    prompt file's negative_prompt keys, or each sample's reference picture for an edit encoder). ``pictures``: each
    sample's ``image=`` picture, which an edit model's encoder reads with its prompts."""
    conditioning = spec.conditioning
    negative = per_sample = None
    conditions, captions = text_prompts(spec)
    if conditioning.prompts or conditioning.negative_prompt:
        conditions, captions, negative, per_sample = encoded_prompts(spec, conditions, captions, pictures)
    if conditioning.negative_text_embeds:
        negative_prompts, _ = read_prompts(conditioning.negative_text_embeds, "negative_text_embeds")
        negative = {key: value[:1] for key, value in negative_prompts.items()}  # the first row
        check_prompt_shape("negative_text_embeds", negative, spec.data)
    return conditions, captions, negative, per_sample


def image_pictures(spec: InferSpec) -> list | None:
    """``image=``'s pictures, one a file, read upright as prepare reads frames; None without ``image=``."""
    from PIL import ImageOps

    if spec.image is None:
        return None
    pictures = []
    for file in spec.image.files:  # each was opened and its aspect ratio checked by the spec
        with open_image(file) as opened:  # upright as stored (a phone photo's EXIF rotation), as prepare reads it
            pictures.append(ImageOps.exif_transpose(opened).convert("RGB"))
    return pictures


def image_conditions(spec: InferSpec, pictures: list, count: int) -> dict[str, torch.Tensor]:
    """``image=``'s first-frame conditioning of ``count`` samples (sample i: picture i % len(pictures), each file's
    picture from ``image_pictures``), as ``ringdit.media.image_condition.first_frame_inputs`` encodes them."""
    image = spec.image
    picked = [i % len(pictures) for i in range(count)]
    if image.kind == "reference":  # an edit model: the reference image's latents, as prepare reference= encodes them
        return {REFERENCE_KEY: encode_reference(pictures, vae=spec.output.vae, size=image.size)[picked]}
    encoded = first_frame_inputs(pictures, size=image.size, frames=image.frames, latent=image.latent,
                                 vae=spec.output.vae, image_encoder=image.image_encoder,
                                 channels=spec.data["channels"], setting=f"image={image.files[0]}")
    return {key: value[picked] for key, value in encoded.items()}


def control_conditions(spec: InferSpec, count: int) -> torch.Tensor:
    """``control=``'s clip encoded with the data's VAE as the model's control input, (count, C_vace, T', h, w)."""
    control = spec.control
    encoded = encode_control(control.file, vae=spec.output.vae, size=control.size, frames=control.frames,
                             temporal=control.temporal)  # (1, C_vace, T', h, w)
    return encoded.expand(count, *encoded.shape[1:]).clone()


def text_prompts(spec: InferSpec) -> tuple[dict, list[str]]:
    """``num_samples`` prompt embeddings (cycled): from ``text_embeds``, else the training data's held-out prompts."""
    conditioning, data_info = spec.conditioning, spec.data
    if conditioning.prompts:  # encoded in encoded_prompts
        return None, None
    if spec.pipeline:  # no held-out prompts; guidance's unconditional half is the empty prompt, encoded with them
        raise ConfigError(f"ckpt_path={spec.ckpt_path} is a diffusers pipeline folder: give the prompts to encode with "
                          f"its text encoder, prompts='[a red fox running]' (or prompt_file=)")
    if conditioning.text_embeds:
        prompts, captions = read_prompts(conditioning.text_embeds)
        count = next(iter(prompts.values())).shape[0]
        picked = [i % count for i in range(spec.num_samples)]
        prompts = {key: value[picked] for key, value in prompts.items()}
        captions = [captions[i] if captions else f"{conditioning.text_embeds}[{i}]" for i in picked]
    else:
        source = data_info["source"]
        try:
            # only its held-out prompts are read (and checked)
            data = TextLatentsDataModule(**data_source(source), check_values=False)
        except ValueError as error:
            raise ConfigError(f"text_embeds is not set and the training data's held-out prompts cannot be read "
                              f"({error}); give prompt embeddings with text_embeds=<file>") from None
        prompts, captions = data.held_out(spec.num_samples)
    check_prompt_shape("text_embeds", prompts, data_info)
    return prompts, captions


def encoded_prompts(spec: InferSpec, conditions, captions, pictures: list | None = None):
    """``prompts`` (or a prompt file's) / ``negative_prompt`` encoded with the spec's text encoder (the data's unless
    ``text_encoder=``), in one pass with a prompt file's own negative prompts: (conditions cycled to num_samples,
    captions, negative (1, ...) or None for the empty prompt, per-sample negatives or None; see text_conditions).
    An edit model's encoder reads each sample's prompt and negative prompt with its picture (``edit_prompts``)."""
    conditioning, data_info = spec.conditioning, spec.data
    texts = list(conditioning.prompts)[:spec.num_samples] or [""]  # a prompt file's lines past num_samples: unused
    if len(conditioning.prompts) > spec.num_samples:
        log.info("sampling the first %d of the %d prompts (num_samples=%d; num_samples=%d samples them all)",
                 spec.num_samples, len(conditioning.prompts), spec.num_samples, len(conditioning.prompts))
    negatives = conditioning.negative_prompts[:len(texts)]
    own = [text for text in dict.fromkeys(negatives) if text]  # a prompt file's, each once
    # the codecs' encoding, as the previews and the server encode theirs (here before any rank starts: no sampler
    # yet); the encoder as the data were prepared (Flux's CLIP pooled encoder, the masking, a template, HunyuanVideo
    # 1.5's glyph encoder)
    codecs = Codecs(text_encoder=data_text_encoder(data_info, conditioning.text_encoder, conditioning.tokenizer,
                                                   device="cuda" if torch.cuda.is_available() else "cpu"))
    if codecs.takes_images:
        return edit_prompts(spec, codecs, texts, negatives, pictures, conditions, captions)
    encoded, negative = codecs.encode(texts + own), codecs.encode([conditioning.negative_prompt or ""])
    check_prompt_shape("prompts", encoded, data_info)  # the glyph text too: its encoder's folder may have changed
    picked = [i % len(texts) for i in range(spec.num_samples)]
    if conditioning.prompts:
        conditions, captions = {key: value[:len(texts)][picked] for key, value in encoded.items()}, \
            [texts[i] for i in picked]
    per_sample = None
    if own:  # row len(texts) + k: the k-th distinct negative; a prompt without one takes row 0 (not read)
        rows = [len(texts) + own.index(negatives[i]) if negatives[i] else 0 for i in picked]
        per_sample = ({key: value[rows] for key, value in encoded.items()},
                      torch.tensor([bool(negatives[i]) for i in picked]))
    # a pipeline folder's unconditional half is the empty prompt it encodes
    return conditions, captions, negative if conditioning.negative_prompt or spec.pipeline else None, per_sample


def edit_prompts(spec: InferSpec, codecs: Codecs, texts: list[str], negatives, pictures: list | None, conditions,
                 captions):
    """``encoded_prompts`` for an edit model's encoder: sample i's prompt (texts[i % len(texts)]) and its negative
    prompt (its prompt file's own, else ``negative_prompt``, else the empty prompt) each encoded with sample i's
    picture, as QwenImageEditPipeline encodes its prompt and its negative prompt with the reference image; every
    sample's negative is its own (N, ...), so guidance steers each away from its picture's empty prompt."""
    conditioning, count = spec.conditioning, spec.num_samples
    picked = [i % len(texts) for i in range(count)]
    rows = [negatives[i] if i < len(negatives) and negatives[i] else conditioning.negative_prompt or ""
            for i in picked]
    negative = codecs.encode(rows, pictures)  # (N, ...): one line if no picture was given
    if conditioning.prompts:
        conditions, captions = codecs.encode([texts[i] for i in picked], pictures), [texts[i] for i in picked]
    check_prompt_shape("prompts", negative, spec.data)
    return conditions, captions, None, (negative, torch.ones(count, dtype=torch.bool))


def check_prompt_shape(setting: str, prompts: dict, data_info: dict) -> None:
    expected = (data_info["text_len"], data_info["text_dim"])
    if tuple(prompts["text"].shape[1:]) != expected:
        raise ConfigError(f"{setting}: the prompt embeddings are {tuple(prompts['text'].shape[1:])} (L, D) but the "
                          f"model was trained on {expected}; encode them with the same text encoder and length")
    glyph = (data_info.get("glyph_len"), data_info.get("glyph_dim"))  # HunyuanVideo 1.5's glyph text, if trained on
    given = tuple(prompts["glyph_text"].shape[1:]) if "glyph_text" in prompts else None
    if glyph[0] and given != glyph:  # without it, quoted text would be read as none
        raise ConfigError(f"{setting}: the model was trained with glyph text {glyph} (G, D: the ByT5 states of the "
                          f"prompts' quoted text) but the prompt embeddings have {given or 'none'}; encode them as "
                          f"the data were (prepare's glyph_encoder), or pass prompts=")
