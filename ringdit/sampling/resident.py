"""``ringdit.load``: a resident sampler for Python -- loaded once, called many times, in the caller's process.

    pipe = ringdit.load("outputs/train/runs/<run>/checkpoints/last.ckpt")
    images = pipe(labels=[3, 7], steps=50, cfg_scale=4.0, seed=0)               # a DiT: PIL images
    pipe = ringdit.load("/models/Wan2.1-T2V-1.3B-Diffusers")                      # a pipeline folder, an export
    videos = pipe(prompts=["a red fox running"], size=(480, 832), frames=81)     # videos: lists of PIL frames

The checkpoint is read as infer.py reads it (``ringdit.spec.InferSpec``: a training checkpoint, a .safetensors
export, a diffusers pipeline folder, or an adapter-only LoRA checkpoint on its base), its model built on one process
(``build_model``) with the text encoder and VAE its data record (``Codecs``), and kept. Each call samples with the
same ``Sampler.generate`` infer.py runs: sample i of ``seed`` starts from infer.py's noise for ``seed=`` and sample i,
so a call gives infer.py's samples for the same settings. A layout of several ranks (ring / Ulysses / FSDP) stays the
commands' job (``python infer.py``, ``python -m ringdit.serve``).
"""

from __future__ import annotations

from pathlib import Path

import hydra
import torch
from omegaconf import open_dict

from ringdit.checkpoints.weights import read_weights
from ringdit.commands.cli import command_config
from ringdit.common.errors import ConfigError, require_choice, require_count, require_number, require_seed
from ringdit.common.seeding import Stream, seed_of
from ringdit.diffusion.pipeline import SamplingPipeline
from ringdit.media.images import to_image
from ringdit.models.build import build_model
from ringdit.models.conditioning import text_conditioned
from ringdit.models.lora import adapter_state, load_adapter, load_null_condition
from ringdit.parallel import ParallelDims
from ringdit.sampling.decoding import spec_codecs
from ringdit.sampling.predict import checkpoint_weights
from ringdit.sampling.requests import resolve_labels
from ringdit.sampling.sampler import Codecs, Sampler
from ringdit.sampling.sizes import SampleSizes, patch_shape
from ringdit.spec import InferSpec
from ringdit.spec.control import control_family
from ringdit.spec.infer import image_kind

OUTPUTS = ("pil", "tensor", "latents")


