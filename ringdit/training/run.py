"""Fine-tune / train a DiT with ring + Ulysses context parallelism.

    python train.py                                  # tiny DiT on the built-in digits, CPU or GPU
    python train.py ring_degree=4                    # the same sequence sharded over 4 ranks
    python train.py ring_degree=2 ulysses_degree=2 dp_degree=2 trainer.max_steps=100 logger=csv
    python train.py ckpt_path=last                   # resume the newest run
    python train.py --cfg job                        # show the composed config

Settings live in conf/ (Hydra); outputs (checkpoints, sample grids, logs) go to the run's output directory.

From Python (a notebook, a script): ``ringdit.train(ringdit.config("train", ["model=wan_tiny", "trainer.max_steps=10"]))``
runs the same code in the caller's process.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from ringdit.common.atomic import DiskFullError
from ringdit.commands.cli import register_resolvers
from ringdit.commands.task import Task, command
from ringdit.common.errors import NonFiniteLossError
from ringdit.spec import TrainSpec
from ringdit.training import DiffusionModule, DistillationModule
from ringdit.training.parallel_strategy import build_strategy

log = logging.getLogger("ringdit.train")
register_resolvers()


def prepare(cfg: DictConfig):
    """Check every setting (``TrainSpec``), then build the trainer, module and data from the spec; nothing is spawned
    yet."""
    spec = TrainSpec.from_config(cfg)
    plan = spec.checkpoint

    import lightning as L  # the trainer, module and processes come only after every check has passed
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    L.seed_everything(spec.seed, workers=True)
    # distill=dmd2: a student and a critic that start from the teacher (init_from), which stays frozen
    module = (DiffusionModule if spec.distill is None else DistillationModule).from_spec(spec)
    callbacks = [hydra.utils.instantiate(c) for c in spec.trainer.callbacks]
    loggers = [hydra.utils.instantiate(c) for c in spec.trainer.loggers]
    if not loggers:  # logger=none: the learning rate has nowhere to go (Lightning refuses the monitor without one)
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    # the strategy runs the layout checked once (spec.layout), whose kind its class declared: not read again from
    # its config or recognised by name
    layout = spec.layout
    strategy_cfg = spec.trainer.config["strategy"]
    ddp = layout.strategy == "ddp"
    # a model kind whose loss may leave parameters without a gradient (diffusers: QwenImage's last text-stream MLP):
    # DDP's static graph learns which in the first step instead of failing on them (FSDP reduces whatever gradients
    # exists); a two-expert model training both runs one expert a step, a set that changes, which DDP finds anew; so
    # does a run accumulating gradients: DDP's static graph cannot learn its graph under no_sync (Lightning skips the
    # all-reduce of the micro-batches before the last; DDP's reducer asserts "expect_autograd_hooks_")
    accumulates = spec.trainer.config.get("accumulate_grad_batches", 1) > 1
    unused = {"find_unused_parameters": True} if spec.expert == "both" or accumulates else {"static_graph": True}
    if spec.model.kind.loss_reaches_every_parameter or not ddp \
            or {"static_graph", "find_unused_parameters"} & set(strategy_cfg):
        unused = {}  # (the DiT's loss reaches every parameter); a strategy config that says how wins
    if spec.distill is not None and ddp and not {"static_graph", "find_unused_parameters"} & set(strategy_cfg):
        unused = {"find_unused_parameters": True}  # the critic's updates reach the critic only, the student's it
    strategy = build_strategy(strategy_cfg, layout, **unused)
    # a distillation clips each of its updates itself (DistillationModule: manual optimization)
    clip = {} if spec.distill is None else {"gradient_clip_val": None}
    trainer = hydra.utils.instantiate(
        spec.trainer.config, strategy=strategy, callbacks=callbacks, logger=loggers or False, **clip,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),  # callbacks=none: no files
    )
    if trainer.is_global_zero:
        log.info("DiT %s on %s, %d tokens per sample; ring %d x ulysses %d x dp %d; attention %s",
                 {k: v for k, v in spec.model.config.items() if k != "_target_"}, type(spec.data.module).__name__,
                 spec.model.tokens, layout.ring_degree, layout.ulysses_degree, layout.dp_degree,
                 layout.attention_backend)
    return trainer, module, spec.data.module, plan.ckpt_path


@command("train", doing="training")
def main(cfg: DictConfig, task: Task) -> Path:
    trainer, module, datamodule, ckpt_path = prepare(cfg)
    task.claim(cfg.paths.output_dir, resumes=ckpt_path)  # last: every check has passed
    for logger in trainer.loggers:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))  # the composed config, as the record
    # SIGTERM: every rank stops after the step with a checkpoint, exit code 143; a non-finite loss or a disk that
    # fills while a checkpoint is written: one line, exit code 2; anything else is a fault: traceback
    task.start(trainer=trainer, loggers=trainer.loggers, errors=(NonFiniteLossError, DiskFullError))
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        log.info("outputs in %s (checkpoints/last.ckpt, samples/)", cfg.paths.output_dir)
    return Path(cfg.paths.output_dir)


def train(cfg: DictConfig) -> Path:
    """Train or fine-tune as ``python train.py`` does, with ``cfg`` (``ringdit.config("train", [...])``), in this
    process (a layout of several ranks starts them as the command does); returns the run folder. A mistake in the
    settings raises ``ringdit.common.errors.ConfigError`` before anything is built."""
    return main.run(cfg)
