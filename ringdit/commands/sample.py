"""Sample from a trained DiT, sequence-parallel over ring / Ulysses ranks and data-parallel over the rest.

    python infer.py                                  # the newest training run's last.ckpt (ckpt_path=last)
    python infer.py ckpt_path=outputs/train/runs/<run>/checkpoints/last.ckpt num_samples=100
    python infer.py ckpt_path=weights.safetensors labels=[3,3,7] diffusion.sampling.cfg_scale=2 diffusion.sampling.steps=100 ring_degree=2

    python infer.py ckpt_path=<wan run>/checkpoints/last.ckpt text_embeds=prompts.safetensors diffusion.sampling.cfg_scale=5
    python infer.py 'prompts=["a 3 moving left", "a 7 moving up"]'   # after train.py experiment=captioned_moving_digits
    python infer.py prompts='[a red fox running]' size=[480,832] frames=81    # at another size than the data's
    python infer.py prompt_file=prompts.jsonl num_samples=4   # {"prompt": "...", "size": [H, W], "frames": N} a line
    python infer.py prompts='[a 3 moving left]' image=first.png   # image-to-video: the first frame given

    python infer.py ckpt_path=/models/Wan2.1-T2V-1.3B-Diffusers prompts='[a red fox running]'   # as published
    python infer.py ckpt_path=<LoRA run>/checkpoints/last.ckpt                 # on the run's init_from / pretrained
    python infer.py ckpt_path=<LoRA run>/checkpoints/last.ckpt base=weights.safetensors   # or on another copy of it
    python infer.py ckpt_path=weights.safetensors 'lora=[{path: style.safetensors, strength: 0.8}]'   # LoRA files

A LoRA run's checkpoint holds only the adapters: the base model comes from ``base=`` (a ringdit .ckpt or .safetensors
export, or a diffusers folder) or else from what the run recorded (its ``init_from``, else its ``model.pretrained``);
it is checked against the adapter before anything starts, and the adapters (EMA or raw, ``weights=``) are loaded
onto it once it is built.

LoRA files from elsewhere: ``lora=[{path: style.safetensors, strength: 0.8}, {path: other/, strength: 0.5}]`` stacks
adapter files on whatever model is sampled (a checkpoint, an export, a pipeline folder, a LoRA checkpoint on its
base): diffusers' and peft's files, ComfyUI's (the model's original layer names; a fused original layer is split into
its parts) and ``python -m ringdit.export lora=true`` folders (a two-expert model's ``transformer_2/`` too, or
``path_2=``). Each adapted layer computes as its base plus the sum of ``strength x alpha / r x B A`` over the files,
added to its output (``ringdit.models.lora.stack_adapters``: the base weights are left as they are, in any dtype or
sharding). Every file is read and checked against the model before anything starts.

Sizes: ``size=[H, W]`` and ``frames=N`` (videos) sample at any shape the model patches, default the data's
image_size (its most frequent bucket). When the checkpoint's data records its VAE (data=text_latents from
``ringdit.prepare``) they are pixels and video frames, as diffusers pipelines' height / width / num_frames: the
latents are H / 8 x W / 8 for an 8x VAE, (frames - 1) / 4 + 1 latent frames for Wan's; otherwise (pixel-space DiT
data, data=latents, synthetic latents) they are the data's own cells. Each is checked before anything starts (a
whole number of the model's patches, frames 1 + k x the VAE's temporal factor). ``prompt_file=`` (a .jsonl of
``{"prompt": ..., "size": [H, W], "frames": N, "negative_prompt": ...}`` lines, all but prompt optional, or a .txt
of one prompt per line) gives each prompt its own size (default size / frames, else the data's); samples of one
shape are batched together, each keeps its number i and its seed.

Image-to-video models (those whose kind has an ``image_condition``: Wan 2.1 I2V, Wan 2.2 TI2V-5B and I2V-A14B,
HunyuanVideo 1.5 I2V): ``image=`` gives the first frame (a file, or a folder of them cycled over the samples like the
prompts), of the samples' aspect ratio; pixel-space models take it as their first frame,
latent ones encode it with the data's VAE (``ringdit.media.image_condition``). Without ``image=`` and prompts, the
training data's held-out prompts come with their own first frames.

Step caching: ``cache=fbcache cache.threshold=0.1`` (First-Block Cache) or ``cache=teacache`` skips the model's
blocks on steps whose first block (or its modulated input) changed little, reusing their cached residual; the
decision is the same on every rank (ringdit.caching). ``cache=none`` (the default) samples exactly as without it.

Writes samples.png (videos: samples.gif, plus sample-000.mp4 / .gif ... each) and samples.npz (images uint8
(N, [T,] H, W, C), labels int64 (N,)) into the run's output directory; latent models write latents float32
(N, C, [T,] H, W) instead of images, and
text-conditioned models the prompts' captions instead of labels. With vae=FOLDER (default: the VAE the data was
prepared with, when that folder exists) latents are also decoded beside samples.npz: samples.png + sample-000.png
... for images, samples.gif + sample-000.mp4 / .gif ... for videos (ringdit.media). Sample i starts from noise
seeded by (seed, i) (ringdit.common.seeding, stream INFERENCE), so the same seed gives the same sample i for any
num_samples, batch size and ring / Ulysses / data-parallel layout: exactly up to fp64 rounding; in fp32 up to the
rounding of the GEMM kernels the batch size, layout and CPU pick (~2e-7 of the largest value after 10 DDPM steps).
Samples of several shapes (a prompt file with sizes) are written per shape: samples-<HxW[xF]>.npz (the same keys plus
``index``, the sample numbers it holds) and its grid samples-<HxW[xF]>.png / .gif; files of one sample keep their
number (sample-007.mp4), whatever their shape.

From Python: ``ringdit.sample(ringdit.config("infer", ["ckpt_path=...", "prompts=[a red fox]"]))`` runs the same code
in the caller's process.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
import lightning as L
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from ringdit.caching import StepCache
from ringdit.checkpoints.lora_formats import read_lora_stack
from ringdit.commands.cli import register_resolvers, user_errors
from ringdit.models.lora import adapted_modules, stack_adapters
from ringdit.sampling.conditions import sample_conditions
from ringdit.sampling.decoding import decode_group, decode_written, output_codecs, shared_files
from ringdit.commands.sigterm import sigterm_stops_at_once
from ringdit.commands.task import Task, command
from ringdit.sampling import SampleRequests, SampleWriter
from ringdit.sampling.predict import SamplingModule
from ringdit.sampling.writer import write_sample
from ringdit.spec import InferSpec
from ringdit.training.callbacks import LoadLoraAdapter, log_samples
from ringdit.training.parallel_strategy import build_strategy

log = logging.getLogger("ringdit.infer")
register_resolvers()


def prepare(cfg: DictConfig):
    """Check every setting and the checkpoint (``InferSpec``), then build the trainer, module and sample requests
    from the spec; returns them and the spec."""
    spec = InferSpec.from_config(cfg)
    conditions, captions, negative, per_sample = sample_conditions(spec)
    # cache=fbcache / teacache: wrapped around each batch's sampling (ringdit.caching)
    cache = StepCache(spec.cache, spec.cache.coefficients) if spec.cache.enabled else None
    module = SamplingModule(spec, step_cache=cache, negative=negative)
    negatives, negative_given = per_sample or (None, None)
    requests = SampleRequests(conditions, spec.seed, shapes=spec.sample_shapes(), negatives=negatives,
                              negative_given=negative_given)
    shapes = requests.distinct_shapes()
    writer = SampleWriter(spec.output_dir, captions=captions, fps=spec.output.fps, shapes=shapes,
                          shape_names={shape: spec.sizes.name(shape) for shape in shapes})
    callbacks = [writer, *(hydra.utils.instantiate(c) for c in spec.trainer.callbacks)]
    if spec.lora_files:  # after the checkpoint's own adapters are loaded: these go on top
        callbacks.insert(0, StackLoraFiles(spec.lora_files))
    if spec.lora is not None:
        callbacks.insert(0, LoadLoraAdapter(spec.ckpt_path, spec.weights))
    strategy = build_strategy(spec.trainer.config["strategy"], spec.layout)  # the layout checked once builds the mesh
    trainer: L.Trainer = hydra.utils.instantiate(spec.trainer.config, strategy=strategy, callbacks=callbacks,
                                                 logger=False)
    if trainer.is_global_zero:
        log.info("sampling %d samples at %s", spec.num_samples, ", ".join(
            f"{spec.sizes.name(shape)} ({'x'.join(map(str, shape))} cells)" for shape in shapes))
    # batches of one shape each, at most batch_size (Lightning splits the requests over the data-parallel ranks)
    requests = DataLoader(requests, batch_sampler=requests.batches(spec.batch_size))
    return trainer, module, requests, spec


class StackLoraFiles(L.Callback):
    """``lora=[{path, strength}, ...]``: the adapter files stacked on the model when prediction starts (the model is
    built, loaded and sharded by then): each adapted layer computes as the base merged with every file's update at
    its strength (``ringdit.models.lora.stack_adapters``); every rank reads the same files onto its device."""

    def __init__(self, files):
        self.files = files

    def on_predict_start(self, trainer: L.Trainer, pl_module) -> None:
        model = pl_module.model
        stack_adapters(adapted_modules(model), read_lora_stack(self.files, model), device=trainer.strategy.root_device)
        if trainer.is_global_zero:
            log.info("stacked %s", ", ".join(f"{file.paths[0]} at strength {file.strength:g}" for file in self.files))


@command("infer", doing="sampling")
def main(cfg: DictConfig, task: Task) -> Path:
    trainer, module, requests, spec = prepare(cfg)
    task.claim(spec.output_dir)  # last: every check has passed
    # SIGTERM: every rank stops at the next sampler step, the finished batches are written, exit code 143
    task.start(trainer=trainer)
    return run(trainer, module, requests, spec, task.loggers)


def sample(cfg: DictConfig) -> Path:
    """Sample as ``python infer.py`` does, with ``cfg`` (``ringdit.config("infer", [...])``), in this process;
    returns the run folder (samples.npz, the pictures and videos). A mistake in the settings raises
    ``ringdit.common.errors.ConfigError`` before anything is built."""
    return main.run(cfg)


def run(trainer, module, requests, spec: InferSpec, loggers: list) -> Path:
    """Sample the prepared run's requests, decode them (latent models) and log them (logger=wandb: the loggers made
    are added to ``loggers``, the task's, whose wandb runs the wrapper finishes)."""
    output = spec.output
    trainer.predict(module, dataloaders=requests, return_predictions=False)
    cache = module.sampler.step_cache
    if cache is not None and trainer.is_global_zero:
        counts = cache.counts
        log.info("cache=%s threshold=%g: %d of %d model evaluations ran every block (%d reused the cache)",
                 spec.cache.kind, spec.cache.threshold, counts.full, counts.evaluations, counts.reused)
    writer = next(c for c in trainer.callbacks if isinstance(c, SampleWriter))
    group = decode_group() if output.vae else None
    files = shared_files(writer.npz_files, group)
    if output.vae and files and (group is not None or trainer.is_global_zero):
        samples = files[0] if len(files) == 1 else f"{Path(spec.output_dir)}/samples-*.npz"
        kept = f"every sample is in {samples} (decoded files may be incomplete); decode them with python -m " \
               f"ringdit.media.decode {samples} vae={output.vae}"
        if group is not None and trainer.is_global_zero:
            log.info("decoding each sample's VAE tiles over the %d ranks", trainer.world_size)
        with user_errors(), sigterm_stops_at_once("the VAE decode", kept):  # nothing else would be lost
            codecs = output_codecs(spec.data, output, str(trainer.strategy.root_device))  # the VAE, the sound's
            with module.sampler.using(codecs=codecs) as decoding:
                written = decode_written(files, decoding, output, group=group)
        if trainer.is_global_zero:
            log.info("decoded with vae=%s: %s", output.vae, ", ".join(p.name for p in written))
    if trainer.is_global_zero and spec.loggers:
        log_written_samples(spec, loggers)
    return Path(spec.output_dir)


