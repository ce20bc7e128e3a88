"""``Sampler``: what generating needs, apart from training -- the model, the ranks' ``ParallelDims``, the run's
``SamplingPipeline`` (sampler, settings, guidance), the device, this sampler's step cache and negative prompt, and
its ``Codecs``: the text encoder that turns prompts into conditions and the VAE that turns latents into pixels.

infer.py, the preview grids, the server, TeaCache's calibration and distillation's teacher each hold one; none sets
the pipeline's fields. The step cache and the negative prompt are fixed when the sampler is made, or for a block
(``with sampler.using(step_cache=...) as sampler:``), never written from outside. No LightningModule is needed: a
training module hands its model (and its EMA's weights) to one, infer.py's and the server's Lightning shell
(``ringdit.sampling.predict.SamplingModule``) builds one on the ranks Lightning started, and ``ringdit.load`` builds
one in the caller's process (``ringdit.sampling.resident``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import hydra
import numpy as np
import torch
from torch import nn

from ringdit.common.errors import ConfigError
from ringdit.diffusion.pipeline import SamplingPipeline
from ringdit.media.audio import AudioDecoder
from ringdit.media.decode import decode_latents, latents_normalised
from ringdit.media.images import to_uint8
from ringdit.models.conditioning import AUDIO_KEY
from ringdit.parallel import ParallelDims

Tensor = torch.Tensor
_KEEP = object()  # ``using``'s "as it is"


@dataclass(frozen=True)
class Codecs:
    """What turns prompts into a model's conditions and its latents into pixels: ``text_encoder`` (the one its data
    were encoded with: a ``ringdit.media.text.TextEncoder``, prompts -> a dict of (N, ...) tensors), ``vae`` (a
    ``ringdit.media.vae.VAE``) and whether the sampled latents are VAE-normalised (``latents_normalised``). A
    sampler without them samples conditions it is given and returns latents as numbers."""

    text_encoder: Callable[[list[str]], dict] | None = None
    vae: Any = None
    normalised: bool = True
    audio: AudioDecoder | None = None  # LTX-2's audio VAE + vocoder: the sound sampled beside the video

    @classmethod
    def of_data(cls, data: dict, text_encoder=None, vae=None, audio: AudioDecoder | None = None) -> Codecs:
        """The codecs of a model trained on ``data`` (its ``describe()``)."""
        return cls(text_encoder, vae, latents_normalised(data), audio)

    @property
    def takes_images(self) -> bool:
        """Whether the text encoder encodes each prompt with its reference image (an edit pipeline's template,
        ``prompt_template=qwenimage_edit``: ``TextEncoder.edit``); a plain callable encodes text alone."""
        return getattr(self.text_encoder, "edit", None) is not None

    def encode(self, prompts: list[str], images: list | None = None) -> dict[str, Tensor]:
        """``prompts`` -> the model's text conditions ``(N, ...)``, encoded with the text encoder its data were: the
        one way prompts become conditions (infer.py's, before any rank starts; ``Sampler.encode`` for the previews,
        the server and ``ringdit.load``). ``images``: one PIL picture a prompt, which an edit encoder
        (``takes_images``) reads with it, as the edit pipelines encode a prompt -- and their negative prompt -- with
        the sample's reference image; other encoders read the text alone."""
        if self.text_encoder is None:
            raise ValueError("this sampler has no text encoder to encode prompts with (Codecs.text_encoder)")
        if isinstance(prompts, str) or not prompts:
            raise ConfigError(f"prompts must be a non-empty list of strings, got {prompts!r}; e.g. "
                              f"prompts='[a red fox]'")
        prompts = [str(prompt) for prompt in prompts]
        if not self.takes_images:
            return self.text_encoder(prompts)
        template = self.text_encoder.template_name
        if images is None or len(images) != len(prompts):
            raise ConfigError(f"prompts: the data's text encoder (prompt_template={template}) encodes each prompt with "
                              f"its reference image, but {'no image was' if images is None else f'{len(images)} were'}"
                              f" given for {len(prompts)} prompts; pass the reference picture (infer.py image=<file>, "
                              f"the server's images/edits image)")
        return self.text_encoder(prompts, list(images))


