"""``prompt_template=qwenimage_edit`` / ``qwenimage_edit_plus``: each prompt encoded with its reference image through
Qwen2.5-VL, equal to ``QwenImageEditPipeline.encode_prompt`` / ``QwenImageEditPlusPipeline.encode_prompt`` on a tiny
random Qwen2_5_VLForConditionalGeneration (a vision tower of one block) and its processor (``tests.edit_helpers``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from ringdit.common.errors import ConfigError
from ringdit.media.edit_prompt import edit_template
from ringdit.media.text import TextEncoder, chat_template, encoder_settings
from tests.edit_helpers import images, pipeline_encoding, save_edit_folder

os.environ["HF_HUB_OFFLINE"] = "1"
PROMPTS = ["a red fox", "a blue cat running sky green field", ""]


@pytest.fixture(scope="module")
def edit_folder(tmp_path_factory) -> Path:
    return save_edit_folder(tmp_path_factory.mktemp("qwenimage_edit"))


@pytest.mark.parametrize("name, pipeline", [("qwenimage_edit", "QwenImageEditPipeline"),
                                            ("qwenimage_edit_plus", "QwenImageEditPlusPipeline")])
def test_prompts_with_their_reference_images_are_the_pipelines(edit_folder, name, pipeline):
    """Each sample's states equal what the pipeline's call encodes for its prompt and image (one call each: the
    pipeline names every image it is given in every prompt; stopped once it has encoded them), on its real tokens;
    zero after them up to max_text_len; the mask the real tokens; the settings recorded for infer.py give the same
    encoder back."""
    encoder = TextEncoder(edit_folder, max_len=40, prompt_template=name)
    pictures = images(len(PROMPTS))
    cond = encoder(PROMPTS, pictures)
    assert cond["text"].shape == (3, 40, 16)
    for i, (prompt, picture) in enumerate(zip(PROMPTS, pictures)):
        embeds = pipeline_encoding(encoder, pipeline, prompt, picture)
        length = len(embeds)
        assert cond["text_mask"][i].tolist() == [True] * length + [False] * (40 - length)
        torch.testing.assert_close(cond["text"][i, :length], embeds, rtol=1e-5, atol=1e-6)
        assert not cond["text"][i, length:].any()
    # the images matter: another image, other states
    other = encoder(PROMPTS[:1], pictures[1:2])
    assert not torch.allclose(other["text"][0], cond["text"][0])
    described = encoder.describe()
    assert described["prompt_template"] == name and described["processor"]
    again = TextEncoder(edit_folder, max_len=40, **encoder_settings(described))
    torch.testing.assert_close(again(PROMPTS, pictures)["text"], cond["text"])


def test_an_edit_template_needs_the_images_and_room_for_them(edit_folder):
    encoder = TextEncoder(edit_folder, max_len=40, prompt_template="qwenimage_edit")
    with pytest.raises(ValueError, match="encodes each prompt with its reference image"):
        encoder(PROMPTS)
    short = TextEncoder(edit_folder, max_len=4, prompt_template="qwenimage_edit")
    with pytest.raises(ConfigError, match=r"max_text_len=4 is shorter than the prompt 'a red fox' with its reference "
                                          r"image \((\d+) tokens, \d+ of the image, as QwenImageEditPipeline encodes "
                                          r"them\); pass max_text_len=\1 or more") as refusal:
        short(PROMPTS[:1], images(1))
    needed = int(re.search(r"pass max_text_len=(\d+)", str(refusal.value)).group(1))
    TextEncoder(edit_folder, max_len=needed, prompt_template="qwenimage_edit")(PROMPTS[:1], images(1))
    with pytest.raises(ConfigError, match=r"processor=.* is the image processor of an edit pipeline's prompts, but "
                                          r"prompt_template=qwenimage; pass prompt_template=qwenimage_edit"):
        TextEncoder(edit_folder, max_len=40, prompt_template="qwenimage", processor=edit_folder / "processor")
    TextEncoder(edit_folder, max_len=40, prompt_template="qwenimage_edit", processor=edit_folder / "processor")


def test_a_tokenizer_without_the_encoders_image_token_is_refused(edit_folder, tmp_path):
    """Qwen-Image's text-only tokenizer (no vision tokens) with the edit encoder: one line; the folder's own works."""
    from tests.helpers import qwen_tokenizer

    qwen_tokenizer(edit_template(chat_template("qwenimage_edit")).text)[0].save_pretrained(tmp_path / "tokenizer")
    with pytest.raises(ConfigError, match=r"the tokenizer's <\|image_pad\|> is id \d+ but the text encoder's "
                                          r"image_token_id is \d+; pass the edit pipeline's own text_encoder/, "
                                          r"tokenizer/ and processor/"):
        TextEncoder(edit_folder, tmp_path / "tokenizer", max_len=40, prompt_template="qwenimage_edit")
    TextEncoder(edit_folder, edit_folder / "tokenizer", max_len=40, prompt_template="qwenimage_edit")


def test_prepare_encodes_each_caption_with_its_reference_image(models, edit_folder, tmp_path, capsys):
    """prepare prompt_template=qwenimage_edit reference=<folder>: each shard row's text is its caption encoded with its
    own reference image (the encoder proven equal to the pipeline's above); without reference= it is refused in one
    line before any model loads, and its advice works; changed captions (which prepare re-encodes alone) are refused
    in one line, whose advice works."""
    from PIL import Image
    from safetensors.torch import load_file

    from ringdit.data.text_latent_shards import text_file
    from ringdit.prepare import main as prepare

    pictures, captions = images(2), ["a red fox", "a blue cat"]
    folder, references = tmp_path / "images", tmp_path / "references"
    folder.mkdir()
    references.mkdir()
    for i, (picture, caption) in enumerate(zip(pictures, captions)):
        picture.save(references / f"{i}.png")
        picture.resize((picture.width // 4 * 4, picture.height // 4 * 4)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(caption)
    settings = [f"input={folder}", f"vae={models['flux']}", f"text_encoder={edit_folder}", "size=16",
                "max_text_len=40", "prompt_template=qwenimage_edit"]
    with pytest.raises(SystemExit) as refused:
        prepare([*settings, f"out={tmp_path / 'refused'}"])
    assert refused.value.code == 2
    assert re.search(r"^Error: prompt_template=qwenimage_edit encodes each caption with its reference image, as "
                     r"QwenImageEditPipeline does, but reference= is not set; pass reference=<folder of reference "
                     r"images>", capsys.readouterr().err, re.M)
    prepare([*settings, f"out={tmp_path / 'data'}", f"reference={references}"])
    path = next((tmp_path / "data").glob("shard-*.safetensors"))
    shard = load_file(text_file(path)) if text_file(path).exists() else load_file(path)  # the text's own file
    with Image.open(references / "0.png") as first, Image.open(references / "1.png") as second:
        expected = TextEncoder(edit_folder, max_len=40, prompt_template="qwenimage_edit")(
            captions, [first.convert("RGB"), second.convert("RGB")])
    # the shard's rows: its files in order
    torch.testing.assert_close(shard["text"].float(), expected["text"], rtol=1e-5, atol=1e-6)
    assert torch.equal(shard["text_mask"].bool(), expected["text_mask"])
    # new captions: the text alone cannot be encoded again (each caption needs its image): one line; a new out= works
    (folder / "1.txt").write_text("a green cat")
    with pytest.raises(SystemExit):
        prepare([*settings, f"out={tmp_path / 'data'}", f"reference={references}"])
    assert re.search(r"^Error: out=.*data: the captions of shard-\S+ changed, but prompt_template=qwenimage_edit "
                     r"encodes each with its reference image, which re-encoding only the text does not read; prepare "
                     r"into a new out= folder$", capsys.readouterr().err, re.M)
    prepare([*settings, f"out={tmp_path / 'new'}", f"reference={references}"])
