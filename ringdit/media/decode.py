"""Decode sampled latents with their VAE and write pictures / videos.

    python -m ringdit.media.decode outputs/infer/runs/<run>/samples.npz vae=Wan2.1-T2V [out=FOLDER fps=16 tile=256]
    python -m ringdit.media.decode samples=samples.npz vae=sd-vae normalised=false   # a data=latents model (raw)

reads ``latents`` float32 (N, C, [T,] H, W) from samples.npz (what infer.py writes for a latent-space model),
inverts the VAE normalisation the data was prepared with (ringdit/media/vae.py), decodes one sample at a time
(tiled, so memory stays bounded for long or large videos) and writes samples.png + sample-000.png ... (images) or
samples.gif + sample-000.mp4 / .gif (videos) into ``out`` (default: beside samples.npz).

Settings: conf/decode.yaml (``--help``, ``--cfg job``). The samples.npz is the ``samples=`` setting; a first
argument that is not ``key=value`` is taken as it, so ``decode PATH vae=...`` works as well.
"""

from __future__ import annotations

import logging
import re
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from ringdit.commands.task import Task, command
from ringdit.common.errors import ConfigError, require_count
from ringdit.media.audio import AudioDecoder
from ringdit.media.images import to_uint8
from ringdit.media.vae import VAE, vae_folder
from ringdit.media.writing import write_pixels
from ringdit.models.conditioning import text_conditioned

log = logging.getLogger("ringdit.media.decode")


def decode_latents(latents: torch.Tensor, vae: VAE, normalised: bool = True, group=None) -> np.ndarray | None:
    """(N, C, [T,] H, W) latents -> uint8 pixels (N, [T,] H, W, 3), one sample at a time (each becomes uint8 at
    once, so a batch of long videos never sits in memory as float32). ``normalised``: see ``VAE.decode``.
    ``group``: a process group whose ranks all call this with the same latents: each sample's tiles are decoded
    over its ranks (``VAE.decode(group=)``) and the pixels come back on its rank 0, None on the others."""
    if vae.is_video and latents.ndim == 4:
        latents = latents[:, :, None]  # (N, C, 1, H, W): an image latent of a video VAE
    if not vae.is_video and latents.ndim == 5:
        raise ValueError(f"latents are videos {tuple(latents.shape)} (N, C, T, H, W) but vae={vae.folder} is an "
                         f"image VAE ({vae.class_name}); decode with the video VAE the training data was prepared with")
    if latents.shape[1] != vae.channels:
        raise ValueError(f"latents have {latents.shape[1]} channels but vae={vae.folder} has "
                         f"{vae.channels}; decode with the VAE the training data was prepared with")
    pixels = []
    for sample in latents:
        decoded = vae.decode(sample[None], normalised, group=group)
        pixels.append(None if decoded is None else to_uint8(decoded))  # each (1, [T,] H, W, 3)
    if pixels[0] is None:  # not rank 0 of the group
        return None
    decoded = torch.cat(pixels).numpy()
    if vae.is_video and decoded.shape[1] == 1:
        decoded = decoded[:, 0]  # one-frame videos are images
    return decoded


def decode_samples(samples: str | Path, vae: str | Path, out: str | Path | None = None, *,
                   vae_subfolder: str | None = "vae", fps: int | None = None, tiling: bool = True, tile: int | None = None,
                   device: str = "cpu", normalised: bool = True, group=None, tile_setting: str = "tile",
                   audio_vae: str | Path | None = None, audio_vae_subfolder: str | None = "audio_vae",
                   vocoder_subfolder: str = "vocoder") -> list[Path]:
    """samples.npz (its ``latents``) -> media files in ``out`` (default: samples.npz's folder); with ``audio_vae``
    (LTX-2's audio VAE and vocoder folder) the npz's ``audio`` latents become each MP4's sound track. ``normalised``:
    the latents are as prepare stores them (data=text_latents); false for data=latents, whose samples are the raw
    VAE latents (infer.py already divides by data.scale). ``group``: a process group whose ranks all call this
    (infer.py's sampling ranks): its rank 0 reads the file and sends the latents to the others, the tiles are
    decoded over every rank (``ringdit.media.parallel_vae``), and rank 0 writes the files (the others return [])."""
    require_count("fps", fps, optional=True)  # None: the rate samples.npz holds (videos), none for images
    for name, value in (("tiling", tiling), ("normalised", normalised)):
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
    require_count(tile_setting, tile, optional=True,
                  hint=f"the VAE's spatial tile size in pixels, e.g. {tile_setting}=256")
    latents, _ = shared_latents(samples, group)
    sound = stored_audio(samples, audio_vae) if audio_vae else None  # read (and refused) before the VAE loads
    target = Path(str(out)).expanduser() if out else None
    if target is not None and target.exists() and not target.is_dir():
        raise ConfigError(f"out={out} is a file; pass a folder to write the pictures / videos into")
    codec = VAE(vae, vae_subfolder, device=device, tiling=tiling, tile=tile, tile_setting=tile_setting)
    try:
        pixels = decode_latents(latents, codec, normalised, group=group)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if pixels is None:  # a rank other than the group's first: its tiles are decoded, rank 0 writes
        return []
    if fps is None and pixels.ndim == 5:  # videos: the rate infer.py wrote beside them (the model's), else 16
        fps = stored_fps(samples) or DEFAULT_FPS
    sounds = AudioDecoder.load(audio_vae, audio_vae_subfolder, vocoder_subfolder, device=device).decode(sound) \
        if sound is not None else None
    return write_pixels(pixels, target or Path(str(samples)).expanduser().parent, fps=fps, sounds=sounds)


