"""A clip's sound as LTX-2 audio latents, for ``python -m ringdit.prepare audio_vae=...``: the clip's audio track over
the frames its video latents hold, decoded and resampled by PyAV to the audio VAE's rate, turned into the log-mel
spectrogram LTX-2's audio VAE encodes, encoded with ``AutoencoderKLLTX2Audio`` and normalised as ``LTX2Pipeline``
normalises audio latents.

    encoder = AudioLatentEncoder("path/to/LTX-2")          # its audio_vae/ folder (or the folder itself)
    audio = encoder.encode_clip(path, first_frame, frames, frame_step)   # (C, L, M): L as LTX2Pipeline counts them

The spectrogram is LTX-2's trainers' (the ``AudioProcessor`` of Lightricks' LTX-2 as SimpleTuner's and FastVideo's
LTX-2 training code carry it): torchaudio's ``MelSpectrogram`` with ``n_fft = win_length = 1024``, the VAE's
``mel_hop_length`` and ``mel_bins``, a Hann window, ``center=True`` with reflect padding, magnitudes (``power=1``),
Slaney's mel scale and area normalisation from 0 Hz to half the rate, then ``log(clamp(mel, 1e-5))``, laid out
(B, channels, frames, mel bins). It is written here with ``torch.stft`` and the Slaney filter bank (torchaudio is not a
dependency), and ``tests/test_prepare_ltx2.py`` checks it against a plain NumPy DFT and filter bank written from librosa's
definition.

The latents' length is the clip's duration in latent audio frames, as LTX2Pipeline sizes them:
``round(seconds * sample_rate / mel_hop_length / temporal_compression)`` (``ringdit.models.diffusers.ltx2.audio_frames``
counts the same for a clip of the model's frame rate); the encoder's causal output, one latent frame per 4 mel
frames, is cut to it, the waveform padded with silence where the track ends early.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ringdit.common.errors import ConfigError
from ringdit.common.safe_json import read_json
from ringdit.media.pretrained import find_folder

Tensor = torch.Tensor

AUDIO_VAE_CLASS = "AutoencoderKLLTX2Audio"
# the audio VAEs prepare encodes with: LTX-2's (here) and MiniMax-H3's (ringdit.media.minimax_audio, its waveform VAE)
AUDIO_VAE_CLASSES = (AUDIO_VAE_CLASS, "AutoencoderKLMiniMaxH3Audio")
N_FFT = 1024  # LTX-2's audio processor: n_fft = win_length = 1024 at 16 kHz, hop 160 (the VAE's)
LOG_FLOOR = 1e-5  # its log-mel floor: log(clamp(mel, min=1e-5))


def video_rate(path: str | Path) -> float | None:
    """The frame rate of the clip at ``path`` (None: no video stream), from its headers."""
    import av

    with av.open(str(path)) as container:
        return float(container.streams.video[0].average_rate) if container.streams.video else None


def has_audio_track(path: str | Path) -> bool:
    """Whether the media file at ``path`` holds an audio stream (its headers only; nothing decoded)."""
    import av

    with av.open(str(path)) as container:
        return bool(container.streams.audio)


def check_audio_tracks(paths: list[Path], audio_vae: str, source_fps) -> None:
    """One ConfigError line before any model loads: a file of ``paths`` without a sound track (an audio-video model
    learns each clip's sound, and a silent one would teach it silence; an image has none), or -- without
    ``source_fps`` -- clips of different frame rates (their windows of one frame count would last, and their sound
    latents count, differently)."""
    silent = [path for path in paths if not has_audio_track(path)]
    if silent:
        raise ConfigError(f"audio_vae={audio_vae}: {silent[0]} has no audio track ({len(silent)} of {len(paths)} "
                          f"files have none) but an audio-video model learns each clip's sound; give clips with "
                          f"sound (move the silent ones out of input=), or drop audio_vae for a video-only model")
    if source_fps is None:
        rates = {path: video_rate(path) for path in paths}
        if len(set(rates.values())) > 1:
            (a, rate_a), (b, rate_b) = [next((p, r) for p, r in rates.items() if r == rate)
                                        for rate in sorted(set(rates.values()))[:2]]
            raise ConfigError(f"audio_vae={audio_vae}: {a.name} plays at {rate_a:g} fps and {b.name} at {rate_b:g}, "
                              f"so windows of one frame count hold sound of different lengths; pass source_fps=<their "
                              f"rate> (one rate for all; fps= the model's) to resample them by time, or prepare each "
                              f"frame rate into its own out= folder")


def read_waveform(path: str | Path, start: float, seconds: float, rate: int, channels: int) -> Tensor:
    """The sound of ``path`` from ``start`` for ``seconds`` seconds: (channels, round(seconds * rate)) float32 in
    [-1, 1], decoded and resampled by PyAV (libswresample) to ``rate`` Hz and ``channels`` (1 or 2) channels; silence
    where the track ends early."""
    import av

    layout = {1: "mono", 2: "stereo"}[channels]
    resampler = av.AudioResampler(format="fltp", layout=layout, rate=rate)
    chunks = []
    with av.open(str(path)) as container:
        for frame in container.decode(container.streams.audio[0]):
            chunks += [f.to_ndarray() for f in resampler.resample(frame)]  # (channels, n) each
        chunks += [f.to_ndarray() for f in resampler.resample(None)]  # the resampler's delayed samples
    samples = np.concatenate(chunks, axis=1) if chunks else np.zeros((channels, 0), np.float32)
    first, count = round(start * rate), round(seconds * rate)
    window = samples[:, first:first + count]
    window = np.pad(window, ((0, 0), (0, count - window.shape[1])))  # silence after the track's end
    return torch.from_numpy(np.ascontiguousarray(window, dtype=np.float32))


def slaney_mel_filters(n_freqs: int, rate: int, mel_bins: int) -> Tensor:
    """(n_freqs, mel_bins) triangular filters on Slaney's mel scale (linear below 1 kHz, logarithmic above), each
    normalised to unit area (Slaney's ``2 / (f_high - f_low)``), from 0 Hz to rate / 2 -- torchaudio's
    ``melscale_fbanks(..., norm="slaney", mel_scale="slaney")`` and librosa's ``filters.mel`` defaults."""
    def to_mel(hz: Tensor) -> Tensor:
        linear = hz * 3 / 200  # 3 mels per 200 Hz below 1 kHz
        return torch.where(hz >= 1000, 15 + torch.log(hz / 1000) * 27 / math.log(6.4), linear)

    def to_hz(mel: Tensor) -> Tensor:
        return torch.where(mel >= 15, 1000 * torch.exp((mel - 15) * math.log(6.4) / 27), mel * 200 / 3)

    freqs = torch.linspace(0, rate / 2, n_freqs, dtype=torch.float64)  # the STFT's bins
    edges = to_hz(torch.linspace(0, float(to_mel(torch.tensor(rate / 2, dtype=torch.float64))), mel_bins + 2,
                                 dtype=torch.float64))  # (mel_bins + 2,) band edges in Hz
    slopes = edges[None, :] - freqs[:, None]  # (n_freqs, mel_bins + 2)
    widths = edges.diff()  # (mel_bins + 1,)
    rising = -slopes[:, :-2] / widths[:-1]
    falling = slopes[:, 2:] / widths[1:]
    filters = torch.clamp(torch.minimum(rising, falling), min=0)  # (n_freqs, mel_bins)
    return filters * (2 / (edges[2:] - edges[:-2]))[None, :]  # float64


def log_mel(waveform: Tensor, rate: int, hop: int, mel_bins: int) -> Tensor:
    """(B, channels, samples) -> (B, channels, frames, mel_bins) log-mel magnitudes, frames = samples // hop + 1 (see
    the module docstring: LTX-2's audio processor); float32, or float64 for a float64 waveform."""
    batch, channels, samples = waveform.shape
    dtype = waveform.dtype if waveform.dtype == torch.float64 else torch.float32
    flat = waveform.reshape(batch * channels, samples).to(dtype)
    spectrum = torch.stft(flat, N_FFT, hop_length=hop, win_length=N_FFT, window=torch.hann_window(N_FFT, dtype=dtype),
                          center=True, pad_mode="reflect", return_complex=True).abs()  # (B * ch, N_FFT // 2 + 1, F)
    filters = slaney_mel_filters(N_FFT // 2 + 1, rate, mel_bins).to(dtype)  # (N_FFT // 2 + 1, mel_bins)
    mel = torch.einsum("nft,fm->ntm", spectrum, filters)
    return torch.log(torch.clamp(mel, min=LOG_FLOOR)).reshape(batch, channels, -1, mel_bins)


def latent_audio_frames(seconds: float, rate: int, hop: int, compression: int) -> int:
    """LTX2Pipeline's count of latent audio frames for ``seconds`` of sound."""
    return round(seconds * rate / hop / compression)


def audio_vae_folder(path, subfolder: str | None = "audio_vae", setting: str = "audio_vae") -> Path:
    """The folder of an audio VAE of ``AUDIO_VAE_CLASSES`` (LTX-2's, MiniMax-H3's) given as ``path`` (a pipeline
    folder with ``subfolder``, or its own), its config read and its class checked (nothing loaded); a ConfigError
    line otherwise."""
    folder = find_folder(path, subfolder or ".", "config.json", setting)
    config = read_json(folder / "config.json", f"{setting}={path}: {folder / 'config.json'}", kind=dict,
                       fix="save the audio VAE with save_pretrained")
    if config.get("_class_name") not in AUDIO_VAE_CLASSES:
        raise ConfigError(f"{setting}={path}: {folder / 'config.json'} describes {config.get('_class_name')!r}, "
                          f"not an audio VAE prepare encodes with ({', '.join(AUDIO_VAE_CLASSES)}); give the LTX-2 "
                          f"or MiniMax-H3 pipeline folder (its audio_vae/) or the audio VAE's own folder")
    return folder


def audio_vae_class(folder: Path) -> str:
    """The class an ``audio_vae_folder``'s config.json names (checked there)."""
    return read_json(folder / "config.json", str(folder / "config.json"), kind=dict,
                     fix="save the audio VAE with save_pretrained")["_class_name"]


class AudioLatentEncoder:
    """LTX-2's audio VAE (``AutoencoderKLLTX2Audio``) from a local diffusers folder, as prepare encodes with it."""

    def __init__(self, path: str | Path, subfolder: str | None = "audio_vae", *, device="cpu",
                 dtype: torch.dtype = torch.float32, setting: str = "audio_vae"):
        import diffusers

        folder = audio_vae_folder(path, subfolder, setting)
        self.folder, self.path, self.setting = folder, path, setting
        self.model = diffusers.AutoencoderKLLTX2Audio.from_pretrained(str(folder), torch_dtype=dtype,
                                                                      use_safetensors=True)
        self.model.to(device).eval().requires_grad_(False)
        self.device, self.dtype = torch.device(device), dtype
        vae = self.model.config
        self.rate, self.hop, self.mel_bins = int(vae.sample_rate), int(vae.mel_hop_length), int(vae.mel_bins)
        self.channels = int(vae.in_channels)  # the spectrogram's: 2, stereo
        self.compression = int(self.model.temporal_compression_ratio)

    def encode_waveform(self, waveform: Tensor, seconds: float) -> Tensor:
        """(B, channels, samples) at ``self.rate`` -> (B, C, L, M) normalised latents of ``seconds`` of sound: the
        posterior's mode (as prepare encodes video), normalised per feature of the packed (B, L, C * M) latents
        with the VAE's latents_mean / latents_std (LTX2Pipeline._normalize_audio_latents)."""
        mel = log_mel(waveform, self.rate, self.hop, self.mel_bins)  # (B, ch, F, mel_bins)
        with torch.no_grad():
            latents = self.model.encode(mel.to(self.device, self.dtype)).latent_dist.mode()  # (B, C, L', M)
        length = latent_audio_frames(seconds, self.rate, self.hop, self.compression)
        if latents.shape[2] < length:  # cannot happen with the padding of encode_clip; said plainly if it does
            raise ValueError(f"the audio VAE gave {latents.shape[2]} latent frames for {seconds:.3f} s, fewer than "
                             f"the {length} LTX2Pipeline counts")
        latents = latents[:, :, :length].float()  # (B, C, L, M)
        packed = latents.transpose(1, 2).flatten(2)  # (B, L, C * M), LTX2Pipeline._pack_audio_latents
        mean, std = (t.float().to(packed.device) for t in (self.model.latents_mean, self.model.latents_std))
        packed = (packed - mean) / std
        return packed.unflatten(2, (latents.shape[1], -1)).transpose(1, 2).cpu()  # (B, C, L, M)

    def encode_clip(self, path: str | Path, first_frame: int, source_frames: float,
                    source_fps: float | None = None) -> Tensor:
        """The sound of the window of the clip at ``path`` that starts at source frame ``first_frame`` and spans
        ``source_frames`` source frames (a window's frames x its timeline step) -> (C, L, M) latents; times at
        ``source_fps`` (None: the file's frame rate)."""
        fps = float(source_fps or video_rate(path))
        start, seconds = first_frame / fps, float(source_frames) / fps
        # two latent frames of sound beyond the window: the causal encoder's last latent frames see whole mel frames
        extra = self.hop * self.compression * 2 / self.rate
        waveform = read_waveform(path, start, seconds + extra, self.rate, self.channels)
        return self.encode_waveform(waveform[None], seconds)[0]

    def describe(self) -> dict:
        """What a shard records of its audio latents (``audio_vae`` metadata): what training checks the model
        against (its audio_sampling_rate / audio_hop_length) and decoding needs."""
        return {"class": AUDIO_VAE_CLASS, "path": str(self.folder.resolve()), "sample_rate": self.rate,
                "mel_hop_length": self.hop, "mel_bins": self.mel_bins, "temporal_compression": self.compression}

