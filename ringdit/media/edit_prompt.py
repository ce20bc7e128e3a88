"""Prompts encoded together with their reference image, as the Qwen-Image edit pipelines encode them
(``prompt_template=qwenimage_edit``: ``QwenImageEditPipeline``; ``qwenimage_edit_plus``:
``QwenImageEditPlusPipeline``, Qwen-Image-Edit-2509 / 2511). Their ``_get_qwen_prompt_embeds``:

- the reference image, resized as the pipeline resizes it for its prompt (``calculate_dimensions`` to about a
  megapixel for Edit, to 384 x 384's area for Edit Plus, at the image's aspect ratio, with ``VaeImageProcessor``'s
  Lanczos resize), goes into Qwen2.5-VL's vision tower through the pipeline folder's ``processor/`` (its
  ``Qwen2VLImageProcessor``: ``pixel_values``, ``image_grid_thw``);
- the prompt string is the pipeline's own template (``prompt_template_encode``) around the prompt, with the image's
  ``<|vision_start|><|image_pad|><|vision_end|>`` in it (Edit Plus: "Picture 1: ..." before the prompt), each
  ``<|image_pad|>`` expanded to the image's merged patches (``grid_thw.prod() // merge_size**2``) as
  ``Qwen2VLProcessor`` expands it, then tokenized;
- the text encoder (``Qwen2_5_VLForConditionalGeneration``) reads the tokens and the image, and the pipeline keeps
  its last hidden states on the real tokens, the template's ``prompt_template_encode_start_idx`` leading ones (64)
  dropped: the image's tokens and the prompt's remain.

The processor's expansion is done here rather than by ``Qwen2VLProcessor`` itself, which transformers builds only with
its video processor (torchvision); the image processor is the folder's own. The templates, the drop and the image
areas are read from diffusers' code when used (``edit_template``), so that they cannot drift; which pipeline a
``prompt_template`` name encodes as is its family's fact (``ChatTemplate.edit_pipeline`` of Qwen-Image-Edit's record).

``text`` is then ``(N, max_len, D)`` zero after each sample's real tokens and ``text_mask`` the real tokens, as
``TextEncoder`` stores every template; a prompt with its image longer than ``max_len`` is refused (the pipelines cut
nothing: the image's tokens would be lost).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

from ringdit.common.errors import ConfigError
from ringdit.media.pretrained import find_folder
from ringdit.models.diffusers.family import ChatTemplate

IMAGE_TOKEN = "<|image_pad|>"


@dataclass(frozen=True)
class EditTemplate:
    name: str
    text: str          # the pipeline's prompt string, "{}" where its prompt goes
    crop: int          # its leading tokens dropped (prompt_template_encode_start_idx)
    image_area: int    # the pixels the reference image is resized to for the prompt (at its aspect ratio)
    picture: str       # what goes before the prompt: Edit Plus's "Picture 1: <|vision_start|>...", else ""
    pipeline: str      # the pipeline class's name


def _assigned_constants(function) -> dict:
    """The literal assignments in ``function``'s code: ``self.x = "..."`` by attribute, ``x = "..."`` by name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            target = node.targets[0]
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
            if name is not None:
                found[name] = node.value.value
    return found


def edit_template(chat: ChatTemplate) -> EditTemplate:
    """The prompt encoding of the edit pipeline of ``chat`` (a family's ``ChatTemplate`` whose ``edit_pipeline`` is
    set: Qwen-Image-Edit's), read from that pipeline's code."""
    import diffusers

    name, pipeline = chat.name, getattr(diffusers, chat.edit_pipeline)
    module = inspect.getmodule(pipeline)
    constants = _assigned_constants(pipeline.__init__)
    encode = _assigned_constants(pipeline._get_qwen_prompt_embeds)
    plus = "img_prompt_template" in encode  # Edit Plus: its images named before the prompt
    area = module.CONDITION_IMAGE_SIZE if plus else 1024 * 1024  # Edit: calculate_dimensions(1024 * 1024, ...)
    return EditTemplate(name, constants["prompt_template_encode"], int(constants["prompt_template_encode_start_idx"]),
                        area, encode["img_prompt_template"].format(1) if plus else "", pipeline.__name__)


