"""``DiTModule``: the LightningModule that fine-tunes and samples a (sequence-parallel) diffusion transformer: ringdit's
class-conditional DiT, or a text-conditioned diffusers transformer (``DiffusersTransformer``: Wan, ...).

Randomness that must agree across a sequence-parallel group -- diffusion time, noise, which labels are dropped for
classifier-free guidance -- is drawn per sample from the ``ringdit.seeding`` streams TRAIN and VALIDATION, keyed by
the sample's position in the global batch: every rank of a group draws the same values, a resumed run draws what the
uninterrupted run would have, and how the global batch is split over data-parallel replicas changes nothing.
"""

from __future__ import annotations

import math
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import hydra
import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.optim.swa_utils import AveragedModel

from ringdit.attention import validate_attention_config
from ringdit.diffusion import DDPM, draw_noise, noise_generators, sample
from ringdit.errors import NonFiniteLossError
from ringdit.images import to_uint8
from ringdit.lora import add_lora, is_adapter_key, lora_enabled
from ringdit.models import DiT
from ringdit.models.diffusers import DiffusersTransformer
from ringdit.parallel import (
    ParallelDims,
    exchange_guidance_halves,
    set_parallel_dims,
    shard_sequence,
    sharded_mean,
)
from ringdit.safe_config import check_file_configs
from ringdit.seeding import Stream, generator
from ringdit.weights import is_sharded_checkpoint, load_model_weights, safe_torch_load

Tensor = torch.Tensor


def ema_update(decay: float) -> Callable:
    """AveragedModel's ``multi_avg_fn`` for an EMA whose decay ramps up as (1 + n) / (10 + n) before reaching
    ``decay`` (early weights are not frozen into a long average of the random init); one fused update per step."""

    def update(averaged: list[Tensor], current: list[Tensor], num_averaged: Tensor) -> None:
        n = int(num_averaged)
        floats = [(a, c) for a, c in zip(averaged, current) if a.is_floating_point()]
        weight = 1 - min(decay, (1 + n) / (10 + n))
        for sharded in (False, True):  # under FSDP parameters are DTensors, buffers plain: one fused update each
            group = [(a, c) for a, c in floats if hasattr(a, "to_local") == sharded]
            if group:
                torch._foreach_lerp_([a for a, _ in group], [c for _, c in group], weight)
        for a, c in zip(averaged, current):  # integer and bool buffers (a text mask) are copied, not averaged
            if not a.is_floating_point():
                a.copy_(c)

    return update


