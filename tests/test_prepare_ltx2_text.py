"""``python -m ringdit.prepare prompt_template=ltx2``: each caption encoded as ``LTX2Pipeline`` encodes its prompt --
Gemma 3's hidden states of every layer, stacked, then the pipeline's ``LTX2TextConnectors`` -- into the shards' video
prompt states (``text``), audio prompt states (``audio_text``) and their mask, the empty prompt's too; compared with
the pipeline's own ``encode_prompt`` + ``connectors`` on the same tiny random Gemma 3 and connectors; the shards train
``model=ltx2_tiny`` through train.py with each sample's audio states; infer.py's prompt encoder gives them too. A text
encoder that is not Gemma 3, a Gemma 3 without its connectors or without the template, and a length the connectors'
registers do not divide: one line each, and its advice works."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("av")

from ringdit.common.errors import ConfigError  # noqa: E402
from ringdit.media.encode_folder import encode_folder  # noqa: E402
from ringdit.media.text import TextEncoder  # noqa: E402
from tests.helpers import logged_losses, read_prepared, run  # noqa: E402
from tests.ltx2_helpers import FRAMES, SIZE, assert_refused, clips, ltx2, save_ltx2_video_vae  # noqa: E402, F401 - fixtures

VOCAB = ["<pad>", "<eos>", "<bos>", "<unk>", "a", "red", "fox", "running", "blue", "cat", "sky", "green", "field"]
CAPTIONS = ["a red fox running", "a blue cat", "  green field sky  ", "a cat running in a red field"]
TEXT_LEN = 8  # a multiple of the connectors' 4 registers


def gemma_tokenizer():
    """A Gemma-like fast tokenizer over VOCAB, built in code (no download): words, <bos> first as Gemma's adds it."""
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    ids = {w: i for i, w in enumerate(VOCAB)}
    tokenizer = Tokenizer(tokenizer_models.WordLevel(ids, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", ids["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def save_gemma_and_connectors(root: Path) -> None:
    """LTX-2's text encoder, tiny and random: Gemma3ForConditionalGeneration (hidden 16, 2 layers: 3 hidden states,
    a 1-layer SigLIP it never runs for text) in text_encoder/, its tokenizer in tokenizer/, and LTX2TextConnectors in
    connectors/ (16 x 3 features in, video and audio connectors of 2 heads x 8 = 16: model=ltx2_tiny's
    caption_channels; 4 learnable registers)."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    torch.manual_seed(0)
    text = Gemma3TextConfig(vocab_size=len(VOCAB), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                            sliding_window=4)
    vision = SiglipVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                image_size=16, patch_size=8)
    Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
                                   ).save_pretrained(root / "text_encoder")
    gemma_tokenizer().save_pretrained(root / "tokenizer")
    LTX2TextConnectors(caption_channels=16, text_proj_in_factor=3, video_connector_num_attention_heads=2,
                       video_connector_attention_head_dim=8, video_connector_num_layers=1,
                       video_connector_num_learnable_registers=4, audio_connector_num_attention_heads=2,
                       audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
                       audio_connector_num_learnable_registers=4, connector_rope_base_seq_len=32,
                       rope_type="split").save_pretrained(root / "connectors")


@pytest.fixture(scope="module")
def gemma_ltx2(ltx2, tmp_path_factory) -> Path:
    """The tiny LTX-2 pipeline folder (its video and audio VAEs) with Gemma 3, its tokenizer, the connectors and a
    vocoder."""
    root = tmp_path_factory.mktemp("ltx2_gemma") / "LTX-2"
    from diffusers.pipelines.ltx2 import LTX2Vocoder

    shutil.copytree(ltx2[0], root, ignore=shutil.ignore_patterns("text_encoder", "tokenizer"))
    save_gemma_and_connectors(root)
    # a vocoder of the audio VAE's 2 channels x 8 mel bins: infer.py decodes the sound with the data's audio VAE
    LTX2Vocoder(in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
                upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                output_sampling_rate=16000).save_pretrained(root / "vocoder")
    return root


@pytest.fixture(scope="module")
def captioned(clips, tmp_path_factory) -> Path:
    """The clips with the captions CAPTIONS (in file order)."""
    folder = tmp_path_factory.mktemp("captioned")
    for path, caption in zip(sorted(clips.glob("*.mp4")), CAPTIONS):
        shutil.copy(path, folder / path.name)
        (folder / path.name).with_suffix(".txt").write_text(caption)
    return folder


def pipeline(root: Path, dtype: torch.dtype):
    """LTX2Pipeline with the folder's text encoder, tokenizer and connectors (the other parts are not needed to
    encode prompts)."""
    from diffusers import LTX2Pipeline
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration

    return LTX2Pipeline(scheduler=None, vae=None, audio_vae=None, transformer=None, vocoder=None,
                        text_encoder=Gemma3ForConditionalGeneration.from_pretrained(root / "text_encoder", dtype=dtype),
                        tokenizer=AutoTokenizer.from_pretrained(root / "tokenizer"),
                        connectors=LTX2TextConnectors.from_pretrained(root / "connectors", torch_dtype=dtype))


@torch.no_grad()
def pipeline_states(pipe, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(video states, audio states, mask) as LTX2Pipeline.__call__ computes them: encode_prompt, then its connectors
    with the tokenizer's padding side."""
    embeds, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=TEXT_LEN,
                                            device=torch.device("cpu"))
    return pipe.connectors(embeds, mask, padding_side=pipe.tokenizer.padding_side)


