"""Prompt encoding with local transformers text encoders: what prepare stores and what infer conditions on.

    encoder = TextEncoder("path/to/Wan2.1-T2V", max_len=512)   # text_encoder/ + tokenizer/ subfolders, or the folders
    cond = encoder(["a red fox running"])   # {"text": (N, L, D) float32, "text_mask": (N, L) bool[, "pooled": (N, P)]}
    flux = TextEncoder("FLUX.1-dev/text_encoder_2", pooled_encoder="FLUX.1-dev")  # T5 -> text, CLIP -> pooled

As WanPipeline does (``masked=True``, the default with one encoder): the prompt is tokenized to ``max_len`` tokens
(truncated), the encoder attends to the real tokens only, its last hidden states are kept on the real tokens and set
to zero after them, and the mask says which tokens are real. CLIP text models also give ``pooled`` (their pooled
output). The empty prompt ``""`` is the null condition.

Two encoders (``pooled_encoder``, Flux's CLIP + T5 pair), as ``FluxPipeline.encode_prompt`` does: ``text`` is the
first encoder's (T5, ``max_len`` tokens, 512 for Flux) last hidden states and ``pooled`` the CLIP's pooled output
(``max_pooled_len`` tokens, 77); both encoders run over the padded tokens WITHOUT an attention mask and every state
is kept (``masked=False``, the default with a pooled encoder), since Flux's transformer attends to all ``max_len``
text tokens: ``text_mask`` is then all True. (CLIP is causal and pools at its end-of-text token, so the padding after
it never changes ``pooled`` either way.)

A chat model (``prompt_template``, ``ChatTemplate``): the prompt goes into its pipeline's chat template, the encoder
attends to the real tokens, and ``text`` is the hidden states of the template's layers joined per token:
    hunyuan_video15   Qwen2.5-VL, HunyuanVideo15Pipeline._get_mllm_prompt_embeds: the third-last layer's states, the
                      template's 108 leading tokens cut off, zero after the real tokens (masked)
    qwenimage         Qwen2_5_VLForConditionalGeneration, QwenImagePipeline._get_qwen_prompt_embeds: its prompt string
                      (prompt_template_encode, tokenized as it is), the last hidden states, the template's 34 leading
                      tokens dropped, zero after the real tokens (masked)
    flux2             Mistral3ForConditionalGeneration, Flux2Pipeline._get_mistral_3_small_prompt_embeds: layers 10,
                      20 and 30 joined (D = 3 x hidden size; 15360 for FLUX.2-dev), nothing cut off, every state
                      kept and ``text_mask`` all True, since Flux2Pipeline hands its transformer all ``max_len``
                      states with no mask
``masked_text`` true / false overrides the template's choice of zeroing the states after the real tokens.

A glyph encoder (``glyph_encoder``, HunyuanVideo 1.5's ByT5, with ``prompt_template=hunyuan_video15``): the
pipeline's second text encoder, over the prompt's quoted text; it adds ``glyph_text`` (N, 256, D_byt5) and
``glyph_text_mask`` (N, 256) as ``HunyuanVideo15Pipeline._get_byt5_prompt_embeds`` gives them (ringdit/media/glyph.py).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Callable

import torch

from ringdit.common.errors import ConfigError, require_count
from ringdit.media.edit_prompt import EditPromptEncoder, edit_template
from ringdit.media.glyph import GlyphEncoder
from ringdit.media.text_connectors import LTX2Connectors, check_connector_encoder
from ringdit.media.pretrained import ENCODERS, REMOTE_CODE, find_folder
from ringdit.models.diffusers.families import chat_templates, connector_templates, edit_templates
from ringdit.models.diffusers.family import ChatTemplate
from ringdit.models.diffusers.folders import check_weights_folder
from ringdit.common.safe_json import read_json

TEXT_SETTINGS = ("text_encoder", "tokenizer", "max_text_len")  # the prepare settings named in errors
POOLED_SETTINGS = ("pooled_encoder", "pooled_tokenizer", "max_pooled_len")


def chat_template(name: str | None) -> ChatTemplate | None:
    """The ``ChatTemplate`` of the pipeline of family ``name`` (its ``Family.chat_template``)."""
    connectors = connector_templates()  # LTX-2's: no chat; Gemma 3 + its connectors (media/text_connectors.py)
    if name is None or name in connectors:
        return None
    templates = chat_templates()
    if name not in templates:
        names = ", ".join([*templates, *connectors])
        raise ConfigError(f"prompt_template={name!r} is not one of {names}; pass "
                          f"the family whose "
                          f"pipeline's text encoder you give (its chat template), or null for an encoder that takes "
                          f"the prompt as it is (T5, UMT5, CLIP)")
    return templates[name]()


def check_pooled_settings(pooled_encoder, pooled_tokenizer, masked) -> None:
    """One-line errors for the second encoder's settings, before anything is loaded."""
    if pooled_encoder is None and pooled_tokenizer is not None:
        raise ConfigError(f"pooled_tokenizer={pooled_tokenizer} is the tokenizer of pooled_encoder, which is not "
                          f"set; pass pooled_encoder=<CLIP text model folder> too, or drop pooled_tokenizer")
    if masked is not None and not isinstance(masked, bool):
        raise ConfigError(f"masked_text must be true, false or null, got {masked!r}; null = true with one text "
                          f"encoder (Wan), false with pooled_encoder (Flux)")