def stored_audio(samples: str | Path, audio_vae) -> torch.Tensor:
    """The ``audio`` latents infer.py stored for a model that samples sound (LTX-2), float32 (N, 1, L, C x M); a
    ConfigError where there are none."""
    with np.load(Path(str(samples)).expanduser(), allow_pickle=False) as stored:
        if "audio" not in stored.files:
            raise ConfigError(f"audio_vae={audio_vae}: samples={samples} holds no 'audio' latents (its model samples "
                              f"no sound); drop audio_vae=")
        return torch.from_numpy(stored["audio"].astype(np.float32, copy=False))


DEFAULT_FPS = 16  # samples.npz files without their rate (written before infer.py stored it): Wan 2.1's


def stored_fps(samples: str | Path) -> int | None:
    """The frames per second infer.py stored in samples.npz (``fps``: its model's rate, or the run's fps=); None
    where it stored none (images, older files). A value that is not a positive integer is a ``ConfigError``."""
    with np.load(Path(str(samples)).expanduser(), allow_pickle=False) as stored:
        if "fps" not in stored.files:
            return None
        value = stored["fps"]
    if value.shape != () or value.dtype.kind not in "iu" or int(value) < 1:
        raise ConfigError(f"samples={samples}: its 'fps' is {value!r}, not a positive integer; pass fps=16 (the "
                          f"rate to write the videos at)")
    return int(value)


def shared_latents(samples: str | Path, group=None, index: bool = False) -> tuple[torch.Tensor, list[int] | None]:
    """``read_latents(samples)`` (and with ``index``, the npz's ``index`` list) on this process, or with ``group`` on
    the group's rank 0, sent to its other ranks (the file need not be on their file system); a bad file is the
    same ``ConfigError`` on every rank."""
    import torch.distributed as dist

    def read():
        latents = read_latents(samples)
        if not index:
            return latents, None
        with np.load(Path(str(samples)).expanduser(), allow_pickle=False) as stored:
            return latents, stored["index"].tolist()

    if group is None or dist.get_world_size(group) == 1:
        return read()
    message = [None]
    if dist.get_rank(group) == 0:
        try:
            message[0] = read()
        except ConfigError as error:
            message[0] = error
    dist.broadcast_object_list(message, src=dist.get_global_rank(group, 0), group=group)
    if isinstance(message[0], ConfigError):
        raise message[0]
    return message[0]


UNREADABLE = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)  # what np.load raises on a bad file
EXPECTED = ("pass the samples.npz infer.py wrote for a model trained on latents: it holds 'latents', float32 "
            "(N, C, H, W) images or (N, C, T, H, W) videos")


