"""``TrainSpec``: everything a training run is, checked once, before any process is spawned.

``TrainSpec.from_config(cfg)`` reads the composed Hydra config; train.py builds the trainer, module and data from the
spec alone and trusts it. The checks run cheapest first: each setting's own value, then the launch and the layout,
then the data (opening it can read every shard), the model it shapes (built on the meta device), and last the files
the run will load. A typo costs seconds, not a hung cluster; errors name the setting, the value and what would work.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig, OmegaConf

from ringdit.media.audio import sampling_audio_vae
from ringdit.models.conditioning import AUDIO_KEY
from ringdit.common.errors import ConfigError, require_count, require_number, require_seed
from ringdit.costs import Setup, check_memory, memory_setup
from ringdit.costs.previews import check_run_previews
from ringdit.spec.checkpoint import CheckpointPlan
from ringdit.spec.diffusion import training_diffusion, training_expert
from ringdit.spec.distill import DistillSpec
from ringdit.diffusion.model_guidance import check_model_guidance
from ringdit.parallel.layout import Layout
from ringdit.spec.model import ModelSpec
from ringdit.spec.optimizer import OptimizerSpec
from ringdit.spec.trainer import TrainerSpec
from ringdit.models.build import BuildPlan

if TYPE_CHECKING:
    from lightning import LightningDataModule

log = logging.getLogger(__name__)

NONFINITE_LOSS = ("stop", "skip")


@dataclass(frozen=True)
class DataSpec:
    batch_size: int  # samples per data-parallel rank and step
    info: dict       # what the data module describes: channels, image_size, classes or text shapes, its source
    module: LightningDataModule = field(repr=False, compare=False)  # built once, while checking: opening is its check

    @staticmethod
    def check_settings(data_cfg: DictConfig) -> None:
        require_count("data.batch_size", data_cfg.batch_size)
        require_count("data.tokens_per_batch", data_cfg.get("tokens_per_batch"), optional=True,
                      hint="model tokens per rank and step; each bucket's batch is as many samples as fit")
        require_count("data.num_workers", data_cfg.get("num_workers", 0), minimum=0)
        if "val_fraction" in data_cfg:
            require_number("data.val_fraction", data_cfg.val_fraction, low=0, high=1, optional=True)  # null: default

    @classmethod
    def from_config(cls, data_cfg: DictConfig) -> DataSpec:
        """Open the data: the data module checks its files (shapes, values) as it is built."""
        module = hydra.utils.instantiate(data_cfg)
        return cls(batch_size=data_cfg.batch_size, info=module.describe(), module=module)


@dataclass(frozen=True)
class TrainSpec:
    seed: int
    compile: bool            # torch.compile each block (regional compilation)
    nonfinite_loss: str      # a NaN / Inf loss: stop (keeping the last good checkpoint) | skip the step
    output_dir: str          # the run folder (hydra.run.dir)
    layout: Layout
    trainer: TrainerSpec
    data: DataSpec
    model: ModelSpec
    objective: dict          # the objective's config (_target_ FlowMatching / DDPM), shift resolved
    expert: str | None       # a two-expert model's expert that trains: high | low | both; None: one transformer
    sampling: dict           # preview and infer.py defaults: sampler, steps, cfg_scale, shift, guidance
    optimizer: OptimizerSpec
    checkpoint: CheckpointPlan
    distill: DistillSpec | None = None  # distill=dmd2: the student's and critic's settings; None: plain training
    memory: Setup = Setup()  # what the memory estimate counts besides the model and the layout (memory_setup)
    model_guidance: tuple[float, float] | None = None  # diffusion.model_guidance: the scales' range; None: off

    @property
    def build_plan(self) -> BuildPlan:
        """What the ranks build the trained model from (``DiffusionModule.from_spec`` records it)."""
        plan = self.checkpoint
        return BuildPlan(self.model.config, backend=self.layout.attention_backend, init_from=plan.init_from,
                         init_weights=plan.init_weights, resize_labels=plan.init_resize_labels, lora=plan.lora,
                         expert=self.expert, ema_decay=self.optimizer.ema_decay, compile=self.compile, seed=self.seed)

    @classmethod
    def from_config(cls, cfg: DictConfig) -> TrainSpec:
        """Check every setting of train.py's ``cfg`` and return the run it describes (nothing is spawned)."""
        # each setting's own value: cheap, before the data is opened
        TrainerSpec.check_settings(cfg, training=True)
        DataSpec.check_settings(cfg.data)
        require_seed("seed", cfg.seed)
        CheckpointPlan.check_settings(cfg)
        ModelSpec.check_settings(cfg.get("model"))
        DistillSpec.check_settings(cfg)
        if cfg.nonfinite_loss not in NONFINITE_LOSS:
            raise ConfigError(f"nonfinite_loss must be 'stop' or 'skip', got {cfg.nonfinite_loss!r}")
        optimizer = OptimizerSpec.from_config(cfg)
        for key in ("cfg_scale", "cfg_scale_2"):
            require_number(f"diffusion.sampling.{key}", cfg.diffusion.sampling.get(key), optional=True)
        # the processes and what they run: before the data, whose opening can take long
        layout = Layout.from_config(cfg, training=True)
        trainer = TrainerSpec.from_config(cfg, training=True)
        # the data, the model it shapes (built on meta), and the objective and sampling that fit them
        data = DataSpec.from_config(cfg.data)
        model, meta_model = ModelSpec.from_data(cfg.model, data.info, layout.ulysses_degree)
        data.module.set_patch_shape(meta_model.patch_shape)  # the bucket's token counts: tokens_per_batch
        check_preview_shapes(trainer.callbacks, data.info, meta_model.patch_shape)
        check_preview_audio(trainer.callbacks, data.info, meta_model)
        model_guidance = check_model_guidance(
            OmegaConf.to_container(cfg.diffusion, resolve=True).get("model_guidance"), meta_model,
            None if (cfg.get("distill") or {}).get("method", "none") == "none" else cfg.distill.method)
        expert = training_expert(cfg, model.config)  # first: a two-expert model's objective is the mistake to name
        objective, sampling = training_diffusion(cfg, model.config, model.tokens)
        if expert in ("high", "low"):  # the estimate counts gradients and optimizer state of the expert that trains
            meta_model.train_only(expert)
        # the files the run loads, against the model
        checkpoint = CheckpointPlan.from_config(cfg, meta_model, optimizer=optimizer, max_steps=trainer.max_steps,
                                                expert=expert)
        distill = DistillSpec.from_config(cfg, objective, sampling, model.config, meta_model, expert)
        # what the memory estimate counts, from the parts above (not the raw config again)
        memory = memory_setup(layout, batch_size=data.batch_size, precision=trainer.config.get("precision", "32"),
                              param_dtype=(trainer.config.get("strategy") or {}).get("param_dtype"),
                              model_config=model.config, lora=checkpoint.lora, optimizer_states=optimizer.states,
                              ema=bool(optimizer.ema_decay), distill=distill.settings if distill else None)
        # a warning (only an estimate), for the bucket whose steps hold the most tokens
        check_memory(memory, layout, model.config, meta_model, checkpoint.lora, data.module.largest_step())
        if distill is not None:  # previews and the checkpoint's record: the student's few steps, unguided
            sampling = distill.student_sampling(sampling)
        check_run_previews(memory, checkpoint.lora, layout, trainer.callbacks, data.info, model.config, meta_model,
                           model.tokens, sampling)
        return cls(seed=cfg.seed, compile=cfg.compile, nonfinite_loss=cfg.nonfinite_loss,
                   output_dir=cfg.paths.output_dir, layout=layout, trainer=trainer, data=data, model=model,
                   objective=objective, expert=expert, sampling=sampling, optimizer=optimizer, checkpoint=checkpoint,
                   distill=distill, memory=memory, model_guidance=model_guidance)