class Sampler:
    """Samples ``model`` with ``pipeline`` on ``device`` over the ranks of ``dims``.

    ``step_cache``: a ``ringdit.caching.StepCache`` wrapped around each call (None: every block runs); ``negative``:
    the negative prompt's conditioning (text models) that calls guide away from unless they give their own (None:
    the empty prompt, the model's null condition); ``weights``: ``weights(use_ema)``, a context manager yielding the
    model with the weights worth sampling (a training module's EMA swapped in; None: ``model`` as it is);
    ``codecs``: its text encoder, VAE and audio decoder (``encode``, ``to_pixels``, ``sounds``)."""

    def __init__(self, model: nn.Module, dims: ParallelDims, pipeline: SamplingPipeline, device, *,
                 step_cache: Any = None, negative: dict | None = None,
                 weights: Callable[[bool], ContextManager[nn.Module]] | None = None, codecs: Codecs = Codecs()):
        self.model, self.dims, self.pipeline, self.device = model, dims, pipeline, device
        self.step_cache, self.negative, self.codecs = step_cache, negative, codecs
        self._weights = weights

    @classmethod
    def for_run(cls, model: nn.Module, objective, sampling: dict | None, data: dict, *,
                dims: ParallelDims | None = None, device=None, **keywords: Any) -> Sampler:
        """The sampler of a run's ``model`` as its checkpoint describes it: ``objective`` (a ``ringdit.diffusion``
        objective, or its config with ``_target_``), ``sampling`` (``diffusion.sampling``'s settings) and ``data``
        (the data's ``describe()``); ``dims`` default one process, ``device`` the CPU; ``keywords``: ``__init__``'s."""
        if isinstance(objective, dict) or hasattr(objective, "_target_"):
            objective = hydra.utils.instantiate(objective)
        pipeline = SamplingPipeline.for_run(objective, sampling, data)
        return cls(model, dims if dims is not None else ParallelDims(), pipeline,
                   torch.device("cpu") if device is None else device, **keywords)

    @property
    def pixels(self) -> bool:
        """Samples are pixels in [-1, 1] (they become images); else latents kept as numbers for a VAE."""
        return self.pipeline.pixels

    @contextlib.contextmanager
    def using(self, *, step_cache: Any = _KEEP, negative: dict | None = _KEEP, codecs: Codecs = _KEEP):
        """This sampler with another step cache, negative prompt (None: none) and / or codecs inside the block."""
        yield Sampler(self.model, self.dims, self.pipeline, self.device,
                      step_cache=self.step_cache if step_cache is _KEEP else step_cache,
                      negative=self.negative if negative is _KEEP else negative, weights=self._weights,
                      codecs=self.codecs if codecs is _KEEP else codecs)

    def weights(self, use_ema: bool = True) -> ContextManager[nn.Module]:
        """The model that samples, with the weights worth sampling inside the block."""
        return self._weights(use_ema) if self._weights is not None else contextlib.nullcontext(self.model)

    @torch.no_grad()
    def generate(self, condition, seeds: list[int], *, use_ema: bool = True, negative: dict | None = None,
                 shape: tuple[int, ...] | None = None, **overrides: Any) -> Tensor:
        """Samples ``(N, C, [T,] H, W)`` for ``condition`` -- labels ``(N,)``, or a dict of text tensors ``(N, ...)``
        -- sample i from noise seeded by seeds[i] (a ``ringdit.common.seeding.seed_of`` value); pixels come in [-1, 1].
        ``negative``: the negative prompt's conditioning for guidance (text models; default this sampler's, else the
        empty prompt's). ``shape``: the sample's ``([T,] H, W)`` in the data's units (latent cells, or pixels), any
        bucket the model takes; default the data's ``image_size`` (its most frequent bucket). ``overrides``: sampling
        settings of this call (``steps=``, ``cfg_scale=``, ...; None: the run's).

        Collective under sequence parallelism: every rank of the group must call it with the same arguments.
        """
        return self.generate_joint(condition, seeds, use_ema=use_ema, negative=negative, shape=shape,
                                   **overrides)[0]

    @torch.no_grad()
    def generate_joint(self, condition, seeds: list[int], *, use_ema: bool = True, negative: dict | None = None,
                       shape: tuple[int, ...] | None = None, **overrides: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """``generate``'s samples and those of the latents the model denoises beside them (``{}`` for none; LTX-2:
        ``{"audio": (N, 1, L, C_a * M)}`` on the audio VAE's normalised scale). Collective, as ``generate``."""
        with self.weights(use_ema) as model:
            return self.pipeline.generate_joint(model, condition, seeds, dims=self.dims, device=self.device,
                                                negative=self.negative if negative is None else negative,
                                                shape=shape, overrides=overrides, step_cache=self.step_cache)

    def encode(self, prompts: list[str], images: list | None = None) -> dict[str, Tensor]:
        """``prompts`` -> the model's text conditions ``(N, ...)``, encoded with the text encoder its data were, each
        with its reference picture in ``images`` where that encoder reads one (``Codecs.encode``)."""
        return self.codecs.encode(prompts, images)

    def to_pixels(self, samples: Tensor, group=None) -> np.ndarray | None:
        """Samples ``(N, C, [T,] H, W)`` (``generate``'s) -> uint8 ``(N, [T,] H, W, C)``: pixels as they are; latents
        back on the VAE's own scale (data.scale multiplied it in) and decoded one sample at a time. ``group``: a
        process group whose ranks all hold the same samples: each sample's VAE tiles are decoded over its ranks and
        the pixels come back on its rank 0 (None on the others)."""
        if self.pixels:
            return to_uint8(samples).numpy()
        return self.decode(samples.float().cpu() / self.pipeline.latent_scale, group)

    def sounds(self, joint: dict[str, Tensor]) -> list[tuple[np.ndarray, int]] | None:
        """Each sample's sound from ``generate_joint``'s joint latents (their ``audio``, as samples.npz holds it):
        (waveform float32 (channels, samples), sample rate) one a sample, decoded with this sampler's audio VAE and
        vocoder; None where the samples have no sound or there is no audio decoder (the video is written alone)."""
        if AUDIO_KEY not in joint or self.codecs.audio is None:
            return None
        return self.codecs.audio.decode(torch.as_tensor(joint[AUDIO_KEY]).float())

    def decode(self, latents: Tensor, group=None) -> np.ndarray | None:
        """Latents ``(N, C, [T,] H, W)`` on the VAE's own scale (as samples.npz holds them) -> uint8 ``(N, [T,] H, W,
        C)`` with this sampler's VAE, one sample at a time; ``group``: as ``to_pixels``'."""
        if self.codecs.vae is None:
            raise ValueError("this sampler samples latents and has no VAE to decode them with (Codecs.vae)")
        return decode_latents(latents, self.codecs.vae, self.codecs.normalised, group=group)

    def sample_requests(self, batch) -> dict[str, Tensor]:
        """One batch ``(indices, condition, seeds[, extra])`` of ``ringdit.sampling.SampleRequests``, sampled by
        ``sample_batch``, with its sample numbers (``index``) and, for a class-conditional model, its ``labels``."""
        indices, condition, seeds, *rest = batch
        described = {"index": indices} if isinstance(condition, dict) else {"index": indices, "labels": condition}
        return {**described, **self.sample_batch(condition, seeds.tolist(), rest[0] if rest else {})}

    def sample_batch(self, condition, seeds: list[int], extra: dict) -> dict[str, Tensor]:
        """One batch of ``ringdit.sampling.SampleRequests``: ``extra`` holds its sample ``shape`` (one per batch:
        ``ShapeBatches``) and, from a prompt file, each sample's ``negative`` prompt where ``negative_given``.
        Returns ``images`` (uint8) for pixels, else ``latents`` (float32) on the VAE's own scale; with the sound a
        joint model samples beside them, its ``audio`` latents (float32, the audio VAE's normalised scale)."""
        negative = self.negatives(extra["negative"], extra["negative_given"]) if "negative" in extra else None
        shape = tuple(int(s) for s in extra["shape"][0].tolist()) if "shape" in extra else None
        samples, joint = self.generate_joint(condition, seeds, negative=negative, shape=shape)
        sound = {AUDIO_KEY: joint[AUDIO_KEY].float()} if AUDIO_KEY in joint else {}
        if self.pixels:
            return {"images": to_uint8(samples), **sound}
        # back to the VAE's own scale (data.scale multiplied it in): ready to decode
        return {"latents": samples.float() / self.pipeline.latent_scale, **sound}

    def negatives(self, rows: dict[str, Tensor], given: Tensor) -> dict[str, Tensor]:
        """Each sample's negative prompt: its own where ``given``, else this sampler's (negative_prompt=), else the
        empty prompt's (the model's null condition, as trained)."""
        fallback = self.negative or self.model.null_condition(len(given))
        mixed = {}
        for key, value in rows.items():
            if key in fallback:
                where = given.view(-1, *[1] * (value.dim() - 1))
                value = torch.where(where, value, fallback[key].to(value).expand_as(value))
            mixed[key] = value
        return mixed
