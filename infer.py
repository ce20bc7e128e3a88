"""Sample from a trained DiT, sequence-parallel over ring / Ulysses ranks and data-parallel over the rest.

    python infer.py ckpt_path=outputs/train/runs/<run>/checkpoints/last.ckpt num_samples=100
    python infer.py ckpt_path=weights.safetensors labels=[3,3,7] cfg_scale=2 steps=100 ring_degree=2

    python infer.py ckpt_path=<wan run>/checkpoints/last.ckpt text_embeds=prompts.safetensors cfg_scale=5

Writes samples.png (videos: samples.gif) and samples.npz (images uint8 (N, [T,] H, W, C), labels int64 (N,)) into
the run's output directory; latent models write latents float32 (N, C, [T,] H, W) instead of images, and
text-conditioned models the prompts' captions instead of labels. Sample i starts from noise seeded by seed + i, so the same seed gives the same samples
for any ring / Ulysses / data-parallel layout.
"""

from __future__ import annotations

import logging

import hydra
import lightning as L
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from ringdit.config import (
    ConfigError,
    build_on_meta,
    check_infer_settings,
    check_launch_environment,
    check_samples_per_rank,
    check_sampling,
    check_weights_file,
    group_targets,
    hydra_main,
    read_weights_file,
    register_resolvers,
    require_choice,
    require_positive,
    require_seed,
    user_errors,
    validate_parallel,
)
from ringdit.data.text_latents import TextLatentsDataModule, read_prompts
from ringdit.sampling import SampleRequests, SampleWriter, resolve_labels
from ringdit.training import DiTModule
from ringdit.weights import WEIGHT_CHOICES

log = logging.getLogger("ringdit.infer")
register_resolvers()


def prepare(cfg: DictConfig):
    """Check every setting and the checkpoint, then build the trainer, module and sample requests."""
    check_infer_settings(cfg)
    require_positive("num_samples", cfg.num_samples)
    require_positive("batch_size", cfg.batch_size)
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
    meta_model = build_on_meta(info["model"], cfg.ulysses_degree)
    check_weights_file("ckpt_path", cfg.ckpt_path, meta_model, state=state)
    del state
    captions = negative = None
    if info["data"].get("conditioning") == "text":
        conditions, captions = text_prompts(cfg, info["data"])
        if cfg.negative_text_embeds:
            negative = {key: value[:1] for key, value in read_prompts(cfg.negative_text_embeds, "negative_text_embeds")[0].items()}
            check_prompt_shape("negative_text_embeds", negative, info["data"])
    else:
        conditions = resolve_labels(OmegaConf.to_container(cfg.labels) if OmegaConf.is_list(cfg.labels) else cfg.labels,
                                    cfg.num_samples, info["data"])
    sampling = {**info.get("sampling", {}),
                **{k: cfg[k] for k in ("steps", "cfg_scale", "sampler", "guidance") if cfg.get(k) is not None}}
    check_sampling(info["model"], info["objective"], sampling)
    if cfg.cfg_parallel and (not isinstance(cfg.dp_degree, int) or cfg.dp_degree % 2):
        raise ConfigError(f"cfg_parallel=true runs the two halves of guidance on two data-parallel replicas: set "
                          f"dp_degree to an even number (2), got dp_degree={cfg.dp_degree}")

    module = DiTModule(model=info["model"], objective=info["objective"], data=info["data"], sampling=sampling,
                       attention_backend=backend, init_from=cfg.ckpt_path, init_weights=cfg.weights)
    module.negative_condition = negative
    writer = SampleWriter(cfg.paths.output_dir, captions=captions)
    callbacks = [writer, *(hydra.utils.instantiate(c) for c in group_targets(cfg, "callbacks"))]
    trainer: L.Trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=False)
    requests = DataLoader(SampleRequests(conditions, cfg.seed), batch_size=cfg.batch_size)
    return trainer, module, requests


@hydra_main("infer")
def main(cfg: DictConfig) -> None:
    with user_errors():  # a mistake in the settings: one line, exit code 2
        trainer, module, requests = prepare(cfg)
    trainer.predict(module, dataloaders=requests, return_predictions=False)


if __name__ == "__main__":
    main()
