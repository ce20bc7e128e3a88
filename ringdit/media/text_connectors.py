"""Prompt encoding through a pipeline's text connectors (``prompt_template=<family>`` of a family whose
``Family.text_connectors`` names its encoder: LTX-2's Gemma 3), as ``LTX2Pipeline`` encodes a prompt.

    LTX2Pipeline._get_gemma_prompt_embeds   the prompt stripped, tokenized to max_len tokens padded on the LEFT (the
                                            tokenizer's pad token, else its eos), Gemma3ForConditionalGeneration's
                                            hidden states of every layer (the embeddings' too) stacked per token:
                                            (N, L, hidden x (layers + 1))
    LTX2Pipeline.__call__ -> connectors     LTX2TextConnectors (the pipeline folder's connectors/): the per-layer
                                            masked mean / range normalisation, text_proj_in, then a video and an audio
                                            connector transformer (learnable registers in place of the padding) ->
                                            the video prompt states, the audio prompt states and their mask

``text`` is the video states, ``audio_text`` the audio states and ``text_mask`` the connectors' mask, which the
pipeline hands the transformer for both (all True where registers fill the padding). The connectors are frozen
encoders here: Lightricks' ltx-trainer runs them in every training step on cached Gemma features but never trains them
(``LtxvTrainer._load_models``: "embedding_connectors are already frozen"; its optimizer takes the transformer's
parameters alone), so their outputs are what a LoRA run of either trainer sees.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ringdit.common.errors import ConfigError
from ringdit.common.safe_json import read_json
from ringdit.models.diffusers.families import connector_templates
from ringdit.models.diffusers.folders import check_weights_folder


def check_connector_encoder(model_type: str | None, template: str | None, given: str) -> None:
    """One-line errors before any weights load: a connectors family's encoder (LTX-2's Gemma 3) without its
    ``prompt_template`` (its states mean nothing without the connectors), and that template with another encoder."""
    templates = connector_templates()  # {prompt_template: the encoder's model_type}
    if template in templates and model_type != templates[template]:
        raise ConfigError(f"prompt_template={template} encodes prompts with its pipeline's text encoder (model_type "
                          f"{templates[template]}) and its text connectors, but {given} has model_type "
                          f"{model_type!r}; pass the {template} pipeline folder (its text_encoder/, tokenizer/ and "
                          f"connectors/)")
    owners = [name for name, encoder in templates.items() if encoder == model_type]
    if template not in templates and owners:
        raise ConfigError(f"{given} is the text encoder of {owners[0]}'s pipeline, whose states go through its text "
                          f"connectors; pass prompt_template={owners[0]}")


class LTX2Connectors:
    """The pipeline's ``LTX2TextConnectors`` found beside the text encoder's folder (``connectors/``), checked against
    the encoder's width and the prompt length, then run on its hidden states."""

    def __init__(self, encoder_folder: Path, encoder_config: dict, max_len: int, given: str, *, device,
                 dtype: torch.dtype):
        """``encoder_config``: the text encoder's config.json (read before its weights load: every check here comes
        first)."""
        from diffusers.pipelines.ltx2 import LTX2TextConnectors  # here: prepare's start-up without diffusers' pipelines

        self.folder = encoder_folder.parent / "connectors"
        if not (self.folder / "config.json").is_file():
            raise ConfigError(f"prompt_template=ltx2: {given} has no connectors/ beside its text encoder (looked for "
                              f"{self.folder / 'config.json'}): LTX2Pipeline turns Gemma's states into the video and "
                              f"audio prompt states with them; pass the LTX-2 pipeline folder as text_encoder=")
        config = read_json(self.folder / "config.json", f"{given}: {self.folder / 'config.json'}", kind=dict,
                           fix="pass the folder LTX2Pipeline.save_pretrained wrote")
        features = int(config.get("caption_channels", 3840)) * int(config.get("text_proj_in_factor", 49))
        text_config = encoder_config.get("text_config") or {}
        hidden, layers = int(text_config.get("hidden_size", 0)), int(text_config.get("num_hidden_layers", 0))
        gemma = hidden * (layers + 1)
        if features != gemma:
            raise ConfigError(f"prompt_template=ltx2: {self.folder} takes {features} features a token "
                              f"(caption_channels x text_proj_in_factor) but {given}'s Gemma gives {gemma} (hidden "
                              f"size {hidden} x {layers + 1} hidden states); "
                              f"pass the text encoder and connectors of one LTX-2 pipeline folder")
        registers = [config.get(f"{stream}_connector_num_learnable_registers", 128) for stream in ("video", "audio")]
        step = max([r for r in registers if r] or [1])
        if any(r and max_len % r for r in registers):
            raise ConfigError(f"max_text_len={max_len}: LTX-2's connectors replace the padding with {step} learnable "
                              f"registers and take a multiple of {step} tokens; pass max_text_len="
                              f"{max(step, max_len // step * step)} (LTX2Pipeline's 1024)")
        check_weights_folder(self.folder, setting="text_encoder", value=given, class_name="LTX2TextConnectors",
                             library="diffusers")
        self.model = LTX2TextConnectors.from_pretrained(str(self.folder), torch_dtype=dtype)
        self.model.to(device).eval().requires_grad_(False)
        # the video prompt states' width (what the transformer's caption_channels is) and the audio's
        self.dim = int(config.get("video_connector_num_attention_heads", 30)) * \
            int(config.get("video_connector_attention_head_dim", 128))
        self.audio_dim = int(config.get("audio_connector_num_attention_heads", 30)) * \
            int(config.get("audio_connector_attention_head_dim", 128))

    def __call__(self, model, tokenizer, prompts: list[str], max_len: int, device) -> dict[str, torch.Tensor]:
        """{"text": (N, L, D) video states, "audio_text": (N, L, D_a) audio states, "text_mask": (N, L) bool} of
        ``prompts``, as LTX2Pipeline computes them (read from its ``_get_gemma_prompt_embeds`` and ``__call__``)."""
        tokenizer.padding_side = "left"  # Gemma's chat-style prompts, as the pipeline pads them
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokens = tokenizer([p.strip() for p in prompts], padding="max_length", max_length=max_len, truncation=True,
                           add_special_tokens=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
        # its language head's logits for one token only (the hidden states are the same): not L x its 262k vocabulary
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1)
        states = torch.stack(out.hidden_states, dim=-1).flatten(2, 3)  # (N, L, hidden x (layers + 1))
        video, audio, text_mask = self.model(states, mask, padding_side=tokenizer.padding_side)  # (N, L, D), (N, L)
        stored = torch.float64 if video.dtype == torch.float64 else torch.float32  # float64 kept (tests compare it)
        return {"text": video.to(stored).cpu(), "audio_text": audio.to(stored).cpu(),
                "text_mask": text_mask.bool().cpu()}