def check_glyph_settings(glyph_encoder, glyph_tokenizer, prompt_template) -> None:
    """One-line errors for the glyph encoder's settings, before anything is loaded: its tokenizer alone, or a glyph
    encoder for a pipeline that encodes no glyph text."""
    if glyph_encoder is None:
        if glyph_tokenizer is not None:
            raise ConfigError(f"glyph_tokenizer={glyph_tokenizer} is the tokenizer of glyph_encoder, which is not set; "
                              f"pass glyph_encoder=<HunyuanVideo 1.5 pipeline folder> too, or drop glyph_tokenizer")
        return
    template = chat_template(prompt_template)
    if template is None or not template.glyph:
        raise ConfigError(f"glyph_encoder={glyph_encoder} encodes a prompt's quoted text as HunyuanVideo 1.5's "
                          f"pipeline does (its ByT5), but prompt_template={prompt_template or 'null'}; pass "
                          f"prompt_template=hunyuan_video15 with its Qwen2.5-VL text_encoder, or drop glyph_encoder")


class TextEncoder:
    """Tokenizer + encoder from local folders; ``tokenizer`` defaults to the text encoder's folder (or its
    pipeline's tokenizer folder: ``tokenizer/`` beside ``text_encoder/``, ``tokenizer_2/`` beside
    ``text_encoder_2/``). ``pooled_encoder`` (a CLIP text model folder, or a pipeline folder with ``text_encoder/``):
    ``pooled`` from it, as Flux takes it (see the module docstring); ``masked`` None: True with one encoder, False
    with a pooled encoder (each as its pipeline does). ``glyph_encoder`` (with ``prompt_template=hunyuan_video15``):
    ``glyph_text`` / ``glyph_text_mask`` from HunyuanVideo 1.5's ByT5 (``ringdit.media.glyph.GlyphEncoder``)."""

    def __init__(self, text_encoder: str | Path, tokenizer: str | Path | None = None, *, max_len: int = 512,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 pooled_encoder: str | Path | None = None, pooled_tokenizer: str | Path | None = None,
                 max_pooled_len: int = 77, masked: bool | None = None,
                 prompt_template: str | None = None, glyph_encoder: str | Path | None = None,
                 glyph_tokenizer: str | Path | None = None, settings: tuple[str, str, str] = TEXT_SETTINGS,
                 clean: bool | None = None, processor: str | Path | None = None):
        import transformers

        setting, tokenizer_setting, length_setting = settings
        check_pooled_settings(pooled_encoder, pooled_tokenizer, masked)
        check_glyph_settings(glyph_encoder, glyph_tokenizer, prompt_template)
        self.template_name, self.template = prompt_template, chat_template(prompt_template)
        default = self.template.masked if self.template else pooled_encoder is None  # as each pipeline does
        self.masked = default if masked is None else masked
        folder = find_folder(text_encoder, "text_encoder", "config.json", setting)
        config = read_json(folder / "config.json", f"{setting}={text_encoder}: {folder / 'config.json'}", kind=dict,
                           fix="pass the folder save_pretrained wrote")
        model_type = config.get("model_type")
        if model_type not in ENCODERS:
            raise ConfigError(f"{setting}={text_encoder}: model_type {model_type!r} is not a supported text encoder "
                              f"({', '.join(sorted(ENCODERS))}); pass a T5, UMT5 or CLIP text model folder")
        check_connector_encoder(model_type, prompt_template, f"{setting}={text_encoder}")
        self._check_template(model_type, config, f"{setting}={text_encoder}")
        self.ltx2 = (LTX2Connectors(folder, config, max_len, f"{setting}={text_encoder}", device=device, dtype=dtype)
                     if prompt_template in connector_templates() else None)  # LTX-2: Gemma's states through its connectors
        # safetensors only, their headers checked first: a pickled .bin can run code, and infer.py may take this
        # folder from a checkpoint; a truncated file fails here in one line
        check_weights_folder(folder, setting=setting, value=text_encoder, class_name=ENCODERS[model_type],
                             library="transformers")
        try:
            self.model = getattr(transformers, ENCODERS[model_type]).from_pretrained(
                str(folder), dtype=dtype, use_safetensors=True, **REMOTE_CODE)
        except (OSError, ValueError, RuntimeError) as error:
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ConfigError(f"{setting}={text_encoder}: cannot load weights from {folder} ({first}); save it "
                              f"with save_pretrained (safetensors; .bin pickles are not loaded)") from None
        self.model.to(device).eval().requires_grad_(False)
        if tokenizer is None:  # a pipeline keeps it beside the encoder (tokenizer/, tokenizer_2/), a bare folder inside
            beside = folder.parent / (folder.name.replace("text_encoder", "tokenizer")
                                      if folder.name.startswith("text_encoder") else "tokenizer")
            tokenizer = next((c for c in (beside, folder) if (c / "tokenizer_config.json").is_file()), folder)
        tokenizer_folder = find_folder(tokenizer, "tokenizer", "tokenizer_config.json", tokenizer_setting)
        # a chat model's pipeline may load a processor here (Flux.2's PixtralProcessor); for text alone it renders
        # the same template and tokenizes with this tokenizer, adding no special tokens when the template starts with
        # BOS (Mistral's does), as the tokenizer's apply_chat_template never adds them: the same ids
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_folder), **REMOTE_CODE)
        except (OSError, ValueError, TypeError, KeyError) as error:  # an empty or broken tokenizer.json, vocab file
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ConfigError(f"{tokenizer_setting}={tokenizer_folder}: cannot load its tokenizer ({first}); pass the "
                              f"folder the pipeline's tokenizer save_pretrained wrote") from None
        if self.template is not None and self.template.text is None and not getattr(self.tokenizer, "chat_template",
                                                                                     None):
            raise ConfigError(f"{tokenizer_setting}={tokenizer_folder} has no chat template (chat_template.jinja or "
                              f"in tokenizer_config.json), which prompt_template={self.template.name} puts the prompt "
                              f"in; pass the pipeline's own tokenizer/ folder")
        text_config = self.model.config.get_text_config()  # a chat model's language part (Mistral3's text_config)
        limit = getattr(text_config, "max_position_embeddings", None)
        require_count(length_setting, max_len)
        cropped = self.template.crop if self.template else 0  # the template's tokens come first, then are cut off
        if limit is not None and max_len + cropped > limit:
            limit -= cropped
            raise ConfigError(f"{length_setting}={max_len} is longer than {ENCODERS[model_type]} takes ({limit} "
                              f"positions{' after the template' if cropped else ''}); pass {length_setting}={limit} "
                              f"or less")
        self.folder, self.tokenizer_folder = folder, tokenizer_folder
        self.clean = pipeline_cleans_prompts(folder) if clean is None else bool(clean)
        self.max_len, self.device = max_len, torch.device(device)
        self.pooled = model_type.startswith("clip")
        self.dim = int(getattr(text_config, "d_model", None) or text_config.hidden_size)
        if self.template is not None:  # the template's layers joined per token
            self.dim *= len(self.template.layers)
        if self.ltx2 is not None:  # the video connector's states
            self.dim = self.ltx2.dim
        self.pooled_encoder = None
        if pooled_encoder is not None:
            self.pooled_encoder = TextEncoder(pooled_encoder, pooled_tokenizer, max_len=max_pooled_len,
                                              device=device, dtype=dtype, masked=False, settings=POOLED_SETTINGS)
            if not self.pooled_encoder.pooled:
                raise ConfigError(f"pooled_encoder={pooled_encoder} is {type(self.pooled_encoder.model).__name__}, "
                                  f"which has no pooled output; pass a CLIP text model folder (Flux: its "
                                  f"text_encoder/, or the pipeline folder)")
            self.pooled = True
        self.glyph_encoder = None
        if glyph_encoder is not None:  # the pipeline's second encoder, over the prompt's quoted text
            self.glyph_encoder = GlyphEncoder(glyph_encoder, glyph_tokenizer, device=device, dtype=dtype,
                                              load=TextEncoder)  # its ByT5 loads as any text encoder does
        self.edit = None
        if self.template is not None and self.template.edit_pipeline:  # each prompt with its reference image
            self.edit = EditPromptEncoder(self, processor or folder.parent / "processor", edit_template(self.template))
        elif processor is not None:
            raise ConfigError(f"processor={processor} is the image processor of an edit pipeline's prompts, but "
                              f"prompt_template={prompt_template}; pass prompt_template="
                              f"{' or '.join(edit_templates())}, or drop processor")

    def _check_template(self, model_type: str, config: dict, given: str) -> None:
        """One-line errors, before the weights load, for a chat model without its template, a template with another
        kind of encoder, and an encoder too shallow for the template's layers."""
        template = self.template
        if template is None:
            if model_type == "mistral3":  # its logits are no text states: only Flux.2's template reads it
                raise ConfigError(f"{given} is Mistral3ForConditionalGeneration, Flux.2's chat text encoder, whose "
                                  f"states are read through its pipeline's template; pass prompt_template=flux2")
            return
        if template.model_types is not None and model_type not in template.model_types:
            raise ConfigError(f"prompt_template={template.name} is for {ENCODERS[template.model_types[0]]} (model_type "
                              f"{template.model_types[0]}), but {given} is {ENCODERS[model_type]}; pass that "
                              f"pipeline's text_encoder/ folder, or another prompt_template")
        layers = int((config.get("text_config") or config).get("num_hidden_layers") or 0)
        if layers and any(not -(layers + 1) <= index <= layers for index in template.layers):
            raise ConfigError(f"{given} has {layers} hidden layers, but prompt_template={template.name} reads the "
                              f"hidden states of layers {', '.join(map(str, template.layers))}; pass that pipeline's "
                              f"own text encoder")

    @torch.no_grad()
    def __call__(self, prompts: list[str], images: list | None = None) -> dict[str, torch.Tensor]:
        """{"text", "text_mask"[, "pooled", glyph text]} of ``prompts``; ``images``: one PIL reference image a prompt,
        which an edit pipeline's template (``prompt_template=qwenimage_edit``) encodes with it."""
        if (images is None) != (self.edit is None):
            raise ValueError(f"prompt_template={self.template_name} encodes each prompt with its reference image: "
                             f"give one a prompt" if self.edit is not None else
                             f"prompt_template={self.template_name} encodes the prompts alone, without images")
        if self.edit is not None:
            return self.edit([str(prompt) for prompt in prompts], images)
        return self.without_images(prompts)

    def without_images(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``prompts`` through the template alone, also with an edit pipeline's (Qwen-Image's prompt string): the
        empty prompt a data set keeps as its null condition."""
        if self.clean:  # as WanPipeline's encode_prompt: HTML entities, runs of whitespace (and ftfy where installed)
            from diffusers.pipelines.wan.pipeline_wan import prompt_clean

            prompts = [prompt_clean(prompt) for prompt in prompts]
        if self.ltx2 is not None:  # + audio_text (N, L, D_a)
            return self.ltx2(self.model, self.tokenizer, prompts, self.max_len, self.device)
        cond = self._templated(prompts) if self.template is not None else self._plain(prompts)
        if self.glyph_encoder is not None:  # + glyph_text (N, G, D_byt5), glyph_text_mask (N, G)
            cond.update(self.glyph_encoder(prompts))
        return cond

    def _plain(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The prompt as it is, tokenized to ``max_len``: masked (Wan) or every state kept (Flux) [+ pooled]."""
        tokens = self.tokenizer(list(prompts), padding="max_length", max_length=self.max_len, truncation=True,
                                add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
        if self.masked:  # WanPipeline: attend to the real tokens, zero the states after them
            out = self.model(input_ids=ids, attention_mask=mask)
            mask = mask.bool()
            text = out.last_hidden_state.float() * mask[..., None]  # (N, L, D), zero after the real tokens
        else:  # FluxPipeline: every token attended and kept, as its transformer reads them
            out = self.model(input_ids=ids)
            mask = torch.ones_like(mask, dtype=torch.bool)  # (N, L)
            text = out.last_hidden_state.float()  # (N, L, D)
        cond = {"text": text.cpu(), "text_mask": mask.cpu()}
        if self.pooled_encoder is not None:
            cond["pooled"] = self.pooled_encoder(prompts)["pooled"]  # (N, P) from the CLIP
        elif self.pooled:
            cond["pooled"] = out.pooler_output.float().cpu()  # (N, P)
        return cond

    def _templated(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """As the template's pipeline (``ChatTemplate``): its chats, ``max_len`` + the template's leading tokens, the
        encoder attending to the real tokens, the template's layers joined per token, its leading tokens cut off;
        then zero after the real tokens if ``masked``, else every state kept and the mask all True."""
        template = self.template
        length = {"padding": "max_length", "max_length": self.max_len + template.crop, "truncation": True,
                  "return_tensors": "pt"}
        if template.text is not None:  # the pipeline's own prompt string, tokenized as it does (Qwen-Image's)
            tokens = self.tokenizer([template.text.format(prompt) for prompt in prompts], **length)
        else:
            tokens = self.tokenizer.apply_chat_template(template.messages(prompts), tokenize=True, return_dict=True,
                                                        add_generation_prompt=template.generation_prompt, **length)
        ids, mask = tokens["input_ids"].to(self.device), tokens["attention_mask"].to(self.device)
        # a chat model with a language head: its logits for one token only, not L x its vocabulary (131k for Mistral)
        head = {"logits_to_keep": 1} if hasattr(self.model, "lm_head") else {}
        out = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False, **head)
        states = torch.cat([out.hidden_states[i] for i in template.layers], dim=-1)[:, template.crop:]  # (N, L, D)
        mask = mask[:, template.crop:].bool()  # (N, L)
        if not self.masked:  # Flux.2: its transformer reads every state, with no mask
            return {"text": states.float().cpu(), "text_mask": torch.ones_like(mask).cpu()}
        return {"text": (states.float() * mask[..., None]).cpu(), "text_mask": mask.cpu()}

    def describe(self) -> dict:
        """What a shard records as its ``text_encoder`` metadata key (so sampling can encode prompts the same way)."""
        info = {"class": type(self.model).__name__, "path": str(self.folder.resolve()),
                "tokenizer": str(self.tokenizer_folder.resolve()), "max_len": self.max_len, "dim": self.dim,
                "pooled": self.pooled, "masked": self.masked, "clean": self.clean}
        if self.template_name is not None:
            info["prompt_template"] = self.template_name
        if self.pooled_encoder is not None:
            pooled = self.pooled_encoder.describe()
            info["pooled_encoder"] = {key: pooled[key] for key in ("class", "path", "tokenizer", "max_len", "dim")}
        if self.glyph_encoder is not None:
            info["glyph_encoder"] = self.glyph_encoder.describe()
        if self.edit is not None:
            info["processor"] = str(self.edit.folder.resolve())
        if self.ltx2 is not None:
            info["connectors"] = str(self.ltx2.folder.resolve())
        return info

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


def data_text_encoder(data: dict, text_encoder: str | Path, tokenizer: str | Path | None = None, *,
                      device: str | torch.device = "cpu") -> TextEncoder:
    """The text encoder that reads prompts for a model trained on ``data`` (its ``describe()``): ``text_encoder`` /
    ``tokenizer`` set up as the data's prompts were encoded (``encoder_settings`` of its ``text_encoder`` record: the
    pooled encoder, the masking, a template, the glyph encoder), at the data's text length, its width checked."""
    encoder = TextEncoder(text_encoder, tokenizer, max_len=data["text_len"], device=device,
                          **encoder_settings(data.get("text_encoder") or {}))
    check_text_width(encoder, text_encoder, data["text_dim"])
    return encoder


def check_text_width(encoder: TextEncoder, text_encoder, text_dim: int) -> None:
    if encoder.dim != text_dim:
        raise ConfigError(f"text_encoder={text_encoder} gives {encoder.dim}-dim states but the model was trained on "
                          f"{text_dim}-dim text; pass the text encoder the training data was prepared with")


def pipeline_cleans_prompts(encoder_folder: Path) -> bool:
    """Whether the diffusers pipeline whose folder holds ``encoder_folder`` (``text_encoder/`` beside
    model_index.json) cleans each prompt before encoding it, as WanPipeline and SkyReelsV2Pipeline do (their module's
    ``prompt_clean``): read from diffusers' own pipeline module, so it is what that pipeline does. A bare encoder
    folder (no pipeline around it): False."""
    import diffusers  # here: prepare's start-up without diffusers' pipelines

    for folder in (encoder_folder.parent, encoder_folder):
        if (folder / "model_index.json").is_file():
            index = read_json(folder / "model_index.json", f"{folder / 'model_index.json'}", kind=dict,
                              fix="give the folder DiffusionPipeline.save_pretrained wrote")
            pipeline = getattr(diffusers, str(index.get("_class_name")), None)
            return pipeline is not None and hasattr(inspect.getmodule(pipeline), "prompt_clean")
    return False


def encoder_settings(described: dict) -> dict:
    """``TextEncoder.describe()`` (a shard's ``text_encoder`` metadata) -> the ``TextEncoder`` keywords beyond the
    text encoder itself that encode prompts as that shard's were: the pooled encoder, the masking, the template, the
    glyph encoder."""
    pooled, glyph = described.get("pooled_encoder") or {}, described.get("glyph_encoder") or {}
    settings = {"masked": described.get("masked")}  # absent (shards from before): None, the one-encoder default
    if "clean" in described:  # absent: what the encoder's pipeline does (TextEncoder's clean=None)
        settings["clean"] = described["clean"]
    if described.get("prompt_template"):
        settings["prompt_template"] = described["prompt_template"]
    if pooled:
        settings.update(pooled_encoder=pooled["path"], pooled_tokenizer=pooled.get("tokenizer"),
                        max_pooled_len=pooled.get("max_len", 77))
    if glyph:
        settings.update(glyph_encoder=glyph["path"], glyph_tokenizer=glyph.get("tokenizer"))
    if described.get("processor"):  # an edit pipeline's prompts, encoded with their reference images
        settings["processor"] = described["processor"]
    return settings
