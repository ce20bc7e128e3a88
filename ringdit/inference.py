"""Sample from a trained DiT, sequence-parallel over ring / Ulysses ranks and data-parallel over the rest.

    python infer.py                                  # the newest training run's last.ckpt (ckpt_path=last)
    python infer.py ckpt_path=outputs/train/runs/<run>/checkpoints/last.ckpt num_samples=100
    python infer.py ckpt_path=weights.safetensors labels=[3,3,7] diffusion.sampling.cfg_scale=2 diffusion.sampling.steps=100 ring_degree=2

    python infer.py ckpt_path=<wan run>/checkpoints/last.ckpt text_embeds=prompts.safetensors diffusion.sampling.cfg_scale=5
    python infer.py prompts='[a 3 moving left, a 7 moving up]'   # after train.py experiment=captioned_moving_digits
    python infer.py prompts='[a red fox running]' size=[480,832] frames=81    # at another size than the data's
    python infer.py prompt_file=prompts.jsonl num_samples=4   # {"prompt": "...", "size": [H, W], "frames": N} a line
    python infer.py prompts='[a 3 moving left]' image=first.png   # image-to-video: the first frame given

    python infer.py ckpt_path=/models/Wan2.1-T2V-1.3B-Diffusers prompts='[a red fox running]'   # as published
    python infer.py ckpt_path=<LoRA run>/checkpoints/last.ckpt                 # on the run's init_from / pretrained
    python infer.py ckpt_path=<LoRA run>/checkpoints/last.ckpt base=weights.safetensors   # or on another copy of it

A LoRA run's checkpoint holds only the adapters: the base model comes from ``base=`` (a ringdit .ckpt or .safetensors
export, or a diffusers folder) or else from what the run recorded (its ``init_from``, else its ``model.pretrained``);
it is checked against the adapter before anything starts, and the adapters (EMA or raw, ``weights=``) are loaded
onto it once it is built.

Sizes: ``size=[H, W]`` and ``frames=N`` (videos) sample at any shape the model patches, default the data's
image_size (its most frequent bucket). When the checkpoint's data records its VAE (data=text_latents from
``ringdit.prepare``) they are pixels and video frames, as diffusers pipelines' height / width / num_frames: the
latents are H / 8 x W / 8 for an 8x VAE, (frames - 1) / 4 + 1 latent frames for Wan's; otherwise (pixel-space DiT
data, data=latents, synthetic latents) they are the data's own cells. Each is checked before anything starts (a
whole number of the model's patches, frames 1 + k x the VAE's temporal factor). ``prompt_file=`` (a .jsonl of
``{"prompt": ..., "size": [H, W], "frames": N, "negative_prompt": ...}`` lines, all but prompt optional, or a .txt
of one prompt per line) gives each prompt its own size (default size / frames, else the data's); samples of one
shape are batched together, each keeps its number i and its seed.

Image-to-video models (Wan 2.2 TI2V, Wan 2.1 I2V): ``image=`` gives the first frame (a file, or a folder of them cycled
over the samples like the prompts), of the samples' aspect ratio; pixel-space models take it as their first frame,
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
seeded by (seed, i) (ringdit.seeding, stream INFERENCE), so the same seed gives the same sample i for any
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
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from ringdit.caching import StepCache
from ringdit.cli import hydra_main, register_resolvers, user_errors
from ringdit.data.text_latents import TextLatentsDataModule, read_prompts
from ringdit.errors import ConfigError
from ringdit.media.decode import decode_samples, latents_normalised
from ringdit.run_folder import claim_run_folder
from ringdit.sampling import SampleRequests, SampleWriter, write_pixels
from ringdit.spec import InferSpec
from ringdit.training import DiffusionModule
from ringdit.training.callbacks import LoadLoraAdapter
from ringdit.preemption import sigterm_stops_at_once, stop_on_sigterm

log = logging.getLogger("ringdit.infer")
register_resolvers()


def prepare(cfg: DictConfig):
    """Check every setting and the checkpoint (``InferSpec``), then build the trainer, module and sample requests
    from the spec; returns them and the spec."""
    spec = InferSpec.from_config(cfg)
    captions = negative = per_sample = None
    if spec.conditioning.labels is not None:
        conditions = list(spec.conditioning.labels)
    else:
        conditions, captions, negative, per_sample = text_conditions(spec)
        if spec.image is not None:  # image-to-video: the given first frames (else the held-out prompts' own)
            conditions = {**conditions, **image_conditions(spec, spec.num_samples)}
    module = DiffusionModule.for_sampling(spec)
    module.pipeline.negative = negative
    if spec.cache.enabled:  # cache=fbcache / teacache: wrapped around each batch's sampling (ringdit.caching)
        module.pipeline.step_cache = StepCache(spec.cache, spec.cache.coefficients)
    negatives, negative_given = per_sample or (None, None)
    requests = SampleRequests(conditions, spec.seed, shapes=spec.sample_shapes(), negatives=negatives,
                              negative_given=negative_given)
    shapes = requests.distinct_shapes()
    writer = SampleWriter(spec.output_dir, captions=captions, fps=spec.output.fps, shapes=shapes,
                          shape_names={shape: spec.sizes.name(shape) for shape in shapes})
    callbacks = [writer, *(hydra.utils.instantiate(c) for c in spec.trainer.callbacks)]
    if spec.lora is not None:
        callbacks.insert(0, LoadLoraAdapter(spec.ckpt_path, spec.weights))
    trainer: L.Trainer = hydra.utils.instantiate(spec.trainer.config, callbacks=callbacks, logger=False)
    if trainer.is_global_zero:
        log.info("sampling %d samples at %s", spec.num_samples, ", ".join(
            f"{spec.sizes.name(shape)} ({'x'.join(map(str, shape))} cells)" for shape in shapes))
    # batches of one shape each, at most batch_size (Lightning splits the requests over the data-parallel ranks)
    requests = DataLoader(requests, batch_sampler=requests.batches(spec.batch_size))
    claim_run_folder(spec.output_dir, "infer")  # last: every check has passed
    return trainer, module, requests, spec


def text_conditions(spec: InferSpec) -> tuple[dict, list[str], dict | None, tuple | None]:
    """A text model's (conditions cycled to num_samples, captions, negative (1, ...) or None for the empty prompt,
    per-sample negatives or None: (each sample's negative prompt (N, ...), whether it has its own (N,)), from a
    prompt file's negative_prompt keys)."""
    conditioning = spec.conditioning
    negative = per_sample = None
    conditions, captions = text_prompts(spec)
    if conditioning.prompts or conditioning.negative_prompt:
        conditions, captions, negative, per_sample = encoded_prompts(spec, conditions, captions)
    if conditioning.negative_text_embeds:
        negative_prompts, _ = read_prompts(conditioning.negative_text_embeds, "negative_text_embeds")
        negative = {key: value[:1] for key, value in negative_prompts.items()}  # the first row
        check_prompt_shape("negative_text_embeds", negative, spec.data)
    return conditions, captions, negative, per_sample


def image_conditions(spec: InferSpec, count: int) -> dict[str, torch.Tensor]:
    """``image=``'s first-frame conditioning of ``count`` samples (sample i: image i % len(files)), read upright as
    prepare reads frames (``ringdit.media.image_condition.first_frame_inputs``)."""
    from PIL import ImageOps

    from ringdit.media.frames import open_image
    from ringdit.media.image_condition import first_frame_inputs

    image = spec.image
    pictures = []
    for file in image.files:  # each was opened and its aspect ratio checked by the spec
        with open_image(file) as opened:  # upright as stored (a phone photo's EXIF rotation), as prepare reads it
            pictures.append(ImageOps.exif_transpose(opened).convert("RGB"))
    encoded = first_frame_inputs(pictures, size=image.size, frames=image.frames, latent=image.latent,
                                 vae=spec.output.vae, image_encoder=image.image_encoder,
                                 channels=spec.data["channels"], setting=f"image={image.files[0]}")
    picked = [i % len(pictures) for i in range(count)]
    return {key: value[picked] for key, value in encoded.items()}


def text_prompts(spec: InferSpec) -> tuple[dict, list[str]]:
    """``num_samples`` prompt embeddings (cycled): from ``text_embeds``, else the training data's held-out prompts."""
    conditioning, data_info = spec.conditioning, spec.data
    if conditioning.prompts:  # encoded in encoded_prompts
        return None, None
    if spec.pipeline:  # no held-out prompts; guidance's unconditional half is the empty prompt, encoded with them
        raise ConfigError(f"ckpt_path={spec.ckpt_path} is a diffusers pipeline folder: give the prompts to encode with "
                          f"its text encoder, prompts='[a red fox running]' (or prompt_file=)")
    if conditioning.text_embeds:
        prompts, captions = read_prompts(conditioning.text_embeds)
        count = next(iter(prompts.values())).shape[0]
        picked = [i % count for i in range(spec.num_samples)]
        prompts = {key: value[picked] for key, value in prompts.items()}
        captions = [captions[i] if captions else f"{conditioning.text_embeds}[{i}]" for i in picked]
    else:
        source = data_info["source"]
        try:
            data = TextLatentsDataModule(source["path"], val_fraction=source["val_fraction"], seed=source["seed"],
                                         check_values=False)  # only its held-out prompts are read (and checked)
        except ValueError as error:
            raise ConfigError(f"text_embeds is not set and the training data's held-out prompts cannot be read "
                              f"({error}); give prompt embeddings with text_embeds=<file>") from None
        prompts, captions = data.held_out(spec.num_samples)
    check_prompt_shape("text_embeds", prompts, data_info)
    return prompts, captions


def encoded_prompts(spec: InferSpec, conditions, captions):
    """``prompts`` (or a prompt file's) / ``negative_prompt`` encoded with the spec's text encoder (the data's unless
    ``text_encoder=``), in one pass with a prompt file's own negative prompts: (conditions cycled to num_samples,
    captions, negative (1, ...) or None for the empty prompt, per-sample negatives or None; see text_conditions)."""
    from ringdit.media.text import encode_prompts, encoder_settings

    conditioning, data_info = spec.conditioning, spec.data
    texts = list(conditioning.prompts)[:spec.num_samples] or [""]  # a prompt file's lines past num_samples: unused
    if len(conditioning.prompts) > spec.num_samples:
        log.info("sampling the first %d of the %d prompts (num_samples=%d; num_samples=%d samples them all)",
                 spec.num_samples, len(conditioning.prompts), spec.num_samples, len(conditioning.prompts))
    negatives = conditioning.negative_prompts[:len(texts)]
    own = [text for text in dict.fromkeys(negatives) if text]  # a prompt file's, each once
    encoded, negative = encode_prompts(texts + own, conditioning.negative_prompt, conditioning.text_encoder,
                                       conditioning.tokenizer, text_len=data_info["text_len"],
                                       text_dim=data_info["text_dim"],
                                       device="cuda" if torch.cuda.is_available() else "cpu",
                                       # as the data were prepared: Flux's CLIP pooled encoder, the masking, a template,
                                       # HunyuanVideo 1.5's glyph encoder
                                       **encoder_settings(data_info.get("text_encoder") or {}))
    check_prompt_shape("prompts", encoded, data_info)  # the glyph text too: its encoder's folder may have changed
    picked = [i % len(texts) for i in range(spec.num_samples)]
    if conditioning.prompts:
        conditions, captions = {key: value[:len(texts)][picked] for key, value in encoded.items()}, \
            [texts[i] for i in picked]
    per_sample = None
    if own:  # row len(texts) + k: the k-th distinct negative; a prompt without one takes row 0 (not read)
        rows = [len(texts) + own.index(negatives[i]) if negatives[i] else 0 for i in picked]
        per_sample = ({key: value[rows] for key, value in encoded.items()},
                      torch.tensor([bool(negatives[i]) for i in picked]))
    # a pipeline folder's unconditional half is the empty prompt it encodes (encode_prompts' negative then)
    return conditions, captions, negative if conditioning.negative_prompt or spec.pipeline else None, per_sample


def check_prompt_shape(setting: str, prompts: dict, data_info: dict) -> None:
    expected = (data_info["text_len"], data_info["text_dim"])
    if tuple(prompts["text"].shape[1:]) != expected:
        raise ConfigError(f"{setting}: the prompt embeddings are {tuple(prompts['text'].shape[1:])} (L, D) but the "
                          f"model was trained on {expected}; encode them with the same text encoder and length")
    glyph = (data_info.get("glyph_len"), data_info.get("glyph_dim"))  # HunyuanVideo 1.5's glyph text, if trained on
    given = tuple(prompts["glyph_text"].shape[1:]) if "glyph_text" in prompts else None
    if glyph[0] and given != glyph:  # without it, quoted text would be read as none
        raise ConfigError(f"{setting}: the model was trained with glyph text {glyph} (G, D: the ByT5 states of the "
                          f"prompts' quoted text) but the prompt embeddings have {given or 'none'}; encode them as "
                          f"the data were (prepare's glyph_encoder), or pass prompts=")


def sample(cfg: DictConfig) -> Path:
    """Sample as ``python infer.py`` does, with ``cfg`` (``ringdit.config("infer", [...])``), in this process;
    returns the run folder (samples.npz, the pictures and videos). A mistake in the settings raises
    ``ringdit.errors.ConfigError`` before anything is built."""
    return run(*prepare(cfg))


@hydra_main("infer")
def main(cfg: DictConfig) -> None:
    with user_errors():  # a mistake in the settings: one line, exit code 2
        prepared = prepare(cfg)
    run(*prepared)


def run(trainer, module, requests, spec: InferSpec) -> Path:
    """Sample the prepared run's requests, decode them (latent models) and log them (logger=wandb)."""
    output = spec.output
    # SIGTERM: every rank stops at the next sampler step, the finished batches are written, exit code 143
    with stop_on_sigterm(trainer, logger=log):
        trainer.predict(module, dataloaders=requests, return_predictions=False)
        if module.pipeline.step_cache is not None and trainer.is_global_zero:
            counts = module.pipeline.step_cache.counts
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
                written = decode(files, spec, device=str(trainer.strategy.root_device), group=group)
            if trainer.is_global_zero:
                log.info("decoded with vae=%s: %s", output.vae, ", ".join(p.name for p in written))
        if trainer.is_global_zero and spec.loggers:
            log_written_samples(spec)
    return Path(spec.output_dir)


def log_written_samples(spec: InferSpec) -> None:
    """``logger=wandb``: the samples this run wrote -- samples.npz's pictures, or a latent model's decoded files --
    logged to a new wandb run (offline when there is no API key or network), each captioned with its prompt or
    class; videos as MP4 files (written here for pixel-space videos, which infer.py otherwise keeps as a GIF grid)."""
    import numpy as np
    from PIL import Image

    from ringdit.media.writing import write_mp4
    from ringdit.training.callbacks import log_samples

    out = Path(spec.output_dir)
    npz = np.load(out / "samples.npz", allow_pickle=False) if (out / "samples.npz").is_file() else {}
    if "images" in npz:  # uint8 (N, [T,] H, W, C)
        images = npz["images"]
    else:  # a latent model: what the decode wrote (sample-000.png ... / sample-000.mp4 ...)
        pictures = sorted(out.glob("sample-*.png"))
        images = np.stack([np.asarray(Image.open(p).convert("RGB")) for p in pictures]) if pictures else None
    videos = sorted(out.glob("sample-*.mp4"))
    if images is not None and images.ndim == 5 and len(videos) != len(images):
        videos = [write_mp4(video, out / f"sample-{i:03d}.mp4", spec.output.fps) for i, video in enumerate(images)]
    if images is None and not videos:
        log.warning("logger: nothing to log in %s: latent samples need vae= to become pictures", out)
        return
    count = len(videos) or len(images)
    captions = [str(c) for c in npz["captions"]] if "captions" in npz else \
        [str(label) for label in npz["labels"]] if "labels" in npz else [f"sample {i}" for i in range(count)]
    loggers = [hydra.utils.instantiate(config) for config in spec.loggers]
    for logger in loggers:
        logger.log_hyperparams({"ckpt_path": spec.ckpt_path, "num_samples": spec.num_samples, **spec.sampling})
    log_samples(loggers, images, captions[:count], step=0, videos=videos)
    for logger in loggers:
        logger.finalize("success")
        logger.experiment.finish()  # the run's files complete on disk (offline: ready for wandb sync)


def decode_group():
    """The sampling run's ranks, still joined after ``trainer.predict`` (Lightning's ranks run this script to its
    end; the process group is destroyed at exit): every rank decodes its share of each sample's VAE tiles
    (``ringdit.media.parallel_vae``) and rank 0 writes the files. None for a single process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def shared_files(files: list[Path], group) -> list[Path]:
    """Rank 0's written samples*.npz (the SampleWriter writes on rank 0 alone), on every rank of ``group``."""
    if group is None:
        return files
    import torch.distributed as dist

    message = [[str(file) for file in files]]
    dist.broadcast_object_list(message, src=0, group=group)
    return [Path(file) for file in message[0]]


def decode(files: list[Path], spec: InferSpec, device: str, group=None) -> list[Path]:
    """Decode the written samples with ``spec.output.vae``: samples.npz as ``ringdit.media.decode`` does (samples.png
    / .gif, sample-000.png / .mp4 ...), or each shape's samples-<name>.npz into its grid samples-<name>.png / .gif
    and its samples' files, named by their numbers (the npz's ``index``). ``group`` (``decode_group``): every rank
    calls this and decodes its share of the tiles; rank 0 reads the files and writes the pictures (the others
    return [])."""
    output, normalised = spec.output, latents_normalised(spec.data)
    if len(files) == 1 and files[0].name == "samples.npz":
        return decode_samples(files[0], output.vae, vae_subfolder=output.vae_subfolder, fps=output.fps,
                              tile=output.vae_tile, device=device, normalised=normalised, group=group,
                              tile_setting="vae_tile")
    from ringdit.media.decode import decode_latents, shared_latents
    from ringdit.media.vae import VAE

    codec = VAE(output.vae, output.vae_subfolder, device=device, tile=output.vae_tile, tile_setting="vae_tile")
    written = []
    for file in files:
        latents, indices = shared_latents(file, group, index=True)
        try:
            pixels = decode_latents(latents, codec, normalised, group=group)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if pixels is not None:  # rank 0 (or a single process)
            written += write_pixels(pixels, file.parent, stem=file.stem, indices=indices, fps=output.fps)
    return written
