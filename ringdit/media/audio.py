"""Sound beside the video: LTX-2's audio latents decoded to a waveform (its audio VAE's mel spectrogram, then its
vocoder), as ``LTX2Pipeline`` decodes them, or MiniMax-H3's stereo latents by its mono audio VAE alone
(``ringdit.media.minimax_audio.decode_stereo``, as its modular pipeline decodes them), and the check that an audio VAE
fits the transformer it decodes for. Which decoding is the audio VAE's class's (its config's ``_class_name``).

    waveform = decode_audio(latents, audio_vae, vocoder)   # (B, channels, samples), at vocoder_rate(vocoder)
    write_mp4(frames, path, fps, audio=(waveform[i], vocoder_rate(vocoder)))  # ringdit.media.writing
    decoder = AudioDecoder.load("LTX-2")                   # its audio_vae/ and vocoder/ folders
    sounds = decoder.decode(latents)                       # [(waveform (channels, samples), rate)] one a sample
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ringdit.common.errors import ConfigError
from ringdit.common.safe_json import read_json
from ringdit.media.minimax_audio import AUDIO_VAE_CLASS as STEREO_VAE_CLASS
from ringdit.media.minimax_audio import decode_stereo
from ringdit.media.pretrained import find_folder

Tensor = torch.Tensor

AUDIO_VAE_CLASS = "AutoencoderKLLTX2Audio"
AUDIO_VAE_CLASSES = (AUDIO_VAE_CLASS, STEREO_VAE_CLASS)  # the second decodes the waveform itself: no vocoder
VOCODER_CLASSES = ("LTX2Vocoder", "LTX2VocoderWithBWE")  # diffusers.pipelines.ltx2's
MEL_COMPRESSION = 4  # AutoencoderKLLTX2Audio's mel_compression_ratio (its LATENT_DOWNSAMPLE_FACTOR), for a bare config


def latent_mel_bins(audio_vae) -> int:
    """The mel bins of one audio latent frame: the VAE's mel bins over its mel compression (LTX2Pipeline's);
    ``audio_vae``: the model, or its config (a dict: its config.json)."""
    config = audio_vae if isinstance(audio_vae, dict) else audio_vae.config
    return config["mel_bins"] // getattr(audio_vae, "mel_compression_ratio", MEL_COMPRESSION)


def check_audio_vae(audio_vae, config: dict, setting: str = "audio_vae", data: dict | None = None) -> None:
    """A ConfigError unless ``audio_vae`` (an ``AutoencoderKLLTX2Audio`` or ``AutoencoderKLMiniMaxH3Audio``, or its
    config.json as a dict) decodes the audio latents of a transformer of ``config``: the sample rate the data's sound
    was encoded at (``data``'s ``audio_vae`` record, where prepare wrote one); LTX-2's: the model's sample rate and
    mel hop (its audio RoPE times its tokens in seconds of them), and latent channels x mel bins = audio_in_channels;
    MiniMax-H3's: latent channels = audio_in_channels."""
    vae = _Config(audio_vae if isinstance(audio_vae, dict) else dict(audio_vae.config))
    recorded = (data or {}).get("audio_vae") or {}
    if is_stereo(audio_vae):
        _check_rate(int(vae.sampling_rate), recorded, setting)
        if vae.latent_channels != config["audio_in_channels"]:
            raise ConfigError(f"{setting}: the audio VAE's latents have {vae.latent_channels} channels, the model "
                              f"takes model.config.audio_in_channels={config['audio_in_channels']}; use the audio VAE "
                              f"of the model's own pipeline")
        return
    _check_rate(vae.sample_rate, recorded, setting)
    rate, hop = config["audio_sampling_rate"], config["audio_hop_length"]
    if vae.sample_rate != rate or vae.mel_hop_length != hop:
        raise ConfigError(f"{setting}: the audio VAE works at {vae.sample_rate} Hz with a mel hop of "
                          f"{vae.mel_hop_length}, the model's audio at {rate} Hz with a hop of {hop} "
                          f"(model.config.audio_sampling_rate / audio_hop_length): its latents would be another "
                          f"duration than the model's; use the audio VAE of the model's own pipeline")
    width = vae.latent_channels * latent_mel_bins(audio_vae)
    if width != config["audio_in_channels"]:
        raise ConfigError(f"{setting}: the audio VAE's latents have {vae.latent_channels} channels x "
                          f"{latent_mel_bins(audio_vae)} mel bins = {width} per frame, the model takes "
                          f"model.config.audio_in_channels={config['audio_in_channels']}; use the audio VAE of the "
                          f"model's own pipeline")


def _check_rate(sample_rate: int, recorded: dict, setting: str) -> None:
    """A ConfigError unless the audio VAE works at the sample rate the data's sound was encoded at (if recorded)."""
    if recorded.get("sample_rate") is not None and sample_rate != recorded["sample_rate"]:
        name = setting.split("=")[0]
        raise ConfigError(f"{setting}: the audio VAE works at {sample_rate} Hz but the data's sound was encoded "
                          f"at {recorded['sample_rate']} Hz (with {recorded.get('path')}): it would decode another "
                          f"sound; use the audio VAE the data were prepared with, {name}={recorded.get('path')}")


def is_stereo(audio_vae) -> bool:
    """Whether ``audio_vae`` (a model, or its config.json's dict) is MiniMax-H3's mono VAE of stereo latents, which
    decodes to the waveform itself (no vocoder)."""
    name = audio_vae.get("_class_name") if isinstance(audio_vae, dict) else type(audio_vae).__name__
    return name == STEREO_VAE_CLASS


def decode_audio(latents: Tensor, audio_vae, vocoder) -> Tensor:
    """Audio latents ``(B, C, L, M)`` -- or sampling's ``(B, 1, L, C * M)``: the same tokens -- on the audio VAE's
    normalised scale -> the waveform ``(B, channels, samples)``, as LTX2Pipeline decodes: per-feature
    denormalisation of the packed ``(B, L, C * M)`` latents, unpacked to the VAE's ``(B, C, L, M)``, its mel
    spectrogram, the vocoder."""
    packed = latents.transpose(1, 2).flatten(2)  # (B, L, C * M), the pipeline's packing
    mean, std = (t.to(packed) for t in (audio_vae.latents_mean, audio_vae.latents_std))
    packed = packed * std + mean
    unpacked = packed.unflatten(2, (-1, latent_mel_bins(audio_vae))).transpose(1, 2)  # (B, C, L, M)
    dtype = next(audio_vae.parameters()).dtype
    mel = audio_vae.decode(unpacked.to(dtype), return_dict=False)[0]
    return vocoder(mel.to(next(vocoder.parameters()).dtype))


def vocoder_rate(vocoder) -> int:
    """The sample rate of the vocoder's waveform."""
    return int(vocoder.config.output_sampling_rate)


class _Config(dict):
    """A config.json's dict read by attribute, as a diffusers model's ``config`` is."""

    __getattr__ = dict.__getitem__


def audio_decoder_folders(path, audio_vae_subfolder: str | None = "audio_vae", vocoder_subfolder: str = "vocoder",
                          setting: str = "audio_vae") -> tuple[Path, Path | None]:
    """(the audio VAE's folder, the vocoder's) of ``path``: an LTX-2 pipeline folder with both subfolders, or the
    audio VAE's own folder with the vocoder's beside it; their configs' classes checked (nothing loaded). MiniMax-H3's
    audio VAE (its pipeline folder's audio_vae/, or the folder itself) has no vocoder: (its folder, None)."""
    folder = find_folder(path, audio_vae_subfolder or ".", "config.json", setting)
    if is_stereo(_check_class(folder, AUDIO_VAE_CLASSES, path, setting)):
        return folder, None
    root = Path(str(path)).expanduser()
    for vocoder in (root / vocoder_subfolder, folder.parent / vocoder_subfolder):
        if (vocoder / "config.json").is_file():
            _check_class(vocoder, VOCODER_CLASSES, path, setting)
            return folder, vocoder
    raise ConfigError(f"{setting}={path}: no vocoder beside the audio VAE (no config.json in "
                      f"{root / vocoder_subfolder} or {folder.parent / vocoder_subfolder}); give the LTX-2 pipeline "
                      f"folder, which holds audio_vae/ and vocoder/")


def _check_class(folder: Path, classes: tuple[str, ...], path, setting: str) -> dict:
    config = read_json(folder / "config.json", f"{setting}={path}: {folder / 'config.json'}", kind=dict,
                       fix="save it with save_pretrained")
    if config.get("_class_name") not in classes:
        raise ConfigError(f"{setting}={path}: {folder / 'config.json'} describes {config.get('_class_name')!r}, not "
                          f"{' or '.join(classes)}; give the LTX-2 pipeline folder (its audio_vae/ and vocoder/) or "
                          f"the MiniMax-H3 one (its audio_vae/)")
    return config


def sampling_audio_vae(path, audio_vae_subfolder: str | None, vocoder_subfolder: str, data: dict,
                       model_config: dict | None, setting: str = "audio_vae") -> str | None:
    """A sampling run's ``audio_vae`` (infer.py, the server, the previews), checked before anything is sampled:
    the given folder, else the audio VAE the data's sound was encoded with (prepare's ``audio_vae`` record) when that
    folder is here, else None (the videos are written silent). ``model_config``: the transformer's config of a model
    that samples sound (None: one that samples none, for which a given folder is refused)."""
    if model_config is None:
        if path:
            raise ConfigError(f"{setting}={path}: this model samples no sound (only LTX-2 and MiniMax-H3 "
                              f"generate audio with video); drop {setting}=")
        return None
    folder = path or (data.get("audio_vae") or {}).get("path")
    if not path and not (folder and Path(folder).is_dir()):
        return None
    vae_folder, _ = audio_decoder_folders(folder, audio_vae_subfolder, vocoder_subfolder, setting)
    check_audio_vae(audio_vae_config(vae_folder), model_config, f"{setting}={folder}", data)
    return str(folder)


def audio_vae_config(folder: Path) -> dict:
    """The audio VAE's config.json (``audio_decoder_folders``' first folder)."""
    return read_json(folder / "config.json", str(folder / "config.json"), kind=dict,
                     fix="save it with save_pretrained")


class AudioDecoder:
    """LTX-2's audio VAE and vocoder, or MiniMax-H3's audio VAE alone (``vocoder`` None): sampled audio latents ->
    each sample's waveform, as the model's pipeline decodes."""

    def __init__(self, audio_vae, vocoder):
        self.audio_vae, self.vocoder = audio_vae, vocoder

    @classmethod
    def load(cls, path, audio_vae_subfolder: str | None = "audio_vae", vocoder_subfolder: str = "vocoder", *,
             device="cpu", dtype: torch.dtype = torch.float32, setting: str = "audio_vae") -> AudioDecoder:
        """Both from local diffusers folders (``audio_decoder_folders``), safetensors only (a pickled .bin can run
        code, and infer.py may take the folder from a checkpoint's data)."""
        import diffusers  # here: diffusers' pipelines load only where sound is decoded
        from diffusers.pipelines import ltx2

        vae_folder, vocoder_folder = audio_decoder_folders(path, audio_vae_subfolder, vocoder_subfolder, setting)
        vae_class = getattr(diffusers, audio_vae_config(vae_folder)["_class_name"])  # one of AUDIO_VAE_CLASSES
        vocoder_class = getattr(ltx2, audio_vae_config(vocoder_folder)["_class_name"]) if vocoder_folder else None
        try:
            audio_vae = vae_class.from_pretrained(str(vae_folder), torch_dtype=dtype, use_safetensors=True)
            vocoder = None if vocoder_class is None else vocoder_class.from_pretrained(
                str(vocoder_folder), torch_dtype=dtype, use_safetensors=True)
        except (OSError, ValueError, RuntimeError) as error:
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ConfigError(f"{setting}={path}: cannot load the audio VAE / vocoder ({first}); save them with "
                              f"save_pretrained (safetensors)") from None
        vocoder = None if vocoder is None else vocoder.to(device).eval().requires_grad_(False)
        return cls(audio_vae.to(device).eval().requires_grad_(False), vocoder)

    @property
    def rate(self) -> int:
        return int(self.audio_vae.config.sampling_rate) if self.vocoder is None else vocoder_rate(self.vocoder)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> list[tuple[np.ndarray, int]]:
        """Audio latents ``(N, C, L, M)`` or sampling's ``(N, 1, L, C * M)`` (MiniMax-H3's: ``(N, 2, L, C_a)``) ->
        each sample's (waveform float32 (channels, samples) in [-1, 1], sample rate), one sample at a time."""
        if self.vocoder is None:
            return [(decode_stereo(sample, self.audio_vae).cpu().numpy(), self.rate) for sample in latents]
        device = next(self.audio_vae.parameters()).device
        return [(decode_audio(sample[None].to(device), self.audio_vae, self.vocoder)[0].float().cpu().numpy(),
                 self.rate) for sample in latents]