def prepare(root: Path, clips: Path, out: Path, text_encoder: Path | None = None, **settings):
    settings = {"max_text_len": TEXT_LEN, "prompt_template": "ltx2", **settings}
    return encode_folder(str(clips), str(out), str(root), str(text_encoder or root), size=SIZE, frames=FRAMES,
                         audio_vae=str(root), progress=False, **settings)


def test_the_encoder_equals_ltx2pipeline_in_float64(gemma_ltx2):
    """TextEncoder(prompt_template=ltx2) in float64 = LTX2Pipeline's encode_prompt + connectors in float64 (the same
    operations on the same numbers: 1e-12 leaves room for a reordered sum only), the video and audio states differing
    (two connectors), the empty prompt included."""
    prompts = [*CAPTIONS, ""]
    encoder = TextEncoder(gemma_ltx2, max_len=TEXT_LEN, prompt_template="ltx2", dtype=torch.float64)
    ours = encoder(prompts)
    video, audio, mask = pipeline_states(pipeline(gemma_ltx2, torch.float64), prompts)
    assert ours["text"].dtype == torch.float64 and ours["text"].shape == (5, TEXT_LEN, 16) and encoder.dim == 16
    torch.testing.assert_close(ours["text"], video, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours["audio_text"], audio, rtol=0, atol=1e-12)
    assert torch.equal(ours["text_mask"], mask.bool())
    assert not torch.allclose(ours["text"], ours["audio_text"])
    assert encoder.describe()["prompt_template"] == "ltx2"


def test_prepare_stores_the_video_and_audio_prompt_states_as_ltx2pipeline_encodes_them(gemma_ltx2, captioned,
                                                                                         tmp_path):
    """The shards' text / audio_text / text_mask and the empty prompt's null_* = LTX2Pipeline's for the same captions
    in float32: the same float32 operations on the same batch of 4 captions (prepare's batch_size 4), so they agree
    to float32 rounding (1e-5 of states of size ~1); each sample's audio states its own."""
    prepare(gemma_ltx2, captioned, tmp_path / "out")
    tensors, _ = read_prepared(tmp_path / "out" / "shard-00000.safetensors")
    assert tensors["text"].shape == tensors["audio_text"].shape == (4, TEXT_LEN, 16)
    assert tensors["audio"].shape == (4, 2, 18, 2)
    pipe = pipeline(gemma_ltx2, torch.float32)
    video, audio, mask = pipeline_states(pipe, CAPTIONS)
    torch.testing.assert_close(tensors["text"], video, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tensors["audio_text"], audio, rtol=1e-5, atol=1e-5)
    assert torch.equal(tensors["text_mask"], mask.bool())
    null_video, null_audio, null_mask = pipeline_states(pipe, [""])  # the pipeline's default negative prompt
    torch.testing.assert_close(tensors["null_text"], null_video, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tensors["null_audio_text"], null_audio, rtol=1e-5, atol=1e-5)
    assert torch.equal(tensors["null_text_mask"], null_mask.bool())
    assert not torch.allclose(tensors["audio_text"][0], tensors["audio_text"][1])


