"""Sample from a trained DiT, sequence-parallel over ring / Ulysses ranks and data-parallel over the rest.

    python infer.py                                  # the newest training run's last.ckpt (ckpt_path=last)
    python infer.py ckpt_path=outputs/train/runs/<run>/checkpoints/last.ckpt num_samples=100
    python infer.py ckpt_path=weights.safetensors labels=[3,3,7] cfg_scale=2 steps=100 ring_degree=2

    python infer.py ckpt_path=<wan run>/checkpoints/last.ckpt text_embeds=prompts.safetensors cfg_scale=5
    python infer.py prompts='[a 3 moving left, a 7 moving up]'   # after train.py experiment=captioned_moving_digits

Writes samples.png (videos: samples.gif, plus sample-000.mp4 / .gif ... each) and samples.npz (images uint8
(N, [T,] H, W, C), labels int64 (N,)) into the run's output directory; latent models write latents float32
(N, C, [T,] H, W) instead of images, and
text-conditioned models the prompts' captions instead of labels. With vae=FOLDER (default: the VAE the data was
prepared with, when that folder exists) latents are also decoded beside samples.npz: samples.png + sample-000.png
... for images, samples.gif + sample-000.mp4 / .gif ... for videos (ringdit.media). Sample i starts from noise
seeded by (seed, i) (ringdit.seeding, stream INFERENCE), so the same seed gives the same sample i for any
num_samples, batch size and ring / Ulysses / data-parallel layout: exactly up to fp64 rounding; in fp32 up to the
rounding of the GEMM kernels the batch size, layout and CPU pick (~2e-7 of the largest value after 10 DDPM steps).
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
import lightning as L
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from ringdit.cli import hydra_main, register_resolvers, user_errors
from ringdit.config import (
    ConfigError,
    build_on_meta,
    check_infer_settings,
    check_launch_environment,
    check_samples_per_rank,
    check_sampling,
    check_weights_file,
    group_targets,
    read_weights_file,
    resolve_sampling_ckpt,
    validate_parallel,
)
from ringdit.errors import require_choice, require_count, require_seed
from ringdit.data.text_latents import TextLatentsDataModule, read_prompts
from ringdit.media.decode import decode_samples, latents_normalised, sampling_vae
from ringdit.run_folder import claim_run_folder
from ringdit.sampling import SampleRequests, SampleWriter, resolve_labels
from ringdit.training import DiTModule
from ringdit.training.preemption import sigterm_stops_at_once, stop_on_sigterm
from ringdit.weights import WEIGHT_CHOICES

log = logging.getLogger("ringdit.infer")
register_resolvers()


def prepare(cfg: DictConfig):
    """Check every setting and the checkpoint, then build the trainer, module and sample requests."""
    check_infer_settings(cfg)
    cfg.ckpt_path = resolve_sampling_ckpt(cfg.ckpt_path, cfg.paths.log_dir)
    require_count("num_samples", cfg.num_samples)
    require_count("batch_size", cfg.batch_size)
    require_seed("seed", cfg.seed)
    require_choice("weights", cfg.weights, WEIGHT_CHOICES)
    check_launch_environment(cfg.trainer)
    backend = validate_parallel(cfg, training=False)
    check_samples_per_rank(cfg)
    state, info = read_weights_file("ckpt_path", cfg.ckpt_path, prefer=cfg.weights)
    missing = [key for key in ("model", "data", "objective") if key not in info]
    if missing:
        raise ConfigError(f"ckpt_path={cfg.ckpt_path} does not say which model it holds (no {', '.join(missing)}): "
                          f"sample from a ringdit checkpoint (.ckpt) or export (.safetensors), or fine-tune it "
                          f"first with init_from")
    cfg.vae = sampling_vae(cfg.vae, cfg.vae_subfolder, info["data"])
    meta_model = build_on_meta(info["model"], cfg.ulysses_degree)
    check_weights_file("ckpt_path", cfg.ckpt_path, meta_model, state=state)
    del state
    captions = negative = None
    if info["data"].get("conditioning") == "text":
        conditions, captions = text_prompts(cfg, info["data"])
        if cfg.prompts or cfg.negative_prompt:
            conditions, captions, negative = encoded_prompts(cfg, info["data"], conditions, captions)
        if cfg.negative_text_embeds:
            negative_prompts, _ = read_prompts(cfg.negative_text_embeds, "negative_text_embeds")
            negative = {key: value[:1] for key, value in negative_prompts.items()}  # the first row
            check_prompt_shape("negative_text_embeds", negative, info["data"])
    else:
        refuse_text_settings(cfg)
        conditions = resolve_labels(OmegaConf.to_container(cfg.labels) if OmegaConf.is_list(cfg.labels) else cfg.labels,
                                    cfg.num_samples, info["data"])
    sampling = {**info.get("sampling", {}),
                **{k: cfg[k] for k in ("steps", "cfg_scale", "sampler", "guidance", "guidance_channels")
                   if cfg.get(k) is not None}}
    check_sampling(info["model"], info["objective"], sampling)

    module = DiTModule(model=info["model"], objective=info["objective"], data=info["data"], sampling=sampling,
                       attention_backend=backend, init_from=cfg.ckpt_path, init_weights=cfg.weights)
    module.negative_condition = negative
    writer = SampleWriter(cfg.paths.output_dir, captions=captions, fps=cfg.fps)
    callbacks = [writer, *(hydra.utils.instantiate(c) for c in group_targets(cfg, "callbacks"))]
    trainer: L.Trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=False)
    requests = DataLoader(SampleRequests(conditions, cfg.seed), batch_size=cfg.batch_size)
    claim_run_folder(cfg.paths.output_dir, "infer")  # last: every check has passed
    return trainer, module, requests


TEXT_SETTINGS = ("prompts", "negative_prompt", "text_embeds", "negative_text_embeds", "text_encoder", "tokenizer")


def refuse_text_settings(cfg: DictConfig) -> None:
    """A class-conditional model has no text input: prompts given to it would be ignored, not followed."""
    given = [key for key in TEXT_SETTINGS if cfg.get(key)]
    if given:
        raise ConfigError(f"{', '.join(f'{key}={cfg[key]}' for key in given)}: ckpt_path={cfg.ckpt_path} is a "
                          f"class-conditional model, which takes no text; choose classes with labels=[...] (ids or "
                          f"names), or sample a text-conditioned checkpoint (model=wan, flux, qwenimage)")


def text_prompts(cfg: DictConfig, data_info: dict) -> tuple[dict, list[str]]:
    """``num_samples`` prompt embeddings (cycled): from ``text_embeds``, else the training data's held-out prompts."""
    if cfg.labels is not None:
        raise ConfigError("labels are for class-conditional models; this model is text-conditioned: give prompt "
                          "embeddings with text_embeds=<file> (or none for the training data's held-out prompts)")
    if cfg.prompts:  # encoded in encoded_prompts
        if cfg.text_embeds:
            raise ConfigError("give prompts= (text to encode) or text_embeds= (encoded prompts), not both")
        return None, None
    if cfg.text_embeds:
        prompts, captions = read_prompts(cfg.text_embeds)
        count = next(iter(prompts.values())).shape[0]
        picked = [i % count for i in range(cfg.num_samples)]
        prompts = {key: value[picked] for key, value in prompts.items()}
        captions = [captions[i] if captions else f"{cfg.text_embeds}[{i}]" for i in picked]
    else:
        source = data_info["source"]
        try:
            data = TextLatentsDataModule(source["path"], val_fraction=source["val_fraction"], seed=source["seed"],
                                         check_values=False)  # only its held-out prompts are read (and checked)
        except ValueError as error:
            raise ConfigError(f"text_embeds is not set and the training data's held-out prompts cannot be read "
                              f"({error}); give prompt embeddings with text_embeds=<file>") from None
        prompts, captions = data.held_out(cfg.num_samples)
    check_prompt_shape("text_embeds", prompts, data_info)
    return prompts, captions


