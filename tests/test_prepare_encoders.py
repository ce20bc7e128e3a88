"""Two text encoders into one shard (``pooled_encoder``, Flux's CLIP + T5): what ``python -m ringdit.prepare`` stores
is checked against diffusers' own ``FluxPipeline.encode_prompt`` on tiny random CLIP and T5 models, laid out as a Flux
pipeline folder (text_encoder/ + tokenizer/ = CLIP, text_encoder_2/ + tokenizer_2/ = T5)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from PIL import Image  # noqa: E402
from safetensors import safe_open  # noqa: E402

from ringdit.common.errors import ConfigError  # noqa: E402
from ringdit.media.encode_folder import encode_folder  # noqa: E402
from ringdit.media.text import TextEncoder, encoder_settings  # noqa: E402
from tests.helpers import TEXT_LEN, read_prepared, sampling_encoding, save_tiny_qwen, tiny_video_vae  # noqa: E402

CLIP_LEN = 16  # the tiny CLIP's positions (Flux's is 77)
CAPTIONS = ["a red fox", "a blue cat running", "green field"]


@pytest.fixture(scope="module")
def flux(models, tmp_path_factory) -> Path:
    """A Flux-shaped pipeline folder from the tiny models: vae/, CLIP text_encoder/ + tokenizer/, T5 text_encoder_2/
    + tokenizer_2/ (the T5 and CLIP share a word list; the CLIP's tokenizer says its length, as CLIP's does)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("flux") / "FLUX"
    shutil.copytree(models["flux"], root)
    shutil.copytree(models["wan"] / "text_encoder", root / "text_encoder_2")
    shutil.copytree(models["wan"] / "tokenizer", root / "tokenizer_2")
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    tokenizer.model_max_length = CLIP_LEN  # FluxPipeline pads CLIP prompts to its tokenizer's model_max_length
    tokenizer.save_pretrained(root / "tokenizer")
    return root