def load(ckpt_path: str | Path, *, device: str | torch.device | None = None, weights: str = "ema",
         base: str | Path | None = None, vae: str | Path | None = None, text_encoder: str | Path | None = None,
         size: tuple[int, int] | None = None, frames: int | None = None) -> ResidentSampler:
    """The model of ``ckpt_path`` (a training checkpoint, a .safetensors export, a diffusers pipeline folder, or an
    adapter-only LoRA checkpoint), loaded once on ``device`` (default: the GPU where there is one) in this process,
    with its text encoder and VAE: call the result to sample (``ResidentSampler.__call__``). ``weights``: ``ema`` or
    ``model`` (a training checkpoint's); ``base``: a LoRA checkpoint's base model (default the one its run recorded);
    ``vae`` / ``text_encoder``: folders in place of those the data record; ``size`` ``(H, W)`` / ``frames``: the
    calls' default sample size, as infer.py's (None: the data's). One process: a layout of several ranks is the
    commands' job. A mistake raises ``ConfigError`` with one line naming the argument and the fix."""
    if not isinstance(ckpt_path, (str, Path)) or not str(ckpt_path):
        raise ConfigError(f"ckpt_path must be a checkpoint path (a str or a pathlib.Path), got {ckpt_path!r}; pass "
                          f"e.g. 'outputs/train/runs/<run>/checkpoints/last.ckpt'")
    for name, value in (("base", base), ("vae", vae), ("text_encoder", text_encoder)):
        if value is not None and not isinstance(value, (str, Path)):
            raise ConfigError(f"{name} must be a folder or file path (a str or a pathlib.Path) or None, got {value!r}")
    _check_size(size)
    device = _device(device)
    cfg = command_config("infer", [])
    with open_dict(cfg):  # set after composing: a path is taken as it is, with no override syntax to escape
        cfg.ckpt_path, cfg.weights, cfg.num_samples = str(ckpt_path), weights, 1
        cfg.size, cfg.frames = None if size is None else list(size), frames  # checked by the spec, as infer.py's
        for name, value in (("base", base), ("vae", vae), ("text_encoder", text_encoder)):
            if value is not None:
                cfg[name] = str(value)
    spec = InferSpec.from_config(cfg)
    family = control_family(spec.model.config)
    if family is not None or image_kind(spec.model.config) is not None:
        raise ConfigError(f"ckpt_path={ckpt_path} is {'a control-video' if family else 'an image-to-video'} model: "
                          f"ringdit.load samples from prompts or labels alone; sample it with infer.py "
                          f"{'control=<video file>' if family else 'image=<first frame>'}")
    model, _ = build_model(spec.model.config, dims=ParallelDims(), backend=spec.layout.attention_backend,
                           **checkpoint_weights(spec))
    if spec.lora is not None:  # an adapter-only checkpoint: its adapters (and empty prompt) onto the base, as infer.py
        state, _ = read_weights(spec.ckpt_path, prefer=spec.weights)
        load_adapter(model, adapter_state(state))
        load_null_condition(model, state)
    model = model.to(device).eval()
    codecs = spec_codecs(spec, device)  # the text encoder, the VAE (and an LTX-2's audio VAE + vocoder)
    return ResidentSampler(model, ParallelDims(), hydra.utils.instantiate(spec.objective), spec, device, codecs,
                           default_size=(size, frames))