def encoded_prompts(cfg: DictConfig, data_info: dict, conditions, captions):
    """``prompts`` / ``negative_prompt`` encoded with the text encoder the data was prepared with (``text_encoder=``
    overrides it): (conditions cycled to num_samples, captions, negative (1, ...) or None for the empty prompt)."""
    import torch

    from ringdit.media.text import encode_prompts

    if cfg.negative_prompt and cfg.negative_text_embeds:
        raise ConfigError("give negative_prompt= (text to encode) or negative_text_embeds= (encoded), not both")
    prepared = data_info.get("text_encoder") or {}
    encoder = cfg.text_encoder or prepared.get("path")
    if not encoder:
        raise ConfigError("prompts / negative_prompt need a text encoder: pass text_encoder=FOLDER (the T5 / UMT5 / "
                          "CLIP folder the training data was encoded with), or give text_embeds= instead")
    texts = [] if not cfg.prompts else [cfg.prompts] if isinstance(cfg.prompts, str) else [str(p) for p in cfg.prompts]
    encoded, negative = encode_prompts(texts or [""], cfg.negative_prompt, encoder,
                                       cfg.tokenizer or (None if cfg.text_encoder else prepared.get("tokenizer")),
                                       text_len=data_info["text_len"], text_dim=data_info["text_dim"],
                                       device="cuda" if torch.cuda.is_available() else "cpu")
    if texts:
        picked = [i % len(texts) for i in range(cfg.num_samples)]
        conditions, captions = {key: value[picked] for key, value in encoded.items()}, [texts[i] for i in picked]
    return conditions, captions, negative if cfg.negative_prompt else None


def check_prompt_shape(setting: str, prompts: dict, data_info: dict) -> None:
    expected = (data_info["text_len"], data_info["text_dim"])
    if tuple(prompts["text"].shape[1:]) != expected:
        raise ConfigError(f"{setting}: the prompt embeddings are {tuple(prompts['text'].shape[1:])} (L, D) but the "
                          f"model was trained on {expected}; encode them with the same text encoder and length")


@hydra_main("infer")
def main(cfg: DictConfig) -> None:
    with user_errors():  # a mistake in the settings: one line, exit code 2
        trainer, module, requests = prepare(cfg)
    # SIGTERM: every rank stops at the next sampler step, the finished batches are written, exit code 143
    with stop_on_sigterm(trainer, logger=log):
        trainer.predict(module, dataloaders=requests, return_predictions=False)
        if cfg.vae and trainer.is_global_zero:
            samples = Path(cfg.paths.output_dir) / "samples.npz"
            kept = f"every sample is in {samples} (decoded files may be incomplete); decode them with python -m " \
                   f"ringdit.media.decode {samples} vae={cfg.vae}"
            with user_errors(), sigterm_stops_at_once("the VAE decode", kept):  # nothing else would be lost
                written = decode_samples(samples, cfg.vae, vae_subfolder=cfg.vae_subfolder, fps=cfg.fps,
                                         tile=cfg.vae_tile, device=str(trainer.strategy.root_device),
                                         normalised=latents_normalised(module.hparams.data))
            log.info("decoded with vae=%s: %s", cfg.vae, ", ".join(p.name for p in written))


if __name__ == "__main__":
    main()