def test_ltx2_trains_on_each_samples_audio_prompt_states_and_infer_encodes_them(gemma_ltx2, captioned, tmp_path,
                                                                                  monkeypatch):
    """The data module hands each sample's audio_text (not the empty prompt's) to the model, which keeps it for its
    audio stream (model_condition); the empty prompt's audio states become the model's null_audio_text; train.py
    trains model=ltx2_tiny 2 steps on them (finite losses); infer.py's prompt encoder (data_text_encoder, from the
    data's record) gives the same states for a caption, and infer.py samples with its prompt's and the empty prompt's
    audio states (guidance's two halves)."""
    from ringdit.data.text_latents import TextLatentsDataModule
    from ringdit.media.text import data_text_encoder
    from ringdit.models.diffusers import DiffusersTransformer, ltx2

    prepare(gemma_ltx2, captioned, tmp_path / "data")
    tensors, _ = read_prepared(tmp_path / "data" / "shard-00000.safetensors")
    data = TextLatentsDataModule(str(tmp_path / "data"), batch_size=2, val_fraction=0)
    described = data.describe()
    assert described["audio_text_dim"] == 16 and described["text_encoder"]["prompt_template"] == "ltx2"
    _, cond = data.build_dataset()[2]
    torch.testing.assert_close(cond["audio_text"], tensors["audio_text"][2].float())
    model = DiffusersTransformer(family="ltx2", config=dict(_tiny_config()), input_size=tuple(data.bucket_shapes[0]),
                                 in_channels=4, text_len=TEXT_LEN, text_dim=16)
    assert torch.equal(model.model_condition(cond)["audio_text"], cond["audio_text"])
    model.set_null_condition(data.null_condition())
    torch.testing.assert_close(model.null_audio_text[0], tensors["null_audio_text"][0].float())

    run("train.py", tmp_path / "run", "model=ltx2_tiny", "data=text_latents", f"data.path={tmp_path / 'data'}",
        "data.batch_size=2", "data.val_fraction=0", "trainer.max_steps=2", "logger=csv", "trainer.log_every_n_steps=1",
        "~callbacks.sample_grid")  # no previews (time): infer.py samples below
    losses = logged_losses(tmp_path / "run")
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses.values()), losses

    encoded = data_text_encoder(described, described["text_encoder"]["path"])([CAPTIONS[2]])
    torch.testing.assert_close(encoded["audio_text"][0], tensors["audio_text"][2].float(), rtol=1e-5, atol=1e-5)

    # infer.py (in this process): its prompt and the empty prompt reach the model with their audio states
    seen = []
    forward = ltx2.ltx2_forward
    monkeypatch.setattr(ltx2, "ltx2_forward", lambda *a, **k: seen.append(a[5].get("audio_text")) or forward(*a, **k))
    run("infer.py", tmp_path / "infer", f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}",
        f"prompts=[{CAPTIONS[2]}]", "num_samples=1", "diffusion.sampling.steps=2", "diffusion.sampling.cfg_scale=2",
        f"vae={save_ltx2_video_vae(tmp_path / 'decoder')}")
    assert (tmp_path / "infer" / "samples.npz").is_file() and seen and all(a is not None for a in seen)
    pair = seen[0].float().cpu()  # guidance's batch: the prompt and the empty prompt, each with its own audio states
    expected = (tensors["audio_text"][2].float(), tensors["null_audio_text"][0].float())
    matched = {i for row in pair for i, e in enumerate(expected) if torch.allclose(row, e, atol=1e-5)}
    assert pair.shape == (2, TEXT_LEN, 16) and matched == {0, 1}


def _tiny_config() -> dict:
    from tests.helpers import _preset_config

    return _preset_config("ltx2_tiny")


def test_a_text_encoder_that_is_not_ltx2s_is_refused_in_one_line_and_the_advice_works(ltx2, gemma_ltx2, captioned,
                                                                                       tmp_path):
    """prompt_template=ltx2 with a T5 (the pipeline folder's advice: pass LTX-2's own), a Gemma 3 folder without
    connectors/ beside it (pass the pipeline folder), a Gemma 3 without prompt_template=ltx2 (pass it) and a length
    the connectors' 4 registers do not divide (the length named): one line each; each advice prepares."""
    with pytest.raises(ConfigError, match=r"^prompt_template=ltx2 encodes prompts with its pipeline's "
                                          r"text encoder \(model_type gemma3\) .* has model_type 't5'; pass the ltx2 "
                                          r"pipeline folder") as raised:
        prepare(gemma_ltx2, captioned, tmp_path / "a", text_encoder=ltx2[0])
    assert "\n" not in str(raised.value)
    bare = tmp_path / "gemma"  # Gemma 3 and its tokenizer alone
    shutil.copytree(gemma_ltx2 / "text_encoder", bare / "text_encoder")
    shutil.copytree(gemma_ltx2 / "tokenizer", bare / "tokenizer")
    with pytest.raises(ConfigError, match=r"^prompt_template=ltx2: text_encoder=.*gemma has no connectors/ beside its "
                                          r"text encoder .*pass the LTX-2 pipeline folder as text_encoder="):
        prepare(gemma_ltx2, captioned, tmp_path / "b", text_encoder=bare)
    with pytest.raises(ConfigError, match=r"is the text encoder of ltx2's pipeline, whose states go through "
                                          r"its text connectors; pass prompt_template=ltx2$"):
        prepare(gemma_ltx2, captioned, tmp_path / "c", prompt_template=None)
    with pytest.raises(ConfigError, match=r"^max_text_len=6: LTX-2's connectors replace the padding with 4 learnable "
                                          r"registers .*pass max_text_len=4 "):
        prepare(gemma_ltx2, captioned, tmp_path / "d", max_text_len=6)
    assert prepare(gemma_ltx2, captioned, tmp_path / "ok", max_text_len=4).samples == 4  # the advice
    tensors, _ = read_prepared(tmp_path / "ok" / "shard-00000.safetensors")
    assert tensors["audio_text"].shape == (4, 4, 16)