def check_preview_audio(callbacks: tuple[dict, ...], data_info: dict, meta_model) -> None:
    """A preview grid's ``audio_vae`` of another sample rate than the data's sound or the model's, or for a model
    without sound: a ConfigError now, not in the ranks (``ringdit.media.audio.sampling_audio_vae``)."""
    for config in callbacks:
        if str(config.get("_target_", "")).endswith("SampleGrid") and config.get("audio_vae"):
            sound = AUDIO_KEY in meta_model.joint_latents
            sampling_audio_vae(config["audio_vae"], config.get("audio_vae_subfolder", "audio_vae"),
                               config.get("vocoder_subfolder", "vocoder"), data_info,
                               dict(meta_model.transformer.config) if sound else None,
                               setting="callbacks.sample_grid.audio_vae")


def check_preview_shapes(callbacks: tuple[dict, ...], data_info: dict, patch: tuple[int, ...]) -> None:
    """A preview grid's ``size`` / ``frames`` that the model cannot sample: a ConfigError now, not in the ranks."""
    for config in callbacks:
        controlled = "control" in (data_info.get("image_keys") or ())  # Wan VACE: previews only as the data are
        if str(config.get("_target_", "")).endswith("SampleGrid") and (
                config.get("size") or config.get("frames") or (controlled and config.get("prompt_file"))):
            hydra.utils.instantiate(config).check_shape(data_info, patch)
