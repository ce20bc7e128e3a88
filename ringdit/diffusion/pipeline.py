"""``SamplingPipeline``: how a model samples, apart from how it trains -- the sampler and its settings, guidance (a scale
per expert, CFG parallel, the negative prompt, a guidance-distilled model's embedding), the step cache, the shift for
the sample's size, a diffusers scheduler's set-up, and image-to-video's given frames.

A ``ringdit.sampling.Sampler`` holds one with the model, the ranks' ``ParallelDims``, the device, its step cache and
its negative prompt, and calls it with the weights worth sampling (infer.py, the preview grids, the server,
TeaCache's calibration, distillation's teacher). It holds no model and no process state: every call gets them.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from ringdit.diffusion.experts import expert_guidance
from ringdit.diffusion.joint import JointLatents
from ringdit.diffusion.objectives import resolution_shift
from ringdit.diffusion.samplers import draw_noise, is_guided, noise_generators, sample
from ringdit.diffusion.schedulers import is_scheduler_sampler, scheduler_config
from ringdit.parallel import ParallelDims, exchange_guidance_halves

Tensor = torch.Tensor

# what a run samples with where its settings say nothing (the objective's default sampler: sampler=None)
DEFAULT_SETTINGS = {"steps": 50, "cfg_scale": 1.0, "sampler": None, "shift": 1.0, "guidance_channels": None}


@dataclass
class SamplingPipeline:
    objective: Any                   # ringdit.diffusion's FlowMatching or DDPM: what the model predicts
    settings: dict                   # the run's sampling settings (DEFAULT_SETTINGS' keys, cfg_scale_2, times, ...)
    image_size: tuple[int, ...] | None  # the data's sample shape ([T,] H, W): every call's default (None: none)
    pixels: bool                     # samples are pixels in [-1, 1] (clamped), else latents kept as numbers
    latent_scale: float | None = None  # the data's latent_scale (latents): samples / it are on the VAE's own scale

    @classmethod
    def for_run(cls, objective, sampling: dict | None, data: dict) -> SamplingPipeline:
        """The pipeline of a run's objective, ``diffusion.sampling`` settings and data description."""
        size = data.get("image_size")
        return cls(objective, {**DEFAULT_SETTINGS, **(sampling or {})}, None if size is None else tuple(size),
                   pixels="latent_scale" not in data, latent_scale=data.get("latent_scale"))

    def tokens(self, model: nn.Module, shape: tuple[int, ...] | None = None) -> int:
        """Model tokens of one sample of ``shape`` (default the data's)."""
        shape = self.image_size if shape is None else tuple(shape)
        return math.prod(s // p for s, p in zip(shape, model.patch_shape))

    def generate(self, model: nn.Module, condition, seeds: list[int], **keywords) -> Tensor:
        """Samples ``(N, C, [T,] H, W)`` of ``model`` (``generate_joint``'s, without the latents a joint model denoises
        beside them)."""
        return self.generate_joint(model, condition, seeds, **keywords)[0]

    @torch.no_grad()
    def generate_joint(self, model: nn.Module, condition, seeds: list[int], *, dims: ParallelDims, device,
                       negative: dict | None = None, shape: tuple[int, ...] | None = None,
                       overrides: dict | None = None, step_cache: Any = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Samples ``(N, C, [T,] H, W)`` of ``model`` for ``condition`` (labels ``(N,)`` or a dict of text tensors),
        and those of the latents it denoises beside them (``model.joint_latents``: LTX-2's ``audio``; {} for none),
        sample i from noise seeded by seeds[i]; ``negative``: the negative prompt's conditioning for guidance (None:
        the model's null condition, the empty prompt); ``overrides``: sampling settings of this call (None: the run's);
        ``step_cache``: a ``ringdit.caching.StepCache`` wrapped around this call (None: every block runs).

        Collective under sequence parallelism: every rank of the group must call it with the same arguments."""
        settings = {**self.settings, **{k: v for k, v in (overrides or {}).items() if v is not None}}
        generators = noise_generators(seeds)  # sample i's noise: its initial noise, then the ddpm sampler's
        shape = tuple(shape) if shape is not None else self.image_size
        noise = draw_noise((model.in_channels, *shape), generators, device=device)
        joint = JointLatents(noise.shape[1:], model.joint_shapes(shape)) if model.joint_latents else None
        if joint is not None:  # LTX-2's audio: its noise drawn after the video's, stepped with it as one state
            noise = joint.pack(noise, {key: draw_noise(size, generators, device=device)
                                       for key, size in joint.shapes.items() if key is not None})
        cfg_scale = expert_guidance(model, settings["cfg_scale"], settings.get("cfg_scale_2"))  # one per expert
        guided = is_guided(settings)
        condition = condition_to(model.model_condition(condition), device)
        if joint is not None and isinstance(condition, dict):  # the data's clean joint latents are not sampled from
            condition = {key: value for key, value in condition.items() if key not in joint.shapes}
        null = condition_to(model.model_condition(negative if negative is not None else model.null_condition(len(seeds))),
                          device) if guided else None
        if settings.get("guidance") is not None and isinstance(condition, dict):  # a guidance-distilled model's
            condition["guidance"] = torch.full((len(seeds),), float(settings["guidance"]), device=device)
        split = guided and dims.cfg_group is not None  # CFG parallel: the halves on two data-parallel replicas
        # a step cache lives for this one call (this batch); its decisions are per sample, both halves together
        cache = step_cache.attached(model, dims, pairs=guided and not split) if step_cache is not None \
            else contextlib.nullcontext()
        with cache:
            samples = sample(  # with a learned variance (B, 2C, ...): the samplers take the channels they use
                model if joint is None else joint.model(model), self.objective, noise, condition, steps=settings["steps"], cfg_scale=cfg_scale,
                null=null, sampler=settings["sampler"], clip_denoised=self.pixels,
                shift=resolution_shift(self.tokens(model, shape), steps=settings["steps"],
                                       **getattr(self.objective, "resolution", {}))
                if settings["shift"] == "resolution" else settings["shift"],
                shift_terminal=settings.get("shift_terminal") or None,  # false: no stretch
                exchange=partial(exchange_guidance_halves, dims=dims) if split else None, half=dims.cfg_rank,
                guidance_channels=settings.get("guidance_channels"), generators=generators,
                times=settings.get("times"),  # a distilled student's recorded grid (sampler=fewstep)
                scheduler=self.scheduler_settings(model, settings, shape)
                if is_scheduler_sampler(settings["sampler"]) else None,
            )
        samples, joint_samples = (samples, {}) if joint is None else joint.unpack(samples)
        # image-to-video: the given first frame in place, as the pipeline ends (a model without one: unchanged)
        samples = model.with_condition_frames(samples, condition)
        return (samples.clamp(-1, 1) if self.pixels else samples), joint_samples

    def scheduler_settings(self, model: nn.Module, settings: dict, shape: tuple[int, ...]) -> dict:
        """``sample_with_scheduler``'s keywords for a diffusers scheduler (``sampler=flow_euler / unipc / dpmpp``):
        its config -- the pipeline folder's (``scheduler_config``, recorded by the spec) with the run's shift and
        terminal stretch laid over it, else the run's shift --, how
        the model family's pipeline steps it, the sample's token count (a dynamic shift's mu) and the dtype the model
        computes in (the pipelines feed it ``latents.to(transformer.dtype)``); a joint model's streams, each on a
        scheduler of its own."""
        resolution = getattr(self.objective, "resolution", None) or None
        config = scheduler_config(settings["sampler"], settings.get("scheduler_config"), shift=settings["shift"],
                                  shift_terminal=settings.get("shift_terminal"), resolution=resolution)
        # a joint model's latents (LTX-2's, MiniMax-H3's audio) on schedulers of their own, each at its shift
        # (joint_shift: {key: shift}; MiniMax-H3's pipeline shifts its audio by 3), else the video's
        joint_shift = settings.get("joint_shift") or {}
        streams = [(math.prod(size), scheduler_config(settings["sampler"], settings.get("scheduler_config"),
                                                      shift=joint_shift.get(key, settings["shift"]),
                                                      shift_terminal=settings.get("shift_terminal"),
                                                      resolution=resolution))
                   for key, size in (model.joint_shapes(shape).items() if model.joint_latents else ())]
        return {"config": config, "pipeline": model.pipeline_timesteps, "streams": streams,
                "tokens": self.tokens(model, shape), "resolution": resolution, "model_dtype": _compute_dtype(model)}


def _compute_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype the model computes in: its first floating-point parameter's (an fp8 frozen base computes in its
    adapters' / norms' dtype, so 1-byte floats are skipped); None for a model without parameters."""
    for parameter in model.parameters():
        if parameter.is_floating_point() and parameter.element_size() > 1:
            return parameter.dtype
    return None


def condition_to(condition, device):
    """Labels (B,), or a dict of conditioning tensors, on ``device``."""
    if isinstance(condition, dict):
        return {key: value.to(device) for key, value in condition.items()}
    return condition.to(device)


def in_micro_batches(generate, condition, seeds: list[int], batch_size: int | None, *,
                     negative: dict | None = None, **keywords) -> Tensor:
    """``generate(condition, seeds, negative=..., **keywords)`` (a ``SamplingPipeline.generate`` or
    ``Sampler.generate``) over at most ``batch_size`` samples per call (None: all in one), concatenated: the
    same samples, as each one's noise comes from its own seed, with the memory of one micro-batch (a preview of 80
    video samples would otherwise be one forward of 80, twice that with guidance). ``condition``: labels ``(N,)`` or
    a dict of ``(N, ...)`` tensors; ``negative``: a ``(1, ...)`` prompt for all, or ``(N, ...)`` one per sample.

    Collective under sequence parallelism, as ``generate`` is: every rank makes the same calls."""
    count = len(seeds)
    size = count if batch_size is None else batch_size

    def rows(value, start: int, stop: int):
        if isinstance(value, dict):
            return {key: rows(tensor, start, stop) for key, tensor in value.items()}
        return value[start:stop] if torch.is_tensor(value) and value.ndim and len(value) == count else value

    return torch.cat([generate(rows(condition, start, start + size), seeds[start:start + size],
                               negative=rows(negative, start, start + size), **keywords)
                      for start in range(0, count, size)])
