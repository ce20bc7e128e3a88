"""Fine-tune / train a DiT with ring + Ulysses context parallelism.

    python train.py                                  # tiny DiT on the built-in digits, CPU or GPU
    python train.py ring_degree=4                    # the same sequence sharded over 4 ranks
    python train.py ring_degree=2 ulysses_degree=2 dp_degree=2 trainer.max_steps=100 logger=csv
    python train.py ckpt_path=last                   # resume the newest run
    python train.py --cfg job                        # show the composed config

Settings live in conf/ (Hydra); outputs (checkpoints, sample grids, logs) go to the run's output directory.
"""

from __future__ import annotations

import logging
import math

import hydra
from omegaconf import DictConfig, OmegaConf

from ringdit.cli import hydra_main, register_resolvers, user_errors
from ringdit.config import (
    build_on_meta,
    check_lora,
    check_lora_checkpoint,
    check_launch_environment,
    check_sampling,
    check_training_settings,
    check_weights_file,
    group_targets,
    is_diffusers_model,
    model_config,
    resolve_ckpt_path,
    resolve_shift,
    validate_parallel,
)
from ringdit.errors import NonFiniteLossError, require_choice, require_count, require_seed
from ringdit.lora import check_lora_settings, lora_enabled
from ringdit.memory import check_training_memory
from ringdit.resume import check_resume
from ringdit.run_folder import claim_run_folder
from ringdit.weights import WEIGHT_CHOICES

log = logging.getLogger("ringdit.train")
register_resolvers()


def prepare(cfg: DictConfig):
    """Check every setting, then build the trainer, module and data; nothing is spawned yet."""
    require_count("trainer.max_steps", cfg.trainer.max_steps)
    require_count("data.batch_size", cfg.data.batch_size)
    require_seed("seed", cfg.seed)
    require_choice("init_weights", cfg.init_weights, WEIGHT_CHOICES)
    check_training_settings(cfg)
    lora = OmegaConf.to_container(cfg.lora, resolve=True) if cfg.get("lora") else None
    check_lora_settings(lora)
    check_launch_environment(cfg.trainer)
    backend = validate_parallel(cfg, training=True)
    datamodule = hydra.utils.instantiate(cfg.data)
    data_info = datamodule.describe()
    model_cfg = model_config(cfg.model, data_info)
    meta_model = build_on_meta(model_cfg, cfg.ulysses_degree)
    objective = OmegaConf.to_container(cfg.diffusion.objective, resolve=True)
    sampling = OmegaConf.to_container(cfg.diffusion.sampling, resolve=True)
    resolve_shift(objective, sampling, math.prod(meta_model.default_grid))
    check_sampling(model_cfg, cfg.diffusion.objective, sampling, prefix="diffusion.sampling.")
    grid_cfg_scale = OmegaConf.select(cfg, "callbacks.sample_grid.cfg_scale")
    if grid_cfg_scale is not None:
        check_sampling(model_cfg, cfg.diffusion.objective, {**sampling, "cfg_scale": grid_cfg_scale})
    if lora_enabled(lora):
        check_lora(meta_model, lora)
    check_training_memory(cfg, model_cfg, meta_model, backend)  # a warning: estimates can be wrong
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, cfg.paths.log_dir, cfg.task_name)
    if ckpt_path and lora_enabled(lora):
        check_lora_checkpoint(ckpt_path)
    elif ckpt_path:
        check_weights_file("ckpt_path", ckpt_path, meta_model, prefer="model")
        check_resume(ckpt_path, max_steps=cfg.trainer.max_steps, optimizer=hydra.utils.instantiate(cfg.optimizer),
                     optimizer_name=cfg.optimizer.get("_target_"), resume_optimizer=cfg.resume_optimizer)
    elif cfg.init_from:  # a resumed run takes its weights from ckpt_path
        check_weights_file("init_from", cfg.init_from, meta_model, prefer=cfg.init_weights,
                           resize_labels=cfg.init_resize_labels)

    import lightning as L  # the trainer, module and processes come only after every check above has passed
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ringdit.training import DiTModule

    L.seed_everything(cfg.seed, workers=True)
    module = DiTModule(
        model=model_cfg,
        objective=objective,
        data=data_info,
        sampling=sampling,
        optimizer=hydra.utils.instantiate(cfg.optimizer),
        scheduler=hydra.utils.instantiate(cfg.scheduler) if cfg.get("scheduler") else None,  # scheduler=constant
        ema_decay=cfg.ema_decay,
        seed=cfg.seed,
        attention_backend=backend,
        compile=cfg.compile,
        init_from=None if ckpt_path and not lora_enabled(lora) else cfg.init_from,  # LoRA resumes only adapters
        init_weights=cfg.init_weights,
        init_resize_labels=cfg.init_resize_labels,
        nonfinite_loss=cfg.nonfinite_loss,
        lora=lora if lora_enabled(lora) else None,
        resume_optimizer=cfg.resume_optimizer,
    )
    callbacks = [hydra.utils.instantiate(c) for c in group_targets(cfg, "callbacks")]
    loggers = [hydra.utils.instantiate(c) for c in group_targets(cfg, "logger")]
    # diffusers models may hold parameters no loss reaches (QwenImage's last text-stream MLP): DDP's static graph
    # learns which in the first step instead of failing on them (FSDP reduces whatever gradients exist)
    ddp = str(cfg.trainer.strategy.get("_target_", "")).endswith("RingDDPStrategy")
    strategy = hydra.utils.instantiate(cfg.trainer.strategy, **({"static_graph": True} if is_diffusers_model(model_cfg)
                                                                 and ddp and "static_graph" not in cfg.trainer.strategy
                                                                 else {}))
    trainer = hydra.utils.instantiate(
        cfg.trainer, strategy=strategy, callbacks=callbacks, logger=loggers or False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),  # callbacks=none: no files
    )
    claim_run_folder(cfg.paths.output_dir, "train", resumes=ckpt_path)  # last: every check has passed
    for logger in trainer.loggers:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    if trainer.is_global_zero:
        log.info("DiT %s on %s, %d tokens per sample; ring %d x ulysses %d x dp %d; attention %s",
                 {k: v for k, v in model_cfg.items() if k != "_target_"}, type(datamodule).__name__,
                 math.prod(meta_model.default_grid), cfg.ring_degree, cfg.ulysses_degree,
                 trainer.world_size // (cfg.ring_degree * cfg.ulysses_degree), backend)
    return trainer, module, datamodule, ckpt_path


@hydra_main("train")
def main(cfg: DictConfig) -> None:
    with user_errors():  # a mistake in the settings: one line, exit code 2
        trainer, module, datamodule, ckpt_path = prepare(cfg)
    from ringdit.training.preemption import stop_on_sigterm

    # SIGTERM: every rank stops after the step with a checkpoint, exit code 143; anything else is a fault: traceback
    with user_errors(NonFiniteLossError), stop_on_sigterm(trainer):
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        log.info("outputs in %s (checkpoints/last.ckpt, samples/)", cfg.paths.output_dir)


if __name__ == "__main__":
    main()
