"""A procedural ``data=text_latents`` set (``data=synthetic_text_latents``): tests and CPU demos without downloads."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ringdit.data.text_latent_shards import write_text_latents
from ringdit.data.text_latents import TextLatentsDataModule
from ringdit.common.errors import ConfigError, require_count

Tensor = torch.Tensor


def synthetic_text_latents(num_samples: int, *, channels: int = 4, frames: int = 3, size: int | tuple[int, int] = 8,
                           text_len: int = 8, text_dim: int = 16, num_prompts: int = 8, pooled_dim: int = 0,
                           seed: int = 0, first_sample: int = 0, image: bool = False, image_dim: int = 0,
                           control: int = 0, audio: tuple[int, int, int] | None = None,
                           reference: bool = False) -> dict:
    """``num_samples`` latent videos (``frames=0``: images) of ``size`` (H = W, or (H, W)) of a soft blob whose start
    and direction depend on the prompt; ``pooled_dim`` > 0 adds a pooled prompt embedding (Flux); ``image`` adds the
    first-frame conditioning of image-to-video (``image_latents``: the first latent frame, ``image_condition``: it
    followed by zero frames) and ``image_dim`` > 0 a random stand-in for CLIP image embeddings (N, 4, image_dim);
    ``control`` > 0 a control video of that many channels (Wan VACE's ``control``: the clip's own latents repeated
    over the channels, a control the model can learn to follow); ``audio`` = (channels, frames, mel bins) the clip's
    sound as audio latents (LTX-2's ``audio``, denoised with the video: a tone whose pitch and loudness per mel bin
    depend on the prompt); ``reference`` a reference image per image (Qwen-Image-Edit's ``reference``: the image's own
    latents mirrored left to right, an edit the model can learn).

    Prompt p has a fixed random text embedding (its first ``3 + p % (text_len - 2)`` tokens real, the rest zero, as
    padded encoder states are) and caption ``"blob p"``; each video is drawn from (seed, sample index), the samples
    numbered from ``first_sample`` (a bucket's samples follow the buckets before it). Returns the
    ``write_text_latents`` arguments.
    """
    height, width = (size, size) if isinstance(size, int) else size
    g = torch.Generator().manual_seed(seed)
    prompt_text = torch.randn(num_prompts, text_len, text_dim, generator=g)
    lengths = torch.tensor([3 + p % max(1, text_len - 2) for p in range(num_prompts)]).clamp(max=text_len)
    prompt_mask = torch.arange(text_len)[None, :] < lengths[:, None]  # (num_prompts, L)
    prompt_text = prompt_text * prompt_mask[..., None]
    angles = torch.arange(num_prompts) * (2 * math.pi / num_prompts)
    colours = torch.randn(num_prompts, channels, generator=g)
    prompt_pooled = torch.randn(num_prompts, pooled_dim, generator=g)
    # the samples' prompts and jitter: after the prompts' draws (one bucket), or from the bucket's own stream
    draws = torch.Generator().manual_seed(seed * 1_000_003 + first_sample) if first_sample else g
    prompts = torch.randint(num_prompts, (num_samples,), generator=draws)
    jitter = torch.rand(num_samples, 2, generator=draws) - 0.5
    rows, cols = torch.arange(height, dtype=torch.float32), torch.arange(width, dtype=torch.float32)
    videos = []
    for i, p in enumerate(prompts.tolist()):
        direction = torch.stack([torch.cos(angles[p]), torch.sin(angles[p])])
        frames_ = []
        for f in range(max(frames, 1)):
            # videos: the blob travels along the prompt's direction; images: it sits off-centre in that direction
            step = (f - (frames - 1) / 2) * min(height, width) / (2 * frames) if frames else min(height, width) / 4
            centre = torch.tensor([(height - 1) / 2, (width - 1) / 2]) + step * direction + jitter[i]
            blob = torch.exp(-((rows[:, None] - centre[0]) ** 2 + (cols[None, :] - centre[1]) ** 2) / 4.0)  # (H, W)
            frames_.append(colours[p][:, None, None] * blob)  # (C, H, W)
        videos.append(torch.stack(frames_, dim=1) if frames else frames_[0])  # (C, T, H, W) or (C, H, W)
    null = {"text": torch.zeros(text_len, text_dim), "text_mask": torch.zeros(text_len, dtype=torch.bool)}
    result = {"latents": torch.stack(videos), "text": prompt_text[prompts], "text_mask": prompt_mask[prompts],
              "null": null, "captions": [f"blob {p}" for p in prompts.tolist()]}
    if pooled_dim:
        result["pooled"], null["pooled"] = prompt_pooled[prompts], torch.zeros(pooled_dim)
    if image or image_dim:
        result["image"] = synthetic_image_condition(result["latents"], image, image_dim, draws)
    if control:
        latents = result["latents"]  # (N, C, T, H, W)
        if latents.dim() != 5:
            raise ConfigError("data.control needs videos: set data.frames >= 1 (a control video has the clip's frames)")
        copies = -(-control // latents.shape[1])
        result.setdefault("image", {})["control"] = latents.repeat(1, copies, 1, 1, 1)[:, :control]  # (N, control, ...)
    if audio:
        result.setdefault("image", {})["audio"] = synthetic_audio(prompts, num_prompts, audio, seed)
    if reference:
        if frames:
            raise ConfigError("data.reference=true needs images: set data.frames=0 (a reference image conditions "
                              "images)")
        result.setdefault("image", {})["reference"] = result["latents"].flip(-1)  # (N, C, H, W)
    return result


def synthetic_audio(prompts: Tensor, num_prompts: int, shape: tuple[int, int, int], seed: int) -> Tensor:
    """(N, C, L, M) audio latents of the samples' ``prompts`` (N,): prompt p's tone, a cosine over the L frames at its
    own frequency, times its own random weights per channel and mel bin (drawn from a stream of their own, so the
    video draws stay those of the same data without audio)."""
    channels, frames, mel_bins = shape
    g = torch.Generator().manual_seed(seed * 7_919 + 1)
    weights = torch.randn(num_prompts, channels, 1, mel_bins, generator=g)  # (P, C, 1, M)
    frequencies = 0.3 + 0.2 * torch.arange(num_prompts, dtype=torch.float32)  # (P,)
    tone = torch.cos(frequencies[:, None] * torch.arange(frames, dtype=torch.float32)[None, :])  # (P, L)
    return (weights * tone[:, None, :, None])[prompts]  # (N, C, L, M)


def synthetic_image_condition(latents: Tensor, image: bool, image_dim: int, generator: torch.Generator
                              ) -> dict[str, Tensor]:
    """Stand-ins for prepare task=i2v's keys of videos ``latents`` (N, C, T, H, W): the first latent frame as the
    image's latents (a causal VAE encodes the first frame alone into it), [it ; zeros] as the I2V condition, and
    ``image_dim`` > 0 random embeddings (N, 4, image_dim) (only their shape and flow are tested)."""
    if latents.dim() != 5:
        raise ConfigError("data.image=true needs videos: set data.frames >= 1 (image-to-video conditions on the "
                          "first frame)")
    first = latents[:, :, :1]  # (N, C, 1, H, W)
    out = {"image_latents": first, "image_condition": torch.cat([first, torch.zeros_like(latents[:, :, 1:])], 2)} \
        if image else {}
    if image_dim:
        out["image_embeds"] = torch.randn(latents.shape[0], 4, image_dim, generator=generator)
    return out


class SyntheticTextLatentsDataModule(TextLatentsDataModule):
    """``data=synthetic_text_latents``: ``synthetic_text_latents`` written once to ``cache_dir`` and read like any
    text_latents folder (so the same code path is exercised); regenerated when the settings change.

    ``buckets``: a list of latent shapes ``[T, H, W]`` (videos) or ``[H, W]`` (images; ``frames`` is then unused):
    a mixed-bucket set, one shard per bucket, ``num_samples`` split between them as ``bucket_samples`` says (default
    evenly). None: one bucket of ``frames`` x ``size`` x ``size``. ``image`` / ``image_dim``: the image-to-video keys
    (``synthetic_image_condition``); ``control``: a control video's channels (Wan VACE); ``reference``: a reference
    image per image (Qwen-Image-Edit)."""

    def __init__(self, cache_dir: str, num_samples: int = 512, channels: int = 4, frames: int = 3, size: int = 8,
                 text_len: int = 8, text_dim: int = 16, num_prompts: int = 8, pooled_dim: int = 0,
                 batch_size: int = 8, num_workers: int = 0, val_fraction: float = 0.05, val_batches: int = 4,
                 seed: int = 0, buckets: list | None = None, bucket_samples: list[int] | None = None,
                 tokens_per_batch: int | None = None, image: bool = False, image_dim: int = 0, control: int = 0,
                 audio: list[int] | None = None, reference: bool = False):
        settings = dict(num_samples=num_samples, channels=channels, frames=frames, size=size, text_len=text_len,
                        text_dim=text_dim, num_prompts=num_prompts, pooled_dim=pooled_dim, seed=seed)
        for key, value in settings.items():
            require_count(f"data.{key}", value, minimum=0 if key in ("seed", "frames", "pooled_dim") else 1)
        require_count("data.image_dim", image_dim, minimum=0)
        require_count("data.control", control, minimum=0)
        audio = audio_shape(audio)
        # image-to-video keys (named in the file only when asked for: the text-to-video sets keep their names)
        settings.update({"image": True} if image else {}, **({"image_dim": image_dim} if image_dim else {}),
                        **({"control": control} if control else {}), **({"audio": audio} if audio else {}),
                        **({"reference": True} if reference else {}))
        common = {key: value for key, value in settings.items() if key not in ("num_samples", "frames", "size")}
        if buckets is None:  # one file, as before buckets existed
            name = "-".join(f"{k}{_named(v)}" for k, v in settings.items())
            path = Path(cache_dir).expanduser() / f"synthetic-{name}.safetensors"
            if not path.is_file():
                write_text_latents(path, **synthetic_text_latents(**settings))
        else:  # a folder of one shard per bucket
            shapes = _synthetic_buckets(buckets)
            counts = _bucket_counts(bucket_samples, num_samples, len(shapes))
            path = Path(cache_dir).expanduser() / ("synthetic-" + "-".join(f"{k}{_named(v)}" for k, v in common.items())
                                                   + "-buckets-" + "-".join(f"{n}x{'x'.join(map(str, shape))}"
                                                                            for n, shape in zip(counts, shapes)))
            first = 0
            for index, (count, shape) in enumerate(zip(counts, shapes)):
                shard = path / f"shard-{index:05d}.safetensors"
                if not shard.is_file():
                    write_text_latents(shard, **synthetic_text_latents(
                        count, frames=shape[0] if len(shape) == 3 else 0, size=tuple(shape[-2:]), first_sample=first,
                        **common))
                first += count
        super().__init__(str(path), batch_size, num_workers, val_fraction, val_batches, seed,
                         tokens_per_batch=tokens_per_batch)


def audio_shape(audio) -> tuple[int, int, int] | None:
    """``data.audio`` as (channels, frames, mel bins) of the audio latents, None for none; a ConfigError otherwise."""
    if audio is None:
        return None
    from omegaconf import OmegaConf

    audio = OmegaConf.to_container(audio) if OmegaConf.is_config(audio) else audio
    if not isinstance(audio, (list, tuple)) or len(audio) != 3 or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in audio):
        raise ConfigError(f"data.audio={audio!r}: give the audio latents' [channels, frames, mel bins], e.g. "
                          f"data.audio=[2,5,2] (model=ltx2_tiny: 2 x 2 = its audio_in_channels 4)")
    return tuple(audio)


def _named(value) -> str:
    """A setting's value in a file name (a shape as 2x5x2)."""
    return "x".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _synthetic_buckets(buckets) -> list[tuple[int, ...]]:
    from omegaconf import OmegaConf

    buckets = OmegaConf.to_container(buckets) if OmegaConf.is_config(buckets) else buckets
    shapes = [tuple(b) for b in (list(buckets) if not isinstance(buckets, (str, int)) else [None])
              if isinstance(b, (list, tuple)) and len(b) in (2, 3) and all(isinstance(n, int) and n > 0 for n in b)]
    if not buckets or isinstance(buckets, (str, int)) or len(shapes) != len(buckets) or len({len(s) for s in shapes}) > 1:
        raise ConfigError(f"data.buckets={buckets!r}: give a list of latent shapes, all [T, H, W] (videos) or all "
                          f"[H, W] (images), e.g. data.buckets='[[3,6,10],[5,10,6]]'")
    return shapes


def _bucket_counts(bucket_samples, num_samples: int, buckets: int) -> list[int]:
    from omegaconf import OmegaConf

    bucket_samples = OmegaConf.to_container(bucket_samples) if OmegaConf.is_config(bucket_samples) else bucket_samples
    if bucket_samples is None:
        return [num_samples // buckets + (b < num_samples % buckets) for b in range(buckets)]
    counts = list(bucket_samples)
    if len(counts) != buckets or not all(isinstance(n, int) and n > 0 for n in counts):
        raise ConfigError(f"data.bucket_samples={bucket_samples!r}: give {buckets} positive sample counts, one per "
                          f"bucket of data.buckets (or leave it unset to split data.num_samples evenly)")
    return counts
