"""Sample from a trained DiT, sequence-parallel over ring / Ulysses ranks and data-parallel over the rest.

    python infer.py                                  # the newest training run's last.ckpt (ckpt_path=last)
    python infer.py ckpt_path=outputs/train/runs/<run>/checkpoints/last.ckpt num_samples=100
    python infer.py ckpt_path=weights.safetensors labels=[3,3,7] cfg_scale=2 steps=100 ring_degree=2

Writes samples.png (videos: samples.gif) and samples.npz (images uint8 (N, [T,] H, W, C), labels int64 (N,)) into
the run's output directory. A model trained on latents writes latents to samples.npz; with vae=FOLDER (default: the
VAE its data was prepared with, when that folder exists) they are decoded beside it: samples.png + sample-000.png
... for images, samples.gif + sample-000.mp4 / .gif ... for videos (ringdit.media). Sample i starts from noise
seeded by seed + i, so the same seed gives the same samples for any ring / Ulysses / data-parallel layout.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
import lightning as L
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from ringdit.config import (
    ConfigError,
    build_on_meta,
    check_sampling,
    check_weights_file,
    group_targets,
    read_weights_file,
    register_resolvers,
    require_positive,
    resolve_sampling_ckpt,
    user_errors,
    validate_parallel,
)
from ringdit.media.decode import decode_samples, latents_normalised, sampling_vae
from ringdit.sampling import SampleRequests, SampleWriter, resolve_labels
from ringdit.training import DiTModule

log = logging.getLogger("ringdit.infer")
register_resolvers()


def prepare(cfg: DictConfig):
    """Check every setting and the checkpoint, then build the trainer, module and sample requests."""
    cfg.ckpt_path = resolve_sampling_ckpt(cfg.ckpt_path, cfg.paths.log_dir)
    require_positive("num_samples", cfg.num_samples)
    require_positive("batch_size", cfg.batch_size)
    backend = validate_parallel(cfg, training=False)
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
    labels = resolve_labels(OmegaConf.to_container(cfg.labels) if OmegaConf.is_list(cfg.labels) else cfg.labels,
                            cfg.num_samples, info["data"])
    sampling = {**info.get("sampling", {}),
                **{k: cfg[k] for k in ("steps", "cfg_scale", "sampler") if cfg[k] is not None}}
    check_sampling(info["model"], info["objective"], sampling)

    module = DiTModule(model=info["model"], objective=info["objective"], data=info["data"], sampling=sampling,
                       attention_backend=backend, init_from=cfg.ckpt_path, init_weights=cfg.weights)
    writer = SampleWriter(cfg.paths.output_dir)
    callbacks = [writer, *(hydra.utils.instantiate(c) for c in group_targets(cfg, "callbacks"))]
    trainer: L.Trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=False)
    requests = DataLoader(SampleRequests(labels, cfg.seed), batch_size=cfg.batch_size)
    return trainer, module, requests


@hydra.main(version_base="1.3", config_path="conf", config_name="infer")
def main(cfg: DictConfig) -> None:
    with user_errors():  # a mistake in the settings: one line, exit code 2
        trainer, module, requests = prepare(cfg)
    trainer.predict(module, dataloaders=requests, return_predictions=False)
    if cfg.vae and trainer.is_global_zero:
        samples = Path(cfg.paths.output_dir) / "samples.npz"
        with user_errors():
            written = decode_samples(samples, cfg.vae, vae_subfolder=cfg.vae_subfolder, fps=cfg.fps,
                                     tile=cfg.vae_tile, device=str(trainer.strategy.root_device),
                                     normalised=latents_normalised(module.hparams.data))
        log.info("decoded with vae=%s: %s", cfg.vae, ", ".join(p.name for p in written))


if __name__ == "__main__":
    main()