def test_audio_prompt_states_for_a_model_that_does_not_read_them_are_refused(tmp_path):
    """Shards with audio_text for model=wan_tiny: one line naming audio_text and the family, before any rank starts;
    without them (the advice: prepare without prompt_template=ltx2) the same shards train."""
    from ringdit.data.text_latent_shards import write_text_latents
    from tests.helpers import prepare_train

    common = ["model=wan_tiny", "data=text_latents", "data.batch_size=2"]
    latents, text = torch.randn(4, 4, 2, 4, 4), torch.randn(4, 8, 16)
    write_text_latents(tmp_path / "with" / "shard-00000.safetensors", latents, text, audio_text=torch.randn(4, 8, 16))
    assert_refused(tmp_path / "a", [*common, f"data.path={tmp_path / 'with'}"],
                   r"the data hold audio prompt states \(audio_text, 16 wide.*model.family=wan does not read")
    write_text_latents(tmp_path / "without" / "shard-00000.safetensors", latents, text)
    prepare_train([*common, f"data.path={tmp_path / 'without'}", "logger=none"], tmp_path / "run")


def test_shards_with_and_without_audio_prompt_states_are_refused_naming_both(tmp_path):
    """A folder whose shards hold audio_text in one and none in another (captions encoded with two text encoders):
    one line naming both shards, before anything is built; the same folder without the stray shard trains."""
    from ringdit.data.text_latent_shards import write_text_latents
    from tests.helpers import prepare_train

    common = ["model=ltx2_tiny", "data=text_latents", "data.batch_size=2"]
    folder = tmp_path / "mixed"
    for index, audio_text in enumerate((torch.randn(4, 8, 16), None)):
        write_text_latents(folder / f"shard-0000{index}.safetensors", torch.randn(4, 4, 3, 4, 4), torch.randn(4, 8, 16),
                           image={"audio": torch.randn(4, 2, 5, 2)}, audio_text=audio_text)
    assert_refused(tmp_path / "a", [*common, f"data.path={folder}"],
                   r"shard-00001\.safetensors has audio prompt states \(L, D_a\) None but shard-00000\.safetensors "
                   r"has \(8, 16\)")
    (folder / "shard-00001.safetensors").unlink()
    prepare_train([*common, f"data.path={folder}", "logger=none"], tmp_path / "run")


def test_a_changed_caption_re_encodes_its_audio_prompt_states_too(gemma_ltx2, captioned, tmp_path):
    """prepare run again after a caption changed: only the text file is written again (ringdit/media/retext.py), its
    video and audio prompt states both those of the new caption, as LTX2Pipeline encodes it."""
    folder = tmp_path / "clips"
    shutil.copytree(captioned, folder)
    prepare(gemma_ltx2, folder, tmp_path / "out")
    before, _ = read_prepared(tmp_path / "out" / "shard-00000.safetensors")
    first = sorted(folder.glob("*.mp4"))[0]
    first.with_suffix(".txt").write_text("a blue sky")
    prepare(gemma_ltx2, folder, tmp_path / "out")
    after, _ = read_prepared(tmp_path / "out" / "shard-00000.safetensors")
    video, audio, _ = pipeline_states(pipeline(gemma_ltx2, torch.float32), ["a blue sky"])
    torch.testing.assert_close(after["text"][0], video[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after["audio_text"][0], audio[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after["audio_text"][0], before["audio_text"][0])
    assert torch.equal(after["audio_text"][1:], before["audio_text"][1:]) and torch.equal(after["audio"], before["audio"])