def log_written_samples(spec: InferSpec, loggers: list) -> None:
    """``logger=wandb``: the samples this run wrote -- samples.npz's pictures, or a latent model's decoded files --
    logged to a new wandb run (offline when there is no API key or network), each captioned with its prompt or
    class; videos as MP4 files (written here for pixel-space videos, which infer.py otherwise keeps as a GIF grid)."""
    import numpy as np
    from PIL import Image

    out = Path(spec.output_dir)
    npz = np.load(out / "samples.npz", allow_pickle=False) if (out / "samples.npz").is_file() else {}
    if "images" in npz:  # uint8 (N, [T,] H, W, C)
        images = npz["images"]
    else:  # a latent model: what the decode wrote (sample-000.png ... / sample-000.mp4 ...)
        pictures = sorted(out.glob("sample-*.png"))
        images = np.stack([np.asarray(Image.open(p).convert("RGB")) for p in pictures]) if pictures else None
    videos = sorted(out.glob("sample-*.mp4"))
    if images is not None and images.ndim == 5 and len(videos) != len(images):
        videos = [write_sample(video, out / f"sample-{i:03d}.mp4", spec.output.fps) for i, video in enumerate(images)]
    if images is None and not videos:
        log.warning("logger: nothing to log in %s: latent samples need vae= to become pictures", out)
        return
    count = len(videos) or len(images)
    captions = [str(c) for c in npz["captions"]] if "captions" in npz else \
        [str(label) for label in npz["labels"]] if "labels" in npz else [f"sample {i}" for i in range(count)]
    made = [hydra.utils.instantiate(config) for config in spec.loggers]
    loggers.extend(made)  # their runs' files complete on disk whatever happens (offline: ready for wandb sync)
    for logger in made:
        logger.log_hyperparams({"ckpt_path": spec.ckpt_path, "num_samples": spec.num_samples, **spec.sampling})
    log_samples(made, images, captions[:count], step=0, videos=videos)
    for logger in made:
        logger.finalize("success")
