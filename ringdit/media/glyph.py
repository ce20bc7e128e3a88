"""HunyuanVideo 1.5's glyph text (prepare's ``glyph_encoder``): the quoted text of each prompt, encoded by the ByT5 of
its pipeline as ``HunyuanVideo15Pipeline._get_byt5_prompt_embeds`` does. It is the pipeline's second text encoder,
beside the Qwen2.5-VL that ``prompt_template=hunyuan_video15`` reads (``TextEncoder(..., glyph_encoder=...)`` runs
both and returns both).

    glyph = GlyphEncoder("HunyuanVideo-1.5-Diffusers-480p_t2v", load=TextEncoder)  # its text_encoder_2/ + tokenizer_2/
    glyph(['a shop sign that reads "OPEN"', "a red fox"])
    # {"glyph_text": (2, 256, D) float32, "glyph_text_mask": (2, 256) bool}; the fox's: zero states, all masked

As the pipeline does: the text between straight or curly double quotes (diffusers' own ``extract_glyph_texts``: each
distinct text once, as ``Text "a". Text "b". ``) is tokenized by ByT5's byte tokenizer to 256 tokens (``</s>`` added,
truncated, padded), the encoder attends to the real tokens, and its last hidden states are kept on every position,
the padding's too (the transformer zeroes masked glyph tokens itself); the mask says which are real. A prompt without
quoted text -- the empty prompt, the null condition, among them -- has 256 zero states, all masked.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch

from ringdit.common.errors import ConfigError
from ringdit.media.pretrained import ENCODERS, find_folder

# the settings named in the errors of the TextEncoder that loads it (the length is the pipeline's, not a setting)
GLYPH_SETTINGS = ("glyph_encoder", "glyph_tokenizer", "glyph_encoder")


def glyph_length() -> int:
    """The pipeline's glyph tokens (256): the default of ``_get_byt5_prompt_embeds``' ``tokenizer_max_length``, read
    from diffusers' code (the pipeline passes its ``tokenizer_2_max_length``, the same 256)."""
    from diffusers import HunyuanVideo15Pipeline

    parameters = inspect.signature(HunyuanVideo15Pipeline._get_byt5_prompt_embeds).parameters
    return int(parameters["tokenizer_max_length"].default)


def glyph_texts(prompts: list[str]) -> list[str | None]:
    """Each prompt's glyph text as the pipeline formats it, None where it quotes nothing."""
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import extract_glyph_texts

    return [extract_glyph_texts(prompt) for prompt in prompts]


class GlyphEncoder:
    """ByT5 (a ``T5EncoderModel``) and its ``ByT5Tokenizer`` from local folders (see the module docstring):
    ``glyph_encoder`` is a HunyuanVideo 1.5 pipeline folder (its ``text_encoder_2/``) or the encoder's own folder;
    ``glyph_tokenizer`` defaults to ``tokenizer_2/`` beside ``text_encoder_2/`` (else the encoder's folder).
    ``load``: the class that loads text encoders, ``ringdit.media.text.TextEncoder``, handed in by the TextEncoder
    that holds this one (so that neither module imports the other)."""

    def __init__(self, glyph_encoder: str | Path, glyph_tokenizer: str | Path | None = None, *,
                 load, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        folder = find_folder(glyph_encoder, "text_encoder_2", "config.json", "glyph_encoder")
        model_type = _model_type(folder)
        if model_type != "t5":  # before its weights load: another pipeline part passed by mistake
            kind = ENCODERS.get(model_type) or (f"model_type {model_type!r}" if model_type else
                                                "no transformers model (its config.json has no model_type)")
            raise ConfigError(f"glyph_encoder={glyph_encoder}: {folder} holds {kind}, not the T5EncoderModel (ByT5) "
                              f"HunyuanVideo 1.5 encodes glyph text with; pass its pipeline folder or its "
                              f"text_encoder_2/")
        self.length = glyph_length()
        # ``load`` (ringdit.media.text.TextEncoder, which holds this encoder) loads it as any text encoder:
        # safetensors checked first, its tokenizer found beside it
        loaded = load(folder, glyph_tokenizer, max_len=self.length, device=device, dtype=dtype, settings=GLYPH_SETTINGS)
        self.model, self.tokenizer, self.dim, self.device = loaded.model, loaded.tokenizer, loaded.dim, loaded.device
        self.folder, self.tokenizer_folder = loaded.folder, loaded.tokenizer_folder
        if type(self.tokenizer).__name__ != "ByT5Tokenizer":  # another tokenizer's ids would be the wrong bytes
            raise ConfigError(f"glyph_tokenizer={glyph_tokenizer or self.tokenizer_folder} is "
                              f"{type(self.tokenizer).__name__}, not the ByT5Tokenizer HunyuanVideo 1.5's glyph "
                              f"encoder reads; pass its pipeline's tokenizer_2/ folder")

    @torch.no_grad()
    def __call__(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        texts = glyph_texts(prompts)
        states = torch.zeros(len(prompts), self.length, self.dim)  # (N, G, D): zero where nothing is quoted
        mask = torch.zeros(len(prompts), self.length, dtype=torch.bool)  # (N, G)
        quoted = [i for i, text in enumerate(texts) if text is not None]
        if quoted:
            tokens = self.tokenizer([texts[i] for i in quoted], padding="max_length", max_length=self.length,
                                    truncation=True, add_special_tokens=True, return_tensors="pt")
            real = tokens.attention_mask.to(self.device)
            out = self.model(input_ids=tokens.input_ids.to(self.device), attention_mask=real.float())  # as the pipeline
            states[quoted] = out.last_hidden_state.float().cpu()  # every position kept, the padding's too
            mask[quoted] = real.bool().cpu()
        return {"glyph_text": states, "glyph_text_mask": mask}

    def describe(self) -> dict:
        """What a shard's ``text_encoder`` metadata records of it (``glyph_encoder``)."""
        return {"class": type(self.model).__name__, "path": str(self.folder.resolve()),
                "tokenizer": str(self.tokenizer_folder.resolve()), "max_len": self.length, "dim": self.dim}


def _model_type(folder: Path) -> str | None:
    try:  # plain JSON data: nothing in it is run
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None
