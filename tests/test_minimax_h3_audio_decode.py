"""MiniMax-H3's sampled sound decoded (``ringdit.media.audio.AudioDecoder`` with ``AutoencoderKLMiniMaxH3Audio``):
the waveform equals the one diffusers' own ``MiniMaxH3AudioDecodeStep`` (the modular pipeline's audio decode step,
run as a pipeline) decodes from the same latents; the checks of the VAE against the model and the data; infer.py
writing MP4s with their stereo AAC track."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest
import torch

from ringdit.common.errors import ConfigError
from ringdit.media.audio import AudioDecoder, audio_decoder_folders, check_audio_vae, sampling_audio_vae
from tests.helpers import run
from tests.minimax_h3_helpers import tiny_audio_vae, tiny_vae

MODEL = {"audio_in_channels": 8}  # model=minimax_h3_tiny's transformer config, the part the check reads


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory) -> tuple[Path, object]:
    """A pipeline-shaped MiniMax-H3 folder: its tiny random vae/ and audio_vae/."""
    root = tmp_path_factory.mktemp("minimax") / "MiniMax-H3"
    tiny_vae(root / "vae")
    return root, tiny_audio_vae(root / "audio_vae")


def test_the_waveform_is_the_pipelines_own_audio_decode_step(pipeline_folder):
    from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3AudioDecodeStep

    root, vae = pipeline_folder
    torch.manual_seed(1)
    latents = torch.randn(2, 2, 5, 8)  # sampling's (N, 2 stereo channels, L, C_a), normalised
    decoder = AudioDecoder.load(root)
    assert decoder.vocoder is None and decoder.rate == 32000
    sounds = decoder.decode(latents)
    pipe = MiniMaxH3AudioDecodeStep().init_pipeline()
    pipe.update_components(audio_vae=vae)
    for sample, (waveform, rate) in zip(latents, sounds):
        # the pipeline's audio_latents: one batch item per stereo channel, (2, C_a, L) -- its prepare layout's
        reference = pipe(audio_latents=sample.transpose(1, 2).contiguous())
        expected = reference.get("audio")[0]  # (1, 2, samples) -> (2, samples)
        assert rate == reference.get("sampling_rate") == 32000
        assert waveform.shape == (2, 5 * 800)
        # the same float32 operations on the same weights in the same order: equal to the bit
        torch.testing.assert_close(torch.from_numpy(waveform), expected, rtol=0, atol=0)
    # the two stereo channels are decoded apart (not one channel twice)
    assert not torch.equal(torch.from_numpy(sounds[0][0][0]), torch.from_numpy(sounds[0][0][1]))


def test_the_audio_vae_folder_needs_no_vocoder(pipeline_folder):
    root, _ = pipeline_folder
    assert audio_decoder_folders(root) == (root / "audio_vae", None)
    assert audio_decoder_folders(root / "audio_vae", None) == (root / "audio_vae", None)
    data = {"audio_vae": {"path": str(root), "sample_rate": 32000}}
    assert sampling_audio_vae(str(root), "audio_vae", "vocoder", data, MODEL) == str(root)
    assert sampling_audio_vae(None, "audio_vae", "vocoder", data, MODEL) == str(root)  # the data's own


def test_another_sample_rate_or_width_is_refused_and_the_advice_works(pipeline_folder, tmp_path):
    root, vae = pipeline_folder
    other = tiny_audio_vae(tmp_path / "other" / "audio_vae", sampling_rate=16000)
    data = {"audio_vae": {"path": str(root), "sample_rate": 32000}}
    with pytest.raises(ConfigError, match=f"encoded at 32000 Hz .*use the audio VAE the data were prepared with, "
                                          f"audio_vae={root}"):
        check_audio_vae(other, MODEL, "audio_vae", data)
    check_audio_vae(vae, MODEL, "audio_vae", data)  # the advice: the data's own VAE is taken
    with pytest.raises(ConfigError, match="8 channels, the model takes model.config.audio_in_channels=16"):
        check_audio_vae(dict(vae.config, _class_name="AutoencoderKLMiniMaxH3Audio"), {"audio_in_channels": 16})


def test_infer_writes_each_video_with_its_stereo_sound(pipeline_folder, tmp_path):
    """train.py one SGD step of model=minimax_h3_tiny on synthetic data with audio latents (7 latent frames: the
    video VAE decodes 5 n + 2), then infer.py with the MiniMax-H3 folder's video and audio VAEs: samples.npz keeps
    both stereo channels' latents and each MP4 carries a 32 kHz stereo AAC track."""
    root, _ = pipeline_folder
    env = {"HF_HUB_OFFLINE": "1"}
    run("train.py", tmp_path / "run", "model=minimax_h3_tiny", "data=synthetic_text_latents", "data.audio=[2,3,8]",
        "data.num_samples=2", "data.batch_size=2", "data.frames=7", "data.size=2", "trainer.max_steps=1",
        "logger=csv", "optimizer=sgd", f"data.cache_dir={tmp_path / 'data'}", env=env)
    run("infer.py", tmp_path / "infer", f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}",
        "num_samples=2", "diffusion.sampling.steps=2", f"vae={root}", f"audio_vae={root}", env=env)
    with np.load(tmp_path / "infer" / "samples.npz") as stored:
        assert stored["audio"].shape[:2] == (2, 2) and stored["audio"].shape[3] == 8
    for i in range(2):
        with av.open(str(tmp_path / "infer" / f"sample-{i:03d}.mp4")) as container:
            sound = container.streams.audio[0]
            assert (sound.codec_context.name, sound.rate, sound.codec_context.channels) == ("aac", 32000, 2)