@pytest.fixture
def images(tmp_path) -> Path:
    folder = tmp_path / "images"
    folder.mkdir()
    for i, caption in enumerate(CAPTIONS):
        Image.new("RGB", (24, 16), (40 * i, 90, 200 - 30 * i)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(caption)
    return folder


def test_flux_pair_matches_flux_pipeline(flux, images, tmp_path):
    """text = FluxPipeline's prompt_embeds (T5, unmasked, every state kept), pooled = its pooled_prompt_embeds (CLIP),
    the empty prompt's too; text_mask all True (Flux attends every token); the shard records both encoders, and
    Codecs.encode with the recorded settings (infer.py.s prompts) gives the same."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    out = tmp_path / "out"
    report = encode_folder(str(images), str(out), str(flux), str(flux / "text_encoder_2"), size=16,
                           max_text_len=TEXT_LEN, pooled_encoder=str(flux), max_pooled_len=CLIP_LEN, progress=False)
    assert report.samples == 3
    tensors, metadata = read_prepared(out / "shard-00000.safetensors")
    described = json.loads(metadata["text_encoder"])
    assert described["class"] == "T5EncoderModel" and described["masked"] is False and described["pooled"] is True
    assert described["tokenizer"] == str((flux / "tokenizer_2").resolve())  # beside text_encoder_2/, not CLIP's
    assert described["pooled_encoder"] == {"class": "CLIPTextModel", "path": str((flux / "text_encoder").resolve()),
                                           "tokenizer": str((flux / "tokenizer").resolve()), "max_len": CLIP_LEN,
                                           "dim": 16}

    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, transformer=None,
                        text_encoder=CLIPTextModel.from_pretrained(flux / "text_encoder"),
                        tokenizer=AutoTokenizer.from_pretrained(flux / "tokenizer"),
                        text_encoder_2=T5EncoderModel.from_pretrained(flux / "text_encoder_2"),
                        tokenizer_2=AutoTokenizer.from_pretrained(flux / "tokenizer_2"))
    assert pipe.tokenizer_max_length == CLIP_LEN
    with torch.no_grad():
        text, pooled, _ = pipe.encode_prompt(CAPTIONS, device=torch.device("cpu"), max_sequence_length=TEXT_LEN)
        null_text, null_pooled, _ = pipe.encode_prompt([""], device=torch.device("cpu"), max_sequence_length=TEXT_LEN)
    assert text.shape == (3, TEXT_LEN, 16) and pooled.shape == (3, 16)
    assert text[0, -1].abs().max() > 0  # Flux keeps the states on the padding: what its transformer reads
    # the same models, tokens and kernels on one process; batches of 3 both ways: equal up to fp32 reordering
    torch.testing.assert_close(tensors["text"], text, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tensors["pooled"], pooled, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tensors["null_text"], null_text, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tensors["null_pooled"], null_pooled, rtol=1e-6, atol=1e-6)
    assert tensors["text_mask"].all() and tensors["null_text_mask"].all()

    cond, negative = sampling_encoding(described, CAPTIONS, text_len=TEXT_LEN, text_dim=16)
    torch.testing.assert_close(cond["text"], tensors["text"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cond["pooled"], tensors["pooled"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(negative["pooled"], tensors["null_pooled"], rtol=1e-6, atol=1e-6)


def test_masked_text_overrides_and_one_encoder_unchanged(flux, models):
    """masked_text=true with a pooled encoder: Wan's masking (zero after the real tokens); one encoder keeps it by
    default and records masked=True; an old description (no 'masked') encodes as before."""
    masked = TextEncoder(flux / "text_encoder_2", max_len=TEXT_LEN, pooled_encoder=flux, max_pooled_len=CLIP_LEN,
                         masked=True)
    cond = masked(["a red fox"])  # "a red fox </s>": 4 real tokens
    assert cond["text_mask"][0].tolist() == [True] * 4 + [False] * (TEXT_LEN - 4)
    assert cond["text"][0, 4:].abs().max() == 0 and cond["pooled"].shape == (1, 16)
    single = TextEncoder(models["wan"], max_len=TEXT_LEN)
    assert single.describe()["masked"] is True and "pooled_encoder" not in single.describe()
    assert encoder_settings({"path": "x", "tokenizer": "y"}) == {"masked": None}


def test_pooled_encoder_errors_are_one_line(flux, models, images, tmp_path):
    def run(**kwargs):
        encode_folder(str(images), str(tmp_path / "out"), str(flux), str(flux / "text_encoder_2"), size=16,
                      max_text_len=TEXT_LEN, progress=False, **kwargs)

    with pytest.raises(ConfigError, match=r"pooled_encoder=.*text_encoder_2 is T5EncoderModel, which has no pooled "
                                          r"output; pass a CLIP text model folder"):
        run(pooled_encoder=str(flux / "text_encoder_2"))
    with pytest.raises(ConfigError, match=r"max_pooled_len=77 is longer than CLIPTextModel takes \(16 positions\); "
                                          r"pass max_pooled_len=16 or less"):
        run(pooled_encoder=str(flux))
    with pytest.raises(ConfigError, match=r"pooled_tokenizer=.* pooled_encoder, which is not set"):
        run(pooled_tokenizer=str(flux / "tokenizer"))
    with pytest.raises(ConfigError, match=r"pooled_encoder=.*nowhere does not exist"):
        run(pooled_encoder=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=r"masked_text must be true, false or null, got 'yes'"):
        run(masked_text="yes")


# ---- the new families' video VAEs (LTX-Video, HunyuanVideo 1.5), normalised as their pipelines ---------------------


@pytest.mark.parametrize("name", ["ltx", "hunyuan_video15"])
def test_new_video_vaes_normalise_as_their_pipelines(name, models, tmp_path):
    """VAE.encode = the pipeline's normalised latents (LTXPipeline._normalize_latents with the model's buffers;
    HunyuanVideo 1.5: z * scaling_factor), the family's spatial / temporal factors; decode inverts it; prepare takes
    the VAE with a T5 (LTX's text encoder)."""
    from diffusers import LTXPipeline

    from ringdit.media.vae import VAE
    from tests.helpers import write_video

    model = tiny_video_vae(name, tmp_path / "vae")
    codec = VAE(tmp_path)  # a pipeline-shaped folder: vae/
    assert (codec.spatial, codec.temporal) == (4, 4 if name == "ltx" else 2)
    frames = 1 + 2 * codec.temporal
    pixels = torch.rand(1, 3, frames, 16, 16, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        raw = model.encode(pixels).latent_dist.mode()
        expected = LTXPipeline._normalize_latents(raw, model.latents_mean, model.latents_std,
                                                  model.config.scaling_factor) if name == "ltx" else \
            raw * model.config.scaling_factor  # HunyuanVideo15Pipeline decodes latents / scaling_factor
        decoded = model.decode(raw).sample.clamp(-1, 1)
    assert raw.shape == (1, model.config.latent_channels, 3, 4, 4)
    latents = codec.encode(pixels)
    torch.testing.assert_close(latents, expected, rtol=1e-5, atol=1e-5)  # the same model, fp32
    torch.testing.assert_close(codec.decode(latents), decoded, rtol=1e-4, atol=1e-4)  # through the inverse
    assert codec.describe()["temporal_compression"] == codec.temporal

    clips = tmp_path / "clips"
    clips.mkdir()
    write_video(clips / "a.mp4", frames, seed=1)
    (clips / "a.txt").write_text("a red fox")
    report = encode_folder(str(clips), str(tmp_path / "out"), str(tmp_path), str(models["wan"]), size=16,
                           frames=frames, max_text_len=TEXT_LEN, progress=False)
    assert report.samples == 1
    with safe_open(str(tmp_path / "out" / "shard-00000.safetensors"), framework="pt") as f:
        assert tuple(f.get_slice("latents").get_shape()) == (1, model.config.latent_channels, 3, 4, 4)


def test_hunyuan_video15_prompt_template_matches_the_pipeline(tmp_path):
    """prompt_template=hunyuan_video15 with a tiny random Qwen2.5-VL: text = HunyuanVideo15Pipeline's
    _get_mllm_prompt_embeds on the real tokens (its chat template, third-last hidden states, the template's tokens
    cut off), zero after them; text_mask = its mask; an unknown template is one line."""
    from diffusers import HunyuanVideo15Pipeline

    from ringdit.media.text import chat_template

    folder = tmp_path / "qwen"
    save_tiny_qwen(folder)
    template = chat_template("hunyuan_video15")
    system, crop = template.system, template.crop
    assert (crop, template.layers) == (108, (-3,)) and system.startswith("You are a helpful assistant. Describe the")

    encoder = TextEncoder(folder, max_len=TEXT_LEN, prompt_template="hunyuan_video15")
    cond = encoder(CAPTIONS + [""])
    with torch.no_grad():
        states, mask = HunyuanVideo15Pipeline._get_mllm_prompt_embeds(
            encoder.model, encoder.tokenizer, CAPTIONS + [""], torch.device("cpu"), tokenizer_max_length=TEXT_LEN,
            system_message=system, crop_start=crop)
    assert states.shape == (4, TEXT_LEN, 16) and mask.sum() > 0
    assert torch.equal(cond["text_mask"], mask.bool())
    torch.testing.assert_close(cond["text"], states * mask[..., None], rtol=1e-6, atol=1e-6)  # same model, fp32
    assert encoder.describe()["prompt_template"] == "hunyuan_video15"
    with pytest.raises(ConfigError, match=r"prompt_template='qwen3' is not one of qwenimage, qwenimage_edit, "
                                          r"qwenimage_edit_plus, hunyuan_video15, flux2"):
        TextEncoder(folder, max_len=TEXT_LEN, prompt_template="qwen3")
    with pytest.raises(ConfigError, match=r"max_text_len=200 is longer than Qwen2_5_VLTextModel takes \(148 "
                                          r"positions after the template\); pass max_text_len=148 or less"):
        TextEncoder(folder, max_len=200, prompt_template="hunyuan_video15")


# ---- Flux.2: its VAE (batch-norm statistics over 2x2 patches) and its Mistral3 chat encoder (prompt_template=flux2) --

FLUX2_LEN = 40  # Flux.2's template keeps its system message (about 25 words here) before the prompt: room for both
FLUX2_CHANNELS = 2  # the tiny VAE's latent channels (tests.helpers.save_tiny_flux2): 8 batch-norm statistics over
# its 2x2 patches


@pytest.fixture(scope="module")
def flux2(tmp_path_factory) -> Path:
    """A Flux.2-shaped pipeline folder (``tests.helpers.save_tiny_flux2``: ``FLUX2_CHANNELS`` latent channels)."""
    from tests.helpers import save_tiny_flux2

    return save_tiny_flux2(tmp_path_factory.mktemp("flux2") / "FLUX.2")


def flux2_pipeline(root: Path, transformer=None):
    """Flux2Pipeline over the fixture's folders, loaded as a user's pipeline loads them."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from transformers import AutoTokenizer, Mistral3ForConditionalGeneration

    return Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), transformer=transformer,
                         vae=AutoencoderKLFlux2.from_pretrained(root / "vae").eval(),
                         text_encoder=Mistral3ForConditionalGeneration.from_pretrained(root / "text_encoder").eval(),
                         tokenizer=AutoTokenizer.from_pretrained(root / "tokenizer"))


def test_flux2_vae_normalises_and_decodes_as_flux2_pipeline(flux2):
    """VAE.encode = Flux2Pipeline._encode_vae_image (mode, 2x2 patchify, the batch norm's mean / std) unpatchified to
    32 (here 2) channels, so that the flux2 family's packing gives the pipeline's very tokens; VAE.decode of what the
    pipeline samples (unpacked and unpatchified, as ringdit's model returns it) = the pipeline's own decoded images,
    through a two-step run of the real pipeline with a tiny transformer; sizes step by 8 x 2 pixels."""
    import diffusers
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    from ringdit.media.vae import VAE
    from ringdit.models.diffusers.packing import pack_latents
    from tests.helpers import architecture

    config = architecture("flux2_tiny")
    config["in_channels"] = 4 * FLUX2_CHANNELS  # the tokens are 2x2 patches of the VAE's channels
    torch.manual_seed(1)
    pipe = flux2_pipeline(flux2, diffusers.Flux2Transformer2DModel.from_config(config).eval())
    codec = VAE(flux2)  # a pipeline folder: vae/
    assert (codec.class_name, codec.spatial, codec.patch, codec.size_step) == ("AutoencoderKLFlux2", 2, 2, 4)
    assert codec.describe()["latent_channels"] == FLUX2_CHANNELS and len(codec.describe()["shift"]) == 8

    pixels = torch.rand(2, 3, 8, 12, generator=torch.Generator().manual_seed(2)) * 2 - 1
    latents = codec.encode(pixels)  # (2, 2, 4, 6): 2 channels at 1/2 the pixels
    with torch.no_grad():
        expected = pipe._encode_vae_image(pixels, generator=None)  # (2, 8, 2, 3): normalised 2x2 patches
    assert latents.shape == (2, FLUX2_CHANNELS, 4, 6) and expected.shape == (2, 4 * FLUX2_CHANNELS, 2, 3)
    torch.testing.assert_close(latents, Flux2Pipeline._unpatchify_latents(expected), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pack_latents(latents), Flux2Pipeline._pack_latents(expected), rtol=1e-6, atol=1e-6)

    text = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(3))
    run = dict(prompt_embeds=text, height=8, width=12, num_inference_steps=2, guidance_scale=4.0)
    with torch.no_grad():
        tokens = pipe(**run, generator=torch.Generator().manual_seed(4), output_type="latent").images  # (1, 6, 8)
        images = pipe(**run, generator=torch.Generator().manual_seed(4), output_type="pt").images  # (1, 3, 8, 12)
    sampled = Flux2Pipeline._unpatchify_latents(
        Flux2Pipeline._unpack_latents_with_ids(tokens, Flux2Pipeline._prepare_latent_ids(expected[:1])))
    assert sampled.shape == (1, FLUX2_CHANNELS, 4, 6)  # what ringdit's flux2 model samples
    torch.testing.assert_close(codec.decode(sampled) / 2 + 0.5, images.clamp(0, 1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"latents of 4x5 do not split into the VAE's 2x2 latent patches"):
        codec.decode(torch.zeros(1, FLUX2_CHANNELS, 4, 5))


def test_flux2_prepare_matches_flux2_pipeline(flux2, images, tmp_path):
    """prepare vae=FLUX.2 text_encoder=FLUX.2 prompt_template=flux2: text = Flux2Pipeline.encode_prompt's
    prompt_embeds (its system message and chat format, the encoder attending to the real tokens, layers 10, 20, 30
    joined per token: D = 3 x 16, every state kept), the empty prompt's too, text_mask all True; latents = the
    pipeline's encoded images (unpatchified); the shard records the template, and Codecs.encode with the recorded
    settings (infer.py's prompts) gives the same."""
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    from ringdit.media.frames import read_image

    out = tmp_path / "out"
    report = encode_folder(str(images), str(out), str(flux2), str(flux2), size=16, max_text_len=FLUX2_LEN,
                           prompt_template="flux2", progress=False)
    assert report.samples == 3
    tensors, metadata = read_prepared(out / "shard-00000.safetensors")
    described = json.loads(metadata["text_encoder"])
    assert described["class"] == "Mistral3ForConditionalGeneration" and described["dim"] == 48
    assert described["prompt_template"] == "flux2" and described["masked"] is False
    assert json.loads(metadata["vae"])["patch"] == 2

    pipe = flux2_pipeline(flux2)
    with torch.no_grad():
        text, _ = pipe.encode_prompt(CAPTIONS, device=torch.device("cpu"), max_sequence_length=FLUX2_LEN)
        null_text, _ = pipe.encode_prompt("", device=torch.device("cpu"), max_sequence_length=FLUX2_LEN)
        pixels = torch.stack([read_image(images / f"img{i}.png", 16, 16) for i in range(3)])
        latents = Flux2Pipeline._unpatchify_latents(pipe._encode_vae_image(pixels, generator=None))
    assert text.shape == (3, FLUX2_LEN, 48) and text[0, -1].abs().max() > 0  # the padding's states are kept
    # the same models, tokens and kernels on one process, batches of 3 both ways: equal up to fp32 reordering
    torch.testing.assert_close(tensors["text"], text, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tensors["null_text"], null_text, rtol=1e-6, atol=1e-6)
    assert tensors["text_mask"].all() and tensors["null_text_mask"].all()
    torch.testing.assert_close(tensors["latents"], latents, rtol=1e-6, atol=1e-6)

    cond, negative = sampling_encoding(described, CAPTIONS, text_len=FLUX2_LEN, text_dim=48)
    torch.testing.assert_close(cond["text"], tensors["text"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(negative["text"], tensors["null_text"], rtol=1e-6, atol=1e-6)


def test_flux2_wrong_inputs_are_one_line(flux2, models, images, tmp_path):
    """Flux.2's encoder without its template, the template with another encoder or one too shallow for layers 10,
    20, 30, a tokenizer without a chat template, too long a text, a VAE config of other patches or without weights,
    a size that is not whole latent patches, another kind of folder as the VAE: each one ConfigError line, before any
    file is encoded."""
    def run(vae=flux2, text_encoder=flux2, **kwargs):
        settings = dict(size=16, max_text_len=FLUX2_LEN, prompt_template="flux2", progress=False) | kwargs
        encode_folder(str(images), str(tmp_path / "out"), str(vae), str(text_encoder), **settings)

    def copy(subfolder: str, edit, weights: bool = True) -> Path:
        folder = tmp_path / f"copy{len(list(tmp_path.glob('copy*')))}" / subfolder
        shutil.copytree(flux2 / subfolder, folder, ignore=None if weights else shutil.ignore_patterns("*.safetensors"))
        config = json.loads((folder / "config.json").read_text())
        edit(config)
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    with pytest.raises(ConfigError, match=r"text_encoder=.* is Mistral3ForConditionalGeneration, Flux.2's chat text "
                                          r"encoder, .*; pass prompt_template=flux2"):
        run(prompt_template=None)
    with pytest.raises(ConfigError, match=r"prompt_template=flux2 is for Mistral3ForConditionalGeneration \(model_type "
                                          r"mistral3\), but text_encoder=.* is T5EncoderModel"):
        run(text_encoder=models["wan"])
    shallow = copy("text_encoder", lambda c: c["text_config"].update(num_hidden_layers=4), weights=False)
    with pytest.raises(ConfigError, match=r"text_encoder=.* has 4 hidden layers, but prompt_template=flux2 reads the "
                                          r"hidden states of layers 10, 20, 30"):
        run(text_encoder=shallow)
    with pytest.raises(ConfigError, match=r"tokenizer=.*wan/tokenizer has no chat template .*, which "
                                          r"prompt_template=flux2 puts the prompt in"):
        run(tokenizer=str(models["wan"] / "tokenizer"))
    with pytest.raises(ConfigError, match=r"max_text_len=65 is longer than Mistral3ForConditionalGeneration takes "
                                          r"\(64 positions\); pass max_text_len=64 or less"):
        run(max_text_len=65)
    with pytest.raises(ConfigError, match=r"vae=.*AutoencoderKLFlux2 with patch_size=\[1, 1\]; Flux2Pipeline "
                                          r"normalises 2x2 patches"):
        run(vae=copy("vae", lambda c: c.update(patch_size=[1, 1])))
    with pytest.raises(ConfigError, match=r"size=6x6: height and width must be positive multiples of "
                                          r"AutoencoderKLFlux2's 2x downsampling x its 2x2 latent patches, 4"):
        run(size=6)
    with pytest.raises(ConfigError, match=r"vae=.*FLUX.2/text_encoder: .*config.json describes 'None', not a VAE"):
        run(vae=flux2 / "text_encoder")
    with pytest.raises(ConfigError, match=r"vae=.*copy\d/vae.*safetensors"):
        run(vae=copy("vae", lambda c: None, weights=False))


def _flux2_tiles_over_ranks(rank, world, folder):
    """Each rank: the tile-parallel decode and encode (infer.py's decode over its sampling ranks, prepare's
    parallel_vae=true) of Flux.2's VAE, 3 x 3 tiles, against this process's own tiled decode / encode."""
    import torch.distributed as dist

    from ringdit.media.parallel_vae import decode_grid
    from ringdit.media.vae import VAE

    torch.set_num_threads(1)
    codec = VAE(folder, tile=8)  # 8-pixel tiles, 4 latents: AutoencoderKL's tiling, which Flux.2's copies
    latents = torch.randn(1, FLUX2_CHANNELS, 8, 8, generator=torch.Generator().manual_seed(1))
    assert len(decode_grid(codec.model, latents).tiles()) == 9
    torch.testing.assert_close(codec.decode(latents, group=dist.group.WORLD, dst=None), codec.decode(latents),
                               rtol=0, atol=1e-6)
    pixels = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(2)) * 2 - 1
    torch.testing.assert_close(codec.encode(pixels, group=dist.group.WORLD, dst=None), codec.encode(pixels),
                               rtol=0, atol=1e-6)


def test_flux2_vae_tiles_split_over_2_ranks(flux2):
    """Flux.2's VAE in ringdit.media.parallel_vae: its tiles over 2 gloo ranks = one process's tiled decode and
    encode (normalised as the pipeline's, through the same VAE.decode / encode)."""
    from tests.distributed import run_ranks

    run_ranks(_flux2_tiles_over_ranks, 2, str(flux2))
