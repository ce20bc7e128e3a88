"""CogVideoX 1.5's VAE and T5 in ``python -m ringdit.prepare`` and ``ringdit.media.decode``: what they store and
decode is checked against diffusers' CogVideoXPipeline (and CogVideo's fine-tuning recipe) on a tiny random
AutoencoderKLCogVideoX (diffusers' own test layout, narrower) and the tiny T5 of tests/conftest.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")


from ringdit.common.errors import ConfigError  # noqa: E402
from ringdit.media.encode_folder import encode_folder  # noqa: E402
from tests.helpers import TEXT_LEN, read_prepared, tiny_video_vae, write_video  # noqa: E402

SCALING = 0.7  # CogVideoX 1.5's scaling_factor (CogVideoX 1.0's: 1.15258426)
CHANNELS = 4


@pytest.fixture(scope="module")
def cogvideox(tmp_path_factory) -> tuple[Path, object]:
    """A pipeline-shaped folder (vae/) and the VAE in it."""
    root = tmp_path_factory.mktemp("cogvideox") / "CogVideoX1.5"
    return root, tiny_video_vae("cogvideox", root / "vae")  # SCALING and CHANNELS as above


def pipeline(vae, text_encoder=None, tokenizer=None):
    from diffusers import CogVideoXDDIMScheduler, CogVideoXPipeline

    return CogVideoXPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=None,
                             scheduler=CogVideoXDDIMScheduler())


def test_cogvideox_vae_normalises_pads_and_decodes_as_cogvideox(cogvideox):
    """VAE.encode = CogVideo's fine-tuning encode (z * scaling_factor; the posterior's mode rather than a sample)
    with its pad (the first latent frame copied in front to an even count); VAE.decode of those latents =
    CogVideoXPipeline.decode_latents of them without the front frame (its ``latents[:, additional_frames:]``): the
    9 frames encoded come back; a still image is 1 frame padded to 2 and back; the factors are 8 and 4."""
    from ringdit.media.vae import VAE

    root, model = cogvideox
    codec = VAE(root)
    assert (codec.class_name, codec.spatial, codec.temporal, codec.frame_pad) == ("AutoencoderKLCogVideoX", 8, 4, 2)
    assert codec.describe()["scale"] == [pytest.approx(SCALING)] * CHANNELS and codec.describe()["shift"] == [0.0] * 4
    assert codec.describe()["frame_pad"] == 2 and codec.describe()["temporal_compression"] == 4

    pixels = torch.rand(2, 3, 9, 16, 16, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        raw = model.encode(pixels).latent_dist.mode()  # (2, 4, 3, 2, 2): 1 + 2 latent frames
        latent = raw * model.config.scaling_factor  # CogVideoXT2VLoraTrainer.encode_video
        expected = torch.cat([latent[:, :, :1], latent], dim=2)  # its compute_loss: ncopy = 3 % 2 first frames
        decoded = pipeline(model).decode_latents(expected[:, :, 1:].permute(0, 2, 1, 3, 4))  # (B, T, C, H, W) in
    assert raw.shape == (2, CHANNELS, 3, 2, 2) and decoded.shape == (2, 3, 9, 16, 16)
    latents = codec.encode(pixels)
    assert latents.shape == (2, CHANNELS, 4, 2, 2) and torch.equal(latents[:, :, 0], latents[:, :, 1])
    torch.testing.assert_close(latents, expected, rtol=1e-5, atol=1e-5)  # the same model, fp32
    torch.testing.assert_close(codec.decode(latents), decoded.clamp(-1, 1), rtol=1e-5, atol=1e-5)

    image = codec.encode(pixels[:1, :, 0])  # (1, 3, H, W): a one-frame video, padded to the pair
    assert image.shape == (1, CHANNELS, 2, 2, 2) and torch.equal(image[:, :, 0], image[:, :, 1])
    assert codec.decode(image).shape == (1, 3, 1, 16, 16)


def test_cogvideox_frame_counts_and_tiles(cogvideox):
    """1 + 8k frames are taken; another 1 + 4k count (an even latent count, which CogVideoX's VAE decodes to more
    frames than it encoded: 13 -> 16) is one ConfigError line naming the setting and the counts either side, from
    check_frames (prepare's check before any encoding) and from encode; a tile that does not overlap by whole latent
    cells is refused; tile=32 tiles as diffusers does, with stride 3/4 of the tile."""
    from ringdit.media.vae import VAE

    root, model = cogvideox
    with torch.no_grad():
        assert model.decode(torch.zeros(1, CHANNELS, 4, 2, 2)).sample.shape[2] == 16  # why 13 frames are refused
    codec = VAE(root)
    rule = codec.frame_rule
    assert [f for f in range(1, 90) if rule.latent_frames(f) is not None] == [1, 9, 17, 25, 33, 41, 49, 57, 65, 73,
                                                                               81, 89]
    assert rule.latent_frames(81) == 22  # 21 latent frames, one copy of the first in front
    with pytest.raises(ConfigError, match=r"^frames=85 is not a frame count AutoencoderKLCogVideoX takes: 1 \+ k x 8 "
                                          r"\(.*padded to a multiple of 2 frames that decoding drops\); the nearest "
                                          r"valid counts are 81 and 89$"):
        codec.check_frames(85)
    with pytest.raises(ConfigError, match=r"^frames=5 is not a frame count .* the nearest valid counts are 1 and 9$"):
        codec.encode(torch.zeros(1, 3, 5, 16, 16))
    with pytest.raises(ConfigError, match=r"^tile=24: AutoencoderKLCogVideoX's tiles overlap by a quarter of a "
                                          r"tile, .* use a multiple of 32"):
        VAE(root, tile=24)
    tiled = VAE(root, tile=32).model  # stride int(32 * 3 / 4) = 24 pixels = 3 latents = 4 - int(4 / 4) kept
    assert (tiled.tile_sample_min_height, tiled.tile_latent_min_height, tiled.tile_overlap_factor_width) == \
        (32, 4, 0.25)


def test_prepare_and_decode_cogvideox(cogvideox, models, tmp_path):
    """prepare vae=<CogVideoX 1.5> text_encoder=<T5> max_text_len=226 masked_text=false (here the tiny T5 and 8
    tokens): latents = the VAE's (padded), text = CogVideoXPipeline._get_t5_prompt_embeds (T5 over the padded prompt,
    no mask, every state kept), the empty prompt's too, text_mask all true; frames=13 is refused before any file is
    encoded; infer.py's prompt encoding with the recorded settings gives the same text; ringdit.media.decode writes
    the 9 frames the pipeline decodes."""
    from transformers import AutoTokenizer, T5EncoderModel

    from ringdit.media.images import to_uint8
    from ringdit.media.decode import decode_latents, decode_samples
    from ringdit.media.frames import read_video
    from tests.helpers import sampling_encoding
    from ringdit.media.vae import VAE

    root, model = cogvideox
    clips = tmp_path / "clips"
    clips.mkdir()
    captions = ["a red fox running"]
    write_video(clips / "clip0.mp4", 9, seed=1)
    (clips / "clip0.txt").write_text(captions[0])
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"^frames=13 is not a frame count AutoencoderKLCogVideoX takes"):
        encode_folder(str(clips), str(out), str(root), str(models["wan"]), size=16, frames=13,
                      max_text_len=TEXT_LEN, masked_text=False, progress=False)
    assert not out.exists()  # refused before the text encoder was loaded or a shard begun
    report = encode_folder(str(clips), str(out), str(root), str(models["wan"]), size=16, frames=9,
                           max_text_len=TEXT_LEN, masked_text=False, progress=False)
    assert report.samples == 1
    tensors, metadata = read_prepared(out / "shard-00000.safetensors")
    described = json.loads(metadata["text_encoder"])
    assert described["masked"] is False and json.loads(metadata["vae"])["frame_pad"] == 2

    pixels = read_video(clips / "clip0.mp4", 16, 16, 9, 1)[None]  # (1, 3, 9, 16, 16)
    pipe = pipeline(model, T5EncoderModel.from_pretrained(models["wan"] / "text_encoder").eval(),
                    AutoTokenizer.from_pretrained(models["wan"] / "tokenizer"))
    with torch.no_grad():
        latent = model.encode(pixels).latent_dist.mode() * SCALING
        text = pipe._get_t5_prompt_embeds(captions, max_sequence_length=TEXT_LEN, device=torch.device("cpu"))
        null_text = pipe._get_t5_prompt_embeds([""], max_sequence_length=TEXT_LEN, device=torch.device("cpu"))
    assert tensors["latents"].shape == (1, CHANNELS, 4, 2, 2)
    torch.testing.assert_close(tensors["latents"], torch.cat([latent[:, :, :1], latent], dim=2), rtol=1e-5,
                               atol=1e-5)
    assert text[0, -1].abs().max() > 0  # the padding's states: CogVideoX's transformer reads all 226
    torch.testing.assert_close(tensors["text"], text, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tensors["null_text"], null_text, rtol=1e-6, atol=1e-6)
    assert tensors["text_mask"].all() and tensors["null_text_mask"].all()
    cond, negative = sampling_encoding(described, captions, text_len=TEXT_LEN, text_dim=16)  # infer.py's, as recorded
    torch.testing.assert_close(cond["text"], text, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(negative["text"], null_text, rtol=1e-6, atol=1e-6)

    # a model's samples: the stored latents as samples.npz holds them; decoded as the pipeline decodes them
    samples = tmp_path / "run" / "samples.npz"
    samples.parent.mkdir()
    np.savez(samples, latents=tensors["latents"].numpy())
    with torch.no_grad():
        frames = pipe.decode_latents(tensors["latents"][:, :, 1:].permute(0, 2, 1, 3, 4)).clamp(-1, 1)
    expected = to_uint8(frames)  # (1, 9, 16, 16, 3)
    decoded = decode_latents(tensors["latents"], VAE(root))
    assert decoded.shape == (1, 9, 16, 16, 3)
    assert np.abs(decoded.astype(int) - expected.numpy().astype(int)).max() <= 1  # uint8 rounding of fp32 noise
    written = decode_samples(samples, root, fps=8)
    assert sorted(p.name for p in written) == ["sample-000.gif", "sample-000.mp4", "samples.gif"]


def test_sample_sizes_count_the_frames_the_padded_latents_decode_to():
    """infer.py's frames= of CogVideoX data (frame_pad 2): 9 frames are 2 latent frames + the pad, as prepare stores
    them and the VAE decodes them; a count that would not decode back is refused with the nearest good ones."""
    from ringdit.common.errors import ConfigError
    from ringdit.sampling import SampleSizes

    data = {"image_size": [4, 8, 8], "vae": {"spatial_compression": 8, "temporal_compression": 4, "frame_pad": 2}}
    sizes = SampleSizes.of(data, (2, 2, 2))
    assert sizes.name((4, 8, 8)) == "64x64x9" and sizes.shape(frames=9) == (4, 8, 8)
    assert sizes.shape(frames=1) == (2, 8, 8) and sizes.shape(frames=81) == (22, 8, 8)
    for frames, nearest in ((13, "9 and 17"), (85, "81 and 89"), (5, "1 and 9")):
        with pytest.raises(ConfigError, match=rf"^frames={frames} is not a frame count the model takes: 1 \+ k x 8 "
                                              rf"\(.*\); the nearest valid counts are {nearest}$"):
            sizes.shape(frames=frames)
