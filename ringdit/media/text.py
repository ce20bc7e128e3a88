"""Prompt encoding with a local transformers text encoder: what prepare stores and what infer conditions on.

    encoder = TextEncoder("path/to/Wan2.1-T2V", max_len=512)   # text_encoder/ + tokenizer/ subfolders, or the folders
    cond = encoder(["a red fox running"])   # {"text": (N, L, D) float32, "text_mask": (N, L) bool[, "pooled": (N, P)]}

As WanPipeline does: the prompt is tokenized to ``max_len`` tokens (truncated), the encoder's last hidden states are
kept on the real tokens and set to zero after them, and the mask says which tokens are real. CLIP text models also
give ``pooled`` (their pooled output, as Flux consumes it). The empty prompt ``""`` is the null condition.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ringdit.errors import ConfigError, require_count
from ringdit.models.diffusers.folders import check_weights_folder

# config.json "model_type" -> the encoder-only class (a full T5 checkpoint also loads into its encoder)
ENCODERS = {"t5": "T5EncoderModel", "umt5": "UMT5EncoderModel", "clip_text_model": "CLIPTextModel",
            "clip": "CLIPTextModel", "clip_text_with_projection": "CLIPTextModel"}


def _folder(path, subfolder: str, marker: str, setting: str) -> Path:
    """``path/subfolder`` when it holds ``marker`` (a pipeline repo), else ``path`` when it does."""
    root = Path(str(path)).expanduser()
    if not root.exists():
        raise ConfigError(f"{setting}={path} does not exist; pass a local transformers folder (save_pretrained's)")
    for folder in (root / subfolder, root):
        if (folder / marker).is_file():
            return folder
    raise ConfigError(f"{setting}={path} has no {marker} (looked in {root / subfolder} and {root}); pass the folder "
                      f"save_pretrained wrote")


class TextEncoder:
    """Tokenizer + encoder from local folders; ``tokenizer`` defaults to the text encoder's folder (or its
    pipeline's ``tokenizer/`` subfolder)."""

    def __init__(self, text_encoder: str | Path, tokenizer: str | Path | None = None, *, max_len: int = 512,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        import transformers

        folder = _folder(text_encoder, "text_encoder", "config.json", "text_encoder")
        config = json.loads((folder / "config.json").read_text())
        model_type = config.get("model_type")
        if model_type not in ENCODERS:
            raise ConfigError(f"text_encoder={text_encoder}: model_type {model_type!r} is not a supported text encoder "
                              f"({', '.join(sorted(ENCODERS))}); pass a T5, UMT5 or CLIP text model folder")
        # safetensors only, their headers checked first: a pickled .bin can run code, and infer.py may take this
        # folder from a checkpoint; a truncated file fails here in one line
        check_weights_folder(folder, setting="text_encoder", value=text_encoder, class_name=ENCODERS[model_type],
                             library="transformers")
        try:
            self.model = getattr(transformers, ENCODERS[model_type]).from_pretrained(str(folder), dtype=dtype,
                                                                                     use_safetensors=True)
        except (OSError, ValueError, RuntimeError) as error:
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ConfigError(f"text_encoder={text_encoder}: cannot load weights from {folder} ({first}); save it "
                              f"with save_pretrained (safetensors; .bin pickles are not loaded)") from None
        self.model.to(device).eval().requires_grad_(False)
        if tokenizer is None:  # a pipeline keeps it beside the encoder (tokenizer/), a bare folder inside it
            candidates = (folder.parent / "tokenizer", folder)
            tokenizer = next((c for c in candidates if (c / "tokenizer_config.json").is_file()), folder)
        tokenizer_folder = _folder(tokenizer, "tokenizer", "tokenizer_config.json", "tokenizer")
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_folder))
        limit = getattr(self.model.config, "max_position_embeddings", None)
        require_count("max_text_len", max_len)
        if limit is not None and max_len > limit:
            raise ConfigError(f"max_text_len={max_len} is longer than {ENCODERS[model_type]} takes ({limit} "
                              f"positions); pass max_text_len={limit} or less")
        self.folder, self.tokenizer_folder = folder, tokenizer_folder
        self.max_len, self.device = max_len, torch.device(device)
        self.pooled = model_type.startswith("clip")
        self.dim = int(getattr(self.model.config, "d_model", None) or self.model.config.hidden_size)

    @torch.no_grad()
    def __call__(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        tokens = self.tokenizer(list(prompts), padding="max_length", max_length=self.max_len, truncation=True,
                                add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
        out = self.model(input_ids=ids, attention_mask=mask)
        mask = mask.bool()
        text = out.last_hidden_state.float() * mask[..., None]  # (N, L, D), zero after the real tokens
        cond = {"text": text.cpu(), "text_mask": mask.cpu()}
        if self.pooled:
            cond["pooled"] = out.pooler_output.float().cpu()  # (N, P)
        return cond

    def describe(self) -> dict:
        """What a shard records as its ``text_encoder`` metadata key (so sampling can encode prompts the same way)."""
        return {"class": type(self.model).__name__, "path": str(self.folder.resolve()),
                "tokenizer": str(self.tokenizer_folder.resolve()), "max_len": self.max_len, "dim": self.dim,
                "pooled": self.pooled}


def word_level_tokenizer(words: list[str] | tuple[str, ...]):
    """A T5-style fast tokenizer over a fixed word list, built in code (no download): whitespace-split words, ids in
    list order, ``</s>`` appended; the list must hold ``<pad>``, ``</s>`` and ``<unk>``. For small demos and tests."""
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    ids = {w: i for i, w in enumerate(words)}
    tokenizer = Tokenizer(tokenizer_models.WordLevel(ids, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", ids["</s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def encode_prompts(prompts: list[str], negative_prompt: str | None, text_encoder: str | Path,
                   tokenizer: str | Path | None = None, *, text_len: int, text_dim: int,
                   device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """infer.py's prompts: (cond (N, ...), negative (1, ...)) as the model was trained on them.

    ``text_len`` / ``text_dim`` are the training data's (its ``describe()``); the negative prompt defaults to the
    empty prompt, which is what the condition drop trained the model to read as "no condition".
    """
    encoder = TextEncoder(text_encoder, tokenizer, max_len=text_len, device=device)
    if encoder.dim != text_dim:
        raise ConfigError(f"text_encoder={text_encoder} gives {encoder.dim}-dim states but the model was trained on "
                          f"{text_dim}-dim text; pass the text encoder the training data was prepared with")
    if isinstance(prompts, str) or not prompts:
        raise ConfigError(f"prompts must be a non-empty list of strings, got {prompts!r}; e.g. prompts='[a red fox]'")
    return encoder([str(p) for p in prompts]), encoder([negative_prompt or ""])