class ResidentSampler(Sampler):
    """A ``Sampler`` of one process that takes prompts or labels and gives pictures (``ringdit.load`` makes it)."""

    def __init__(self, model, dims: ParallelDims, objective, spec: InferSpec, device, codecs: Codecs,
                 default_size: tuple = (None, None)):
        pipeline = SamplingPipeline.for_run(objective, spec.sampling, spec.data)
        super().__init__(model, dims, pipeline, device, codecs=codecs)
        self.data, self.pipeline_folder = spec.data, spec.pipeline
        self.sizes = SampleSizes.of(spec.data, patch_shape(model), model.max_grid)
        self.default_size = default_size  # load's size and frames (None: the data's)

    def __call__(self, prompts: list[str] | None = None, *, labels: list[int | str] | None = None,
                 negative_prompt: str | None = None, steps: int | None = None, cfg_scale: float | None = None,
                 size: tuple[int, int] | None = None, frames: int | None = None, seed: int = 0,
                 output: str = "pil"):
        """Samples for ``prompts`` (a text model) or ``labels`` (class ids or names: a class-conditional model), one
        each; sample i from infer.py's noise for ``seed`` and i. ``steps`` / ``cfg_scale``: this call's (None: the
        checkpoint's); ``size`` ``(H, W)`` and ``frames`` as infer.py's (pixels and video frames when the data record
        their VAE; None: ``ringdit.load``'s, else the data's); ``negative_prompt``: what guidance steers away from
        (None: the empty prompt). ``output``: ``pil`` (a list of PIL images; videos: a list of frame lists), ``tensor`` (uint8 (N, [T,] H, W,
        C)) or ``latents`` (a latent model's float32 (N, C, [T,] H, W), on the VAE's own scale)."""
        require_choice("output", output, OUTPUTS)
        count = self._count(prompts, labels)
        require_count("steps", steps, optional=True, hint="(the sampler's steps, e.g. steps=30; None: the "
                                                          "checkpoint's)")
        require_number("cfg_scale", cfg_scale, low=0, optional=True)
        require_seed("seed", seed)
        if negative_prompt is not None and (prompts is None or not isinstance(negative_prompt, str)):
            raise ConfigError(f"negative_prompt={negative_prompt!r}: give one string with prompts=, e.g. "
                              f"negative_prompt='blurry'")
        _check_size(size)
        size = self.default_size[0] if size is None else size
        frames = self.default_size[1] if frames is None else frames
        shape = self.sizes.shape(None if size is None else list(size), frames)
        self._check_output(output)
        seeds = [seed_of(Stream.INFERENCE, seed, i) for i in range(count)]
        condition, negative = self._conditions(prompts, labels, negative_prompt)
        samples = self.generate(condition, seeds, negative=negative, shape=shape, steps=steps, cfg_scale=cfg_scale)
        if output == "latents":
            return samples.float().cpu() / self.pipeline.latent_scale
        pixels = torch.from_numpy(self.to_pixels(samples))  # uint8 (N, [T,] H, W, C)
        if output == "tensor":
            return pixels
        return [to_image(sample.numpy()) if sample.ndim == 3 else [to_image(frame.numpy()) for frame in sample]
                for sample in pixels]

    def _count(self, prompts, labels) -> int:
        """The number of samples, after checking that the model's kind of conditioning was given."""
        text = text_conditioned(self.data)
        given, other = ("prompts", "labels") if text else ("labels", "prompts")
        if (prompts if not text else labels) is not None:
            kind = "a text-conditioned" if text else "a class-conditional"
            raise ConfigError(f"{other}= was given, but this is {kind} model: pass {given}=[...] instead, e.g. "
                              f"{given}={['a red fox running'] if text else [3, 7]}")
        values = prompts if text else labels
        if not isinstance(values, (list, tuple)) or not values or isinstance(values, str):
            example = "['a red fox running']" if text else "[3, 7]"
            raise ConfigError(f"{given} must be a non-empty list, got {values!r}; pass e.g. {given}={example}")
        if text and not all(isinstance(prompt, str) for prompt in values):
            raise ConfigError(f"prompts must be strings, got {values!r}; pass e.g. prompts=['a red fox running']")
        return len(values)

    def _check_output(self, output: str) -> None:
        if output == "latents" and self.pixels:
            raise ConfigError("output='latents': this model samples pixels (it was not trained on latents); pass "
                              "output='pil' or output='tensor'")
        if output != "latents" and not self.pixels and self.codecs.vae is None:
            raise ConfigError(f"output={output!r}: this model samples latents and no VAE is known to decode them; "
                              f"pass vae=<the VAE folder the data was prepared with> to ringdit.load, or "
                              f"output='latents'")

    def _conditions(self, prompts, labels, negative_prompt):
        """(the condition of each sample, the negative conditioning or None for the model's empty prompt)."""
        if prompts is None:
            try:
                return torch.tensor(resolve_labels(list(labels), len(labels), self.data)), None
            except ValueError as error:
                raise ConfigError(f"{error}; pass class ids 0..{self.data['num_classes'] - 1}") from None
        if self.codecs.text_encoder is None:
            raise ConfigError("prompts=: no text encoder is known to encode them; pass text_encoder=<the folder the "
                              "data was encoded with> to ringdit.load")
        condition = self.encode(list(prompts))
        # as infer.py and the server: a pipeline folder's unconditional half is the empty prompt it encodes
        if negative_prompt is None and not self.pipeline_folder:
            return condition, None
        return condition, self.encode([negative_prompt or ""] * len(prompts))


def _check_size(size) -> None:
    if size is not None and not (isinstance(size, (list, tuple)) and len(size) == 2):
        raise ConfigError(f"size={size!r} is not (H, W), two positive whole numbers; pass e.g. size=(480, 832)")


def _device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except (TypeError, RuntimeError):
        raise ConfigError(f"device={device!r} is not a torch device; pass device='cpu' or device='cuda'") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r}: no GPU is visible to this process; pass device='cpu'")
    return chosen