def read_latents(samples: str | Path, setting: str = "samples") -> torch.Tensor:
    """``latents`` (N, C, [T,] H, W) float32 from a samples.npz infer.py wrote; anything else is one
    ``ConfigError`` naming the file and what it should hold (never a pickle: ``allow_pickle=False``)."""
    path = Path(str(samples)).expanduser()
    if not path.exists():
        raise ConfigError(f"{setting}={samples} does not exist; {EXPECTED}")
    if not path.is_file():
        raise ConfigError(f"{setting}={samples} is a folder, not a file; {EXPECTED}")
    try:
        stored = np.load(path, allow_pickle=False)
    except UNREADABLE as error:
        detail = "neither a zip archive nor a .npy array" if "pickled" in str(error) else _first_line(error)
        raise ConfigError(f"{setting}={samples} is not a readable .npz file ({detail}); {EXPECTED}") from None
    if not isinstance(stored, np.lib.npyio.NpzFile):
        raise ConfigError(f"{setting}={samples} is a single .npy array {stored.shape}, not an .npz archive; "
                          f"{EXPECTED}")
    with stored:
        if "latents" not in stored.files:
            if "images" in stored.files:
                raise ConfigError(f"{setting}={samples} holds {sorted(stored.files)}, no 'latents': it was sampled in "
                                  f"pixel space, so its pictures are already written beside it")
            raise ConfigError(f"{setting}={samples} holds {sorted(stored.files)}, no 'latents'; {EXPECTED}")
        try:
            latents = stored["latents"]
        except UNREADABLE as error:
            raise ConfigError(f"{setting}={samples}: its 'latents' cannot be read ({_first_line(error)}); "
                              f"{EXPECTED}") from None
    if latents.ndim not in (4, 5):
        raise ConfigError(f"{setting}={samples}: latents have shape {latents.shape}; {EXPECTED}")
    if latents.dtype.kind != "f":
        raise ConfigError(f"{setting}={samples}: latents are {latents.dtype}, not floating point; {EXPECTED}")
    if len(latents) == 0:
        raise ConfigError(f"{setting}={samples}: latents have shape {latents.shape}, no samples; {EXPECTED}")
    finite = np.isfinite(latents.reshape(len(latents), -1)).all(axis=1)
    if not finite.all():  # decoded anyway (the others may be fine); the NaN ones come out as noise or black
        log.warning("%s=%s: samples %s hold NaN or Inf latents (sampling diverged?); their pictures are meaningless",
                    setting, samples, np.flatnonzero(~finite).tolist()[:10])
    return torch.from_numpy(latents.astype(np.float32, copy=False))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def main(argv: list[str] | None = None) -> None:
    """The command on ``argv`` (default ``sys.argv[1:]``), a first argument that is not ``key=value`` being
    ``samples=``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-") and not re.match(r"[~+]{0,2}[\w.]+=", argv[0]):
        argv[0] = f"samples={_quoted(argv[0])}"
    decode_command(argv)


def _quoted(value: str) -> str:
    """``value`` as one quoted string of Hydra's override grammar (any path: spaces, commas, brackets, ``=``)."""
    escaped = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)  # \' and the backslashes before it
    escaped = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, escaped).replace("${", "\\${")
    return f"'{escaped}'"


# SIGTERM: decoding stops where it is; the latents are read only, so the same command decodes them again
@command("decode", doing="decoding", kept="the samples are as they were (decoded files may be incomplete); run the "
                                          "same command again")  # conf/decode.yaml
def decode_command(cfg: DictConfig, task: Task) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    settings = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # a ??? left: one line
    written = decode_samples(**settings)  # a wrong setting or file: one line, exit code 2
    task.start()
    print(f"wrote {len(written)} files: {', '.join(str(p) for p in written[:4])}{' ...' if len(written) > 4 else ''}")


def sampling_vae(vae: str | None, subfolder: str | None, data_info: dict) -> str | None:
    """infer.py's ``vae``: the given folder (checked now, before sampling), else the VAE the training data was
    prepared with when that folder exists here, else None (samples.npz only)."""
    if vae:
        if "latent_scale" not in data_info:
            raise ConfigError(f"vae={vae}: this model samples pixels (it was not trained on latents), so there is "
                              f"nothing to decode; drop vae=")
        vae_folder(vae, subfolder)  # a wrong folder fails before minutes of sampling
        return str(vae)
    prepared = (data_info.get("vae") or {}).get("path")
    if prepared and Path(prepared).is_dir():
        vae_folder(prepared, subfolder)  # its weights checked now too, not after the sampling
        log.info("decoding with the VAE the training data was prepared with: %s", prepared)
        return prepared
    return None


def latents_normalised(data_info: dict) -> bool:
    """Whether a model's sampled latents are VAE-normalised (data=text_latents, as prepare stores them) rather than
    raw VAE latents (data=latents: infer.py divides by data.scale)."""
    return "vae" in data_info or text_conditioned(data_info)


if __name__ == "__main__":
    main()