def prompt_image(image, template: EditTemplate):
    """A PIL reference image as the pipeline resizes it for its prompt: ``calculate_dimensions`` of the template's area
    at the image's aspect ratio, ``VaeImageProcessor.resize`` (Lanczos)."""
    import diffusers
    from diffusers.image_processor import VaeImageProcessor

    module = inspect.getmodule(getattr(diffusers, template.pipeline))
    width, height = module.calculate_dimensions(template.image_area, image.width / image.height)[:2]
    return VaeImageProcessor(vae_scale_factor=16).resize(image.convert("RGB"), height, width)


class EditPromptEncoder:
    """The prompts of a ``TextEncoder`` (its Qwen2.5-VL and tokenizer) encoded with one reference image each, as the
    edit pipeline ``template`` does; ``processor``: the pipeline folder's ``processor/`` (or the folder holding its
    ``preprocessor_config.json``)."""

    def __init__(self, encoder, processor: str | Path, template: EditTemplate, setting: str = "processor"):
        import transformers

        folder = find_folder(processor, "processor", "preprocessor_config.json", setting)
        try:
            self.image_processor = transformers.AutoImageProcessor.from_pretrained(str(folder))
        except (OSError, ValueError, TypeError, KeyError) as error:
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ConfigError(f"{setting}={processor}: cannot load its image processor ({first}); pass the edit "
                              f"pipeline folder (its processor/)") from None
        image_id = encoder.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        if image_id != getattr(encoder.model.config, "image_token_id", None):
            raise ConfigError(f"{setting}={processor}: the tokenizer's {IMAGE_TOKEN} is id {image_id} but the text "
                              f"encoder's image_token_id is {getattr(encoder.model.config, 'image_token_id', None)}; "
                              f"pass the edit pipeline's own text_encoder/, tokenizer/ and processor/")
        self.encoder, self.template, self.folder = encoder, template, folder

    @torch.no_grad()
    def __call__(self, prompts: list[str], images: list) -> dict[str, torch.Tensor]:
        """``prompts`` and one PIL reference image each -> {"text": (N, max_len, D), "text_mask": (N, max_len)}."""
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} reference images: one each")
        encoder, template = self.encoder, self.template
        pictures = [prompt_image(image, template) for image in images]
        vision = self.image_processor(images=pictures, return_tensors="pt")
        merged = vision["image_grid_thw"].prod(-1) // self.image_processor.merge_size ** 2  # (N,) image tokens each
        texts = [template.text.format(template.picture + prompt).replace(IMAGE_TOKEN, IMAGE_TOKEN * int(count), 1)
                 for prompt, count in zip(prompts, merged)]  # Qwen2VLProcessor's expansion, one image a text
        tokens = encoder.tokenizer(texts, padding=True, return_tensors="pt")
        ids, mask = tokens["input_ids"].to(encoder.device), tokens["attention_mask"].to(encoder.device)
        out = encoder.model(input_ids=ids, attention_mask=mask, pixel_values=vision["pixel_values"].to(encoder.device),
                            image_grid_thw=vision["image_grid_thw"].to(encoder.device), output_hidden_states=True,
                            use_cache=False, logits_to_keep=1)
        states = out.hidden_states[-1]  # (N, L, D)
        text = states.new_zeros(len(prompts), encoder.max_len, states.shape[-1])
        kept = torch.zeros(len(prompts), encoder.max_len, dtype=torch.bool)
        for i, (row, real) in enumerate(zip(states, mask.bool())):
            row = row[real][template.crop:]  # the sample's real tokens, the template's leading ones dropped
            if len(row) > encoder.max_len:
                raise ConfigError(f"max_text_len={encoder.max_len} is shorter than the prompt {prompts[i]!r} with its "
                                  f"reference image ({len(row)} tokens, {int(merged[i])} of the image, as "
                                  f"{template.pipeline} encodes them); pass max_text_len={len(row)} or more")
            text[i, :len(row)], kept[i, :len(row)] = row, True
        return {"text": text.float().cpu(), "text_mask": kept}