def total_grad_norm(model: torch.nn.Module) -> Tensor | None:
    """The 2-norm of all gradients together; under FSDP (gradients sharded as DTensors) the norm of the full ones."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return None
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


class DiTModule(L.LightningModule):
    """Trains ``model`` (a DiT config with ``_target_``) with ``objective`` (FlowMatching / DDPM config).

    ``sampling``: defaults for preview grids and ``infer.py`` (``steps``, ``cfg_scale``, ``sampler``, ``shift``,
    ``guidance_channels``).
    ``data``: what the data module describes (channels, image_size, num_classes, class_names).
    """

    def __init__(
        self,
        model: dict,
        objective: dict,
        data: dict,
        sampling: dict | None = None,
        optimizer: Callable | None = None,
        scheduler: Callable | None = None,
        ema_decay: float = 0.999,
        seed: int = 0,
        attention_backend: str | None = None,
        compile: bool = False,
        init_from: str | None = None,
        init_weights: str = "ema",
        init_resize_labels: bool = False,
        nonfinite_loss: str = "stop",
        lora: dict | None = None,
        resume_optimizer: bool = True,
    ):
        super().__init__()
        if nonfinite_loss not in ("stop", "skip"):
            raise ValueError(f"nonfinite_loss must be 'stop' or 'skip', got {nonfinite_loss!r}")
        self.skipped_steps = 0
        self._step_skipped = False
        self._fresh_optimizer = False
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.objective = hydra.utils.instantiate(objective)
        self.sampling = {"steps": 50, "cfg_scale": 1.0, "sampler": None, "shift": 1.0, "guidance_channels": None,
                         **(sampling or {})}
        self.model: DiT | None = None
        self.ema: AveragedModel | None = None
        self._step_start: float | None = None
        self.negative_condition: dict[str, Tensor] | None = None  # infer.py's negative prompt (text models)
        self.parallel_dims = ParallelDims()  # the strategy hands over the mesh (set_parallel_dims) before building

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, *args, **kwargs):
        """Lightning's, after checking the configs the file carries: Lightning builds the module from them, and the
        module instantiates its model and objective configs (see ``ringdit.safe_config``)."""
        checkpoint = safe_torch_load(checkpoint_path, mmap=True)
        check_file_configs(str(checkpoint_path), checkpoint.get("hyper_parameters", {}) if isinstance(checkpoint, dict)
                           else {})
        if kwargs.get("hparams_file") is not None:
            from omegaconf import OmegaConf

            config = OmegaConf.to_container(OmegaConf.load(kwargs["hparams_file"]), resolve=False)
            check_file_configs(str(kwargs["hparams_file"]), config if isinstance(config, dict) else {"": config})
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    # ---- model ----------------------------------------------------------------------------------------------------
    def set_parallel_dims(self, dims: ParallelDims) -> None:
        """The strategy's mesh. A model built before (``load_from_checkpoint``) gets it from the same call
        (``ringdit.parallel.set_parallel_dims`` walks every module); one built later, in ``configure_model``."""
        self.parallel_dims = dims

    def configure_model(self) -> None:
        """Built here, not in __init__: the sequence-parallel mesh exists only once the strategy set it up, and
        each USPAttention checks its backend against it."""
        if self.model is not None:
            return
        dims = self.parallel_dims
        device_type = self.trainer.strategy.root_device.type if self._trainer is not None else self.device.type
        backend = validate_attention_config(
            self.hparams.attention_backend, ring_degree=dims.ring_degree,
            training=self.optimizer_factory is not None, device_type=device_type,
        )
        self.model = set_parallel_dims(hydra.utils.instantiate(self.hparams.model, attention_backend=backend), dims)
        init_from = self.hparams.init_from
        if init_from and Path(init_from).is_dir() and not is_sharded_checkpoint(init_from):  # a diffusers folder
            self.model.load_pretrained_weights(init_from)
        elif init_from:  # a ringdit .ckpt (a file, or an FSDP run's sharded folder) or a .safetensors export
            load_model_weights(self.model, init_from, prefer=self.hparams.init_weights,
                               resize_labels=self.hparams.init_resize_labels)
        if self.text_conditioned and self._trainer is not None and self.trainer.datamodule is not None:
            # the empty prompt's embedding: the condition drop's replacement and the default negative prompt (a
            # resumed run restores the checkpoint's own after this)
            self.model.set_null_condition(self.trainer.datamodule.null_condition())
        if lora_enabled(self.hparams.lora):  # only the adapters train and are saved; the base comes from init_from
            add_lora(self.model, **self.hparams.lora)
            self.strict_loading = False
        if self.optimizer_factory is not None:  # training keeps an EMA of the weights; sampling uses what it loaded
            self.ema = AveragedModel(self.model, multi_avg_fn=ema_update(self.hparams.ema_decay), use_buffers=True)
            self.ema.requires_grad_(False)
        shard_model = getattr(self.trainer.strategy, "shard_model", None) if self._trainer is not None else None
        if shard_model is not None:  # FSDP: the EMA is sharded like the model (its update is a per-shard lerp)
            shard_model(self.model)
            if self.ema is not None:
                shard_model(self.ema.module)
        if self.hparams.compile:  # regional compilation: one graph per block, reused by all blocks
            if isinstance(self.model, DiffusersTransformer):
                self.model.transformer.compile_repeated_blocks()
            else:
                for block in self.model.blocks:
                    block.compile()

    @property
    def text_conditioned(self) -> bool:
        """Text embeddings condition the model (data=text_latents), rather than class labels."""
        return self.hparams.data.get("conditioning") == "text"

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if lora_enabled(self.hparams.lora):  # the frozen base is init_from's: keep the adapters (and EMA count)
            checkpoint["state_dict"] = {key: value for key, value in checkpoint["state_dict"].items()
                                        if is_adapter_key(key) or key == "ema.n_averaged"}

    @property
    def tokens_per_sample(self) -> int:
        return math.prod(self.model.default_grid)  # the data's grid: the model was built for it

    # ---- training ---------------------------------------------------------------------------------------------------
    def diffusion_loss(self, model: DiT | DiffusersTransformer, x0: Tensor, condition, generators: list[torch.Generator]
                       ) -> Tensor:
        """This rank's loss for the batch (the mean squared error, + the variational bound for a DiT's learned
        variance under DDPM, normalised so that DDP's gradient average over all ranks is the one-device gradient);
        ``generators[i]`` draws sample i's time, noise and condition drop."""
        t = torch.cat([self.objective.sample_time(1, g) for g in generators]).to(x0.device)
        noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in generators]).to(x0.device, x0.dtype)
        draws = torch.cat([torch.rand(1, generator=g) for g in generators]).to(x0.device)
        x_t = self.objective.add_noise(x0, noise, t)
        if isinstance(model, DiffusersTransformer):
            # The model gathers its output (its own unpatchify needs every token), so every rank of a group holds the
            # whole prediction: its loss is the whole sample's. The gather's backward hands each rank the gradient of
            # its own tokens summed over the group's sp copies of that loss, so DDP's average over the group is again
            # the one-device gradient, and the ranks' parameter gradients stay partial sums as with the DiT.
            condition = model.drop_condition(condition, draws < model.condition_dropout_prob)
            prediction = model(x_t, self.objective.model_time(t), condition)  # (B, C, [T,] H, W)
            return (prediction.float() - self.objective.target(x0, noise, t).float()).square().mean()
        labels, dims, channels = condition, self.parallel_dims, model.in_channels
        drop = draws < model.class_dropout_prob if model.class_dropout_prob > 0 else None  # no null class: no drop
        target = model.patchify(self.objective.target(x0, noise, t))  # (B, N, patch_volume * C)

        def local(tokens: Tensor) -> Tensor:  # (B, N, P * C) -> this rank's (B, N_local, P, C)
            return shard_sequence(tokens, dims=dims).unflatten(-1, (-1, channels)).float()

        pred = model.forward_tokens(x_t, self.objective.model_time(t), labels, drop)  # (B, N_local, P * C_out)
        pred = pred.unflatten(-1, (-1, model.out_channels))  # (B, N_local, P, C or 2C)
        eps = pred[..., :channels].float()
        error = (eps - local(target)).square()  # (B, N_local, P, C)
        if model.learn_sigma and isinstance(self.objective, DDPM) and self.objective.learn_variance:
            # the original's hybrid loss: + the variational bound, which trains only the variance channels. Both
            # terms are means over a sample's elements, so adding them per element gives mse + vb.
            error = error + self.objective.vb_bits(local(model.patchify(x0)), local(model.patchify(x_t)), t, eps,
                                                   pred[..., channels:].float())
        # otherwise a learned variance gets no loss: flow matching and DDIM ignore it
        return sharded_mean(error.flatten(2), length=target.shape[1], dims=dims)

    def sample_generators(self, stream: Stream, batch: tuple[int, ...], batch_size: int) -> list[torch.Generator]:
        """One generator per local sample, keyed by ``batch`` and its position in the global batch (dp rank-major)."""
        first = self.parallel_dims.dp_rank * batch_size
        return [generator(stream, self.hparams.seed, *batch, first + i) for i in range(batch_size)]

    def training_step(self, batch, batch_idx: int) -> Tensor | None:
        x0, condition = batch  # condition: labels (B,), or a dict of text tensors
        # (step, micro-batch within gradient accumulation): the same after a resume, which starts at a step boundary
        micro_batch = batch_idx % self.trainer.accumulate_grad_batches
        generators = self.sample_generators(Stream.TRAIN, (self.trainer.global_step, micro_batch), x0.shape[0])
        loss = self.diffusion_loss(self.model, x0, condition, generators)
        # Each rank holds sp x its share: the mean over all ranks is the batch loss (averaged over replicas), and
        # every rank sees the same value, so they all take the same decision about a non-finite loss.
        batch_loss = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
        self.log("train/loss", batch_loss, prog_bar=True)
        self._step_skipped = not torch.isfinite(batch_loss)
        if self._step_skipped:
            return self._on_nonfinite_loss(batch_loss.item())
        return loss

    def _on_nonfinite_loss(self, value: float) -> None:
        step = self.trainer.global_step
        if self.hparams.nonfinite_loss == "skip":
            self.skipped_steps += 1
            rank_zero_warn(f"step {step}: the loss is {value}; skipping this step (nonfinite_loss=skip), "
                           f"{self.skipped_steps} skipped so far")
            return None
        checkpoint = getattr(self.trainer.checkpoint_callback, "last_model_path", "") or "none was saved yet"
        raise NonFiniteLossError(
            f"step {step}: the loss is {value}; training stopped before updating the weights with it. The last "
            f"checkpoint written before is kept: {checkpoint}. Lower the learning rate or clip gradients "
            f"(trainer.gradient_clip_val), or set nonfinite_loss=skip to skip such steps"
        )

    def validation_step(self, batch, batch_idx: int) -> None:
        x0, condition = batch
        generators = self.sample_generators(Stream.VALIDATION, (batch_idx,), x0.shape[0])
        loss = self.diffusion_loss(self.sampling_model(), x0, condition, generators)
        self.log("val/loss", loss, sync_dist=True, batch_size=x0.shape[0])

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        self._step_start = time.perf_counter()

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        # Here, not in on_train_batch_end: callbacks (checkpoints) see the step before this module's batch-end hook.
        if not self._step_skipped:
            self.ema.update_parameters(self.model)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        seconds = time.perf_counter() - self._step_start
        samples = batch[0].shape[0] * self.parallel_dims.dp_degree
        self.log_dict({"train/samples_per_sec": samples / seconds,
                       "train/tokens_per_sec": samples * self.tokens_per_sample / seconds})

    def on_before_optimizer_step(self, optimizer) -> None:
        norm = total_grad_norm(self.model)
        if norm is not None:
            self.log("train/grad_norm", norm)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self.hparams.get("resume_optimizer", True):
            return
        # resume_optimizer=false: Lightning loads zip(optimizers, states), so no states leaves the configured
        # optimizer fresh. Schedulers keep their position (the step) but not the old optimizer's base learning rates.
        checkpoint["optimizer_states"] = []
        for state in checkpoint.get("lr_schedulers", []):
            state.pop("base_lrs", None)
            state.pop("_last_lr", None)
        self._fresh_optimizer = True

    def on_train_start(self) -> None:
        if self._fresh_optimizer:  # the fresh optimizer holds the schedule's first lr: set the resumed step's
            for config in self.trainer.lr_scheduler_configs:
                config.scheduler.last_epoch -= 1
                config.scheduler.step()

    def configure_optimizers(self):
        if self.optimizer_factory is None:
            raise ValueError("DiTModule needs an optimizer (a partial, e.g. torch.optim.AdamW) to train")
        optimizer = self.optimizer_factory(params=[p for p in self.model.parameters() if p.requires_grad])
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer=optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- sampling ---------------------------------------------------------------------------------------------------
    @property
    def samples_are_pixels(self) -> bool:
        """Pixels live in [-1, 1] and become images; latents (data=latents) are kept as numbers for your VAE."""
        return "latent_scale" not in self.hparams.data

    def sampling_model(self, use_ema: bool = True) -> DiT:
        """The EMA weights while training (the ones worth sampling), else the loaded weights."""
        return self.ema.module if use_ema and self.ema is not None else self.model

    @torch.no_grad()
    def generate(self, condition, seeds: list[int], *, use_ema: bool = True, negative: dict | None = None,
                 **overrides: Any) -> Tensor:
        """Samples ``(N, C, [T,] H, W)`` for ``condition`` -- labels ``(N,)``, or a dict of text tensors ``(N, ...)``
        -- sample i from noise seeded by seeds[i] (a ``ringdit.seeding.seed_of`` value); pixels come in [-1, 1].
        ``negative``: the negative prompt's conditioning for guidance (text models; default the empty prompt's).

        Collective under sequence parallelism: every rank of the group must call it with the same arguments.
        """
        settings = {**self.sampling, **{k: v for k, v in overrides.items() if v is not None}}
        model = self.sampling_model(use_ema)
        generators = noise_generators(seeds)  # sample i's noise: its initial noise, then the ddpm sampler's
        noise = draw_noise((model.in_channels, *self.hparams.data["image_size"]), generators, device=self.device)
        guided = settings["cfg_scale"] != 1.0
        if isinstance(model, DiffusersTransformer):
            keys = model.family.condition_keys  # what the model reads (the data may carry more, e.g. a text mask)
            condition = {key: condition[key].to(self.device) for key in keys}
            if settings.get("guidance") is not None:  # a guidance-distilled model's guidance value for sampling
                condition["guidance"] = torch.full((len(seeds),), float(settings["guidance"]), device=self.device)
            null = {key: (negative or model.null_condition(len(seeds)))[key].to(self.device) for key in keys} \
                if guided else None
            denoiser = model
        else:
            condition = condition.to(self.device)
            null = model.y_embedder.null_label if guided else None
            denoiser = model  # with learn_sigma (B, 2C, ...): the samplers take the channels they use
        dims = self.parallel_dims
        split = guided and dims.cfg_group is not None  # CFG parallel: the halves on two data-parallel replicas
        samples = sample(
            denoiser, self.objective, noise, condition, steps=settings["steps"], cfg_scale=settings["cfg_scale"],
            null=null, sampler=settings["sampler"], shift=settings["shift"], clip_denoised=self.samples_are_pixels,
            exchange=partial(exchange_guidance_halves, dims=dims) if split else None, half=dims.cfg_rank,
            guidance_channels=settings.get("guidance_channels"), generators=generators,
        )
        return samples.clamp(-1, 1) if self.samples_are_pixels else samples

    def predict_step(self, batch, batch_idx: int) -> dict:
        indices, condition, seeds = batch
        samples = self.generate(condition, seeds.tolist(), negative=self.negative_condition)
        described = {"index": indices} if self.text_conditioned else {"index": indices, "labels": condition}
        if self.samples_are_pixels:
            return {**described, "images": to_uint8(samples)}
        # back to the VAE's own scale (data.scale multiplied it in): ready to decode
        return {**described, "latents": samples.float() / self.hparams.data["latent_scale"]}
