"""``python -m ringdit.prepare`` for LTX-2 (``audio_vae=``): each clip's video latents from LTX-2's video VAE, its sound
decoded by PyAV, resampled to the audio VAE's rate, turned into LTX-2's log-mel spectrogram and encoded by
``AutoencoderKLLTX2Audio``, normalised as ``LTX2Pipeline`` normalises both; the shards train ``model=ltx2_tiny``
through train.py. Checked against an independent NumPy spectrogram (a plain DFT and Slaney's filters written from
librosa's definition) and diffusers' own models and pipeline helpers, on tiny random VAEs. Bad input -- a clip
without sound, clips of several frame rates, audio latents beside image latents or in some shards only, latents
of an audio VAE at another rate than the model's -- is one line naming the file or setting, before any model loads
or any rank starts, and each refusal's advice is followed."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("av")

from ringdit.common.errors import ConfigError  # noqa: E402
from ringdit.media.audio_latents import N_FFT, log_mel, read_waveform  # noqa: E402
from ringdit.media.encode_folder import encode_folder  # noqa: E402
from tests.helpers import logged_losses, prepare_train, read_prepared, run  # noqa: E402
from tests.ltx2_helpers import (FPS, FRAMES, RATE, SIZE, assert_refused, clips, ltx2, tiny_audio_vae,  # noqa: E402, F401 - fixtures
                                write_clip)

def prepare(ltx2_root: Path, clips: Path, out: Path, **settings):
    return encode_folder(str(clips), str(out), str(ltx2_root), str(ltx2_root), size=SIZE, frames=FRAMES,
                         max_text_len=8, audio_vae=str(ltx2_root), progress=False, **settings)


def reference_log_mel(waveform: np.ndarray, rate: int, hop: int, mel_bins: int) -> np.ndarray:
    """(channels, samples) -> (channels, frames, mel_bins), written from the definitions: reflect-padded frames of
    N_FFT samples every hop under a periodic Hann window, |DFT| by matrix, Slaney's mel scale (linear to 1 kHz,
    log above) with triangles normalised to unit area, log(max(., 1e-5))."""
    def hz_to_mel(f):
        return np.where(f < 1000, 3 * f / 200, 15 + 27 * np.log(np.maximum(f, 1e-9) / 1000) / np.log(6.4))

    def mel_to_hz(m):
        return np.where(m < 15, 200 * m / 3, 1000 * np.exp((m - 15) * np.log(6.4) / 27))

    padded = np.pad(waveform, ((0, 0), (N_FFT // 2, N_FFT // 2)), mode="reflect")
    count = 1 + (padded.shape[1] - N_FFT) // hop
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)
    k = np.arange(N_FFT // 2 + 1)[:, None] * np.arange(N_FFT)[None, :]
    dft = np.exp(-2j * np.pi * k / N_FFT)  # (bins, N_FFT)
    frames = np.stack([padded[:, i * hop:i * hop + N_FFT] * window for i in range(count)], axis=1)  # (ch, F, N)
    magnitude = np.abs(frames @ dft.T)  # (ch, F, bins)
    freqs = np.linspace(0, rate / 2, N_FFT // 2 + 1)
    edges = mel_to_hz(np.linspace(0, hz_to_mel(rate / 2), mel_bins + 2))
    filters = np.zeros((N_FFT // 2 + 1, mel_bins))
    for m in range(mel_bins):
        low, mid, high = edges[m:m + 3]
        up, down = (freqs - low) / (mid - low), (high - freqs) / (high - mid)
        filters[:, m] = np.maximum(0, np.minimum(up, down)) * 2 / (high - low)
    return np.log(np.maximum(magnitude @ filters, 1e-5))


def test_log_mel_is_ltx2s_spectrogram():
    """log_mel (torch.stft, the Slaney filters) equals the NumPy spectrogram written from the definitions, at LTX-2's
    16 kHz, hop 160 and 64 mel bins, for a stereo chirp; frames = samples // hop + 1."""
    t = np.arange(8000) / 16000
    wave = np.stack([np.sin(2 * np.pi * (200 + 3000 * t) * t), 0.3 * np.cos(2 * np.pi * 1234 * t)])
    mel = log_mel(torch.from_numpy(wave)[None], 16000, 160, 64)[0]  # float64
    assert mel.shape == (2, 8000 // 160 + 1, 64) and mel.dtype == torch.float64
    np.testing.assert_allclose(mel.numpy(), reference_log_mel(wave, 16000, 160, 64), atol=1e-9, rtol=1e-9)
    single = log_mel(torch.from_numpy(wave)[None].float(), 16000, 160, 64)[0]  # what prepare runs: float32
    np.testing.assert_allclose(single.numpy(), mel.numpy(), atol=1e-2)


def test_prepare_stores_the_video_audio_and_text_latents_as_ltx2_encodes_them(ltx2, clips, tmp_path):
    """Every clip's shard row: latents = LTX2Pipeline._normalize_latents of the video VAE's posterior mode; audio =
    LTX2Pipeline's audio normalisation of AutoencoderKLLTX2Audio's mode of the reference log-mel of the clip's sound
    (resampled by PyAV to 16 kHz), L = round(17 / 24 s x 16000 / 160 / 4) = 18 latent frames, as
    ringdit.models.diffusers.ltx2.audio_frames counts them for 3 latent frames; text (N, 8, 16); the audio VAE's
    rate, hop and mel bins recorded."""
    import json

    from diffusers import LTX2Pipeline

    from ringdit.media.frames import read_frames
    from ringdit.models.diffusers.ltx2 import audio_frames

    root, models = ltx2
    report = prepare(root, clips, tmp_path / "out")
    assert report.samples == 4
    tensors, metadata = read_prepared(tmp_path / "out" / "shard-00000.safetensors")
    assert tensors["latents"].shape == (4, 4, 3, 8, 8) and tensors["text"].shape == (4, 8, 16)
    assert tensors["audio"].shape == (4, 2, 18, 2)
    assert audio_frames({"vae_scale_factors": [8, 32, 32], "audio_sampling_rate": 16000, "audio_hop_length": 160,
                         "audio_scale_factor": 4}, 3) == 18
    recorded = json.loads(metadata["audio_vae"])
    assert (recorded["sample_rate"], recorded["mel_hop_length"], recorded["mel_bins"]) == (16000, 160, 8)

    clip = sorted(clips.glob("*.mp4"))[1]
    pixels = read_frames(clip, SIZE, SIZE, list(range(FRAMES)), "the clip")[None]  # (1, 3, 17, 64, 64)
    audio_vae = models["audio"]
    with torch.no_grad():
        z = models["video"].encode(pixels).latent_dist.mode()
        video = LTX2Pipeline._normalize_latents(z, models["video"].latents_mean, models["video"].latents_std,
                                                models["video"].config.scaling_factor)
        seconds = FRAMES / FPS
        wave = read_waveform(clip, 0.0, seconds + 2 * 160 * 4 / 16000, 16000, 2).numpy()
        mel = torch.from_numpy(reference_log_mel(wave, 16000, 160, 8)).float()[None]
        raw = audio_vae.encode(mel).latent_dist.mode()[:, :, :round(seconds * 100 / 4)]  # (1, 2, 18, 2)
        packed = LTX2Pipeline._pack_audio_latents(raw)
        normalised = LTX2Pipeline._normalize_audio_latents(packed, audio_vae.latents_mean, audio_vae.latents_std)
        audio = LTX2Pipeline._unpack_audio_latents(normalised, 18, num_mel_bins=2)
    torch.testing.assert_close(tensors["latents"][1:2], video, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tensors["audio"][1:2], audio, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(tensors["audio"][0], tensors["audio"][1])  # each clip's own sound


def test_prepared_shards_train_ltx2_tiny_through_train_py(ltx2, clips, tmp_path):
    """The prepared folder trains model=ltx2_tiny for 2 steps (video and audio denoised together), in this process:
    two finite losses logged."""
    root, _ = ltx2
    prepare(root, clips, tmp_path / "data")
    run("train.py", tmp_path / "run", "model=ltx2_tiny", "data=text_latents", f"data.path={tmp_path / 'data'}",
        "data.batch_size=2", "data.val_fraction=0", "trainer.max_steps=2", "logger=csv", "callbacks=none",
        "trainer.log_every_n_steps=1")
    losses = logged_losses(tmp_path / "run")
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses.values()), losses


def test_a_clip_without_sound_is_refused_before_any_model_loads_and_the_advice_works(ltx2, clips, tmp_path,
                                                                                       monkeypatch):
    """A silent clip: one line naming it and audio_vae, raised before any VAE is built; moving it out (the advice)
    prepares the rest."""
    import ringdit.media.encode_shards as shards

    root, _ = ltx2
    folder = tmp_path / "clips"
    shutil.copytree(clips, folder)
    write_clip(folder / "silent.mp4", 9, sound=False)
    loaded = []
    monkeypatch.setattr(shards, "VAE", lambda *a, **k: loaded.append(a) or pytest.fail("a model loaded"))
    with pytest.raises(ConfigError, match=r"audio_vae=.*silent\.mp4 has no audio track \(1 of 5 files.*move the "
                                          r"silent ones out of input="):
        prepare(root, folder, tmp_path / "out")
    assert not loaded and not (tmp_path / "out").exists()
    monkeypatch.undo()
    (folder / "silent.mp4").rename(tmp_path / "silent.mp4")
    assert prepare(root, folder, tmp_path / "out").samples == 4


def test_clips_of_several_frame_rates_are_refused_and_source_fps_resamples_them(ltx2, tmp_path):
    """Clips at 24 and 30 fps: one line naming both (their windows' sound would differ in length); source_fps= and
    fps= (the advice) resample them by time to one rate, and every window gets the same 18 latent audio frames."""
    root, _ = ltx2
    folder = tmp_path / "clips"
    folder.mkdir()
    write_clip(folder / "a.mp4", 0, fps=24)
    write_clip(folder / "b.mp4", 1, fps=30)
    with pytest.raises(ConfigError, match=r"a\.mp4 plays at 24 fps and b\.mp4 at 30.*pass source_fps="):
        prepare(root, folder, tmp_path / "out")
    # the rate is the data's for every clip; the audio is timed at each frame's time
    report = prepare(root, folder, tmp_path / "out", source_fps=30, fps=24)
    assert report.samples == 2
    tensors, _ = read_prepared(tmp_path / "out" / "shard-00000.safetensors")
    assert tensors["audio"].shape == (2, 2, 18, 2)


def test_audio_of_another_rate_than_the_models_is_refused_before_any_rank_and_the_advice_works(ltx2, clips,
                                                                                                tmp_path):
    """Shards whose sound an audio VAE at 16 kHz encoded, for a model timed at 24 kHz: one line naming the data and
    model.config.audio_sampling_rate, before anything is built; prepared again with a 24 kHz audio VAE (the advice),
    the same model takes them."""
    root, _ = ltx2
    prepare(root, clips, tmp_path / "data16")
    common = ["model=ltx2_tiny", "model.config.audio_sampling_rate=24000", "data=text_latents", "data.batch_size=2"]
    assert_refused(tmp_path / "refused", [*common, f"data.path={tmp_path / 'data16'}"],
                                   r"data16: the audio latents were encoded by an audio VAE at 16000 Hz.*"
                                   r"model.config.audio_sampling_rate=24000.*audio VAE of the model's own pipeline")
    other = tmp_path / "LTX-2-24k"
    shutil.copytree(root, other, ignore=shutil.ignore_patterns("audio_vae"))
    tiny_audio_vae(other / "audio_vae", sample_rate=24000)
    prepare(other, clips, tmp_path / "data24")
    prepare_train([*common, f"data.path={tmp_path / 'data24'}", "logger=none"], tmp_path / "run")


def write_shard(path: Path, latents: torch.Tensor, audio: torch.Tensor | None) -> None:
    from ringdit.data.text_latent_shards import write_text_latents

    write_text_latents(path, latents, torch.randn(latents.shape[0], 8, 16),
                       image={"audio": audio} if audio is not None else None)


def test_audio_without_video_or_video_without_audio_in_shards_is_refused_naming_the_file(tmp_path):
    """Audio latents beside IMAGE latents (no clip): one line naming the shard; a folder whose shards hold audio in
    one and none in another: one line naming both; both before anything is built. Removing the stray shard (the
    advice: every folder with its sound) trains."""
    common = ["model=ltx2_tiny", "data=text_latents", "data.batch_size=2"]
    images = tmp_path / "images"
    write_shard(images / "shard-00000.safetensors", torch.randn(4, 4, 8, 8), torch.randn(4, 2, 5, 2))
    assert_refused(tmp_path / "a", [*common, f"data.path={images}"],
                                   r"images/shard-00000\.safetensors holds audio latents .* beside image latents .*"
                                   r"prepare videos with their sound")
    mixed = tmp_path / "mixed"
    write_shard(mixed / "shard-00000.safetensors", torch.randn(4, 4, 3, 4, 4), torch.randn(4, 2, 5, 2))
    write_shard(mixed / "shard-00001.safetensors", torch.randn(4, 4, 3, 4, 4), None)
    assert_refused(tmp_path / "b", [*common, f"data.path={mixed}"],
                                   r"shard-00001\.safetensors has image conditioning \[\] but shard-00000\.safetensors "
                                   r"has \['audio'\].*prepare every folder of clips with their sound")
    (mixed / "shard-00001.safetensors").unlink()
    prepare_train([*common, f"data.path={mixed}", "logger=none"], tmp_path / "run")


def test_the_audio_window_follows_the_clips_frames():
    """The latent count is the window's duration in latent audio frames: 121 frames at 24 fps -> 126 (LTX2Pipeline's
    count for its default clip)."""
    from ringdit.media.audio_latents import latent_audio_frames

    assert latent_audio_frames(121 / 24, 16000, 160, 4) == round(121 / 24 * 25) == 126
    assert math.isclose(121 / 24 * 16000 / 160 / 4, 126.04, abs_tol=0.01)
