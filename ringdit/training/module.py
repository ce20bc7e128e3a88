"""``DiffusionModule``: the LightningModule that fine-tunes a (sequence-parallel) diffusion transformer -- ringdit's
class-conditional DiT, or a text-conditioned diffusers transformer (``DiffusersTransformer``: Wan, ...). It only
trains: sampling is a ``ringdit.sampling.Sampler``'s (the preview grids make one of this module's model with its EMA's
weights, ``ema_weights``; infer.py and the server sample in ``ringdit.sampling.predict.SamplingModule``).
Every model kind is built by ``ringdit.models.build.build_model`` and trained by the same code: the models share
one conditioning interface (``drop_condition``, ``null_condition``, ``model_condition``) and all return their whole
prediction, gathered over the sequence-parallel group.

Randomness that must agree across a sequence-parallel group -- diffusion time, noise, which labels are dropped for
classifier-free guidance -- is drawn per sample from the ``ringdit.common.seeding`` streams TRAIN and VALIDATION, keyed by
the sample's position in the global batch: every rank of a group draws the same values, a resumed run draws what the
uninterrupted run would have, and how the global batch is split over data-parallel replicas changes nothing.

(Over 300 lines because it holds Lightning's whole life cycle of one run -- build, train step, non-finite losses,
EMA, resume -- whose hooks share state; each part is a few short methods.)
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable

import hydra
import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from ringdit.data.text_latents import MASK_KEY
from ringdit.models.build import BuildPlan
from ringdit.checkpoints.loading import safe_torch_load
from ringdit.diffusion import DDPM, draw_noise
from ringdit.diffusion.experts import step_expert, time_range
from ringdit.models.ema import ModelAverage
from ringdit.common.errors import NonFiniteLossError
from ringdit.models.lora import is_adapter_key, lora_enabled, null_condition_names
from ringdit.models.conditioning import text_conditioned
from ringdit.parallel import ParallelDims
from ringdit.diffusion.model_guidance import draw_scales, guided_target
from ringdit.common.safe_config import check_file_configs
from ringdit.common.seeding import Stream, generator

Tensor = torch.Tensor


def total_grad_norm(model: torch.nn.Module) -> Tensor | None:
    """The 2-norm of all gradients together; under FSDP (gradients sharded as DTensors) the norm of the full ones."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return None
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


class DiffusionModule(L.LightningModule):
    """Trains ``model`` (a DiT config with ``_target_``) with ``objective`` (FlowMatching / DDPM config).

    ``sampling``: the run's sampling settings (``steps``, ``cfg_scale``, ``sampler``, ``shift``, ``guidance_channels``),
    kept in the checkpoint for the preview grids' and infer.py's ``Sampler``; this module does not sample.
    ``data``: what the data module describes (channels, image_size, num_classes, class_names).
    ``expert``: which expert of a two-expert model trains: ``high``, ``low`` or ``both`` (None: both).
    ``model_guidance``: (low, high) -- train a guidance-scale input toward the guided target
    (``ringdit.diffusion.model_guidance``); None: the plain target.
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
        expert: str | None = None,
        model_guidance: tuple[float, float] | None = None,
    ):
        super().__init__()
        self.skipped_steps = 0
        self._step_skipped = False
        self._fresh_optimizer = False
        self._ema_applied = False
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.objective = hydra.utils.instantiate(objective)
        self.model: nn.Module | None = None  # built in configure_model
        self.ema: ModelAverage | None = None
        self._step_start: float | None = None

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, *args, **kwargs):
        """Lightning's, after checking the configs the file carries: Lightning builds the module from them, and the
        module instantiates its model and objective configs (see ``ringdit.common.safe_config``)."""
        checkpoint = safe_torch_load(checkpoint_path, mmap=True)
        check_file_configs(str(checkpoint_path), checkpoint.get("hyper_parameters", {}) if isinstance(checkpoint, dict)
                           else {})
        if kwargs.get("hparams_file") is not None:
            from omegaconf import OmegaConf

            config = OmegaConf.to_container(OmegaConf.load(kwargs["hparams_file"]), resolve=False)
            check_file_configs(str(kwargs["hparams_file"]), config if isinstance(config, dict) else {"": config})
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    # ---- model ----------------------------------------------------------------------------------------------------
    @property
    def parallel_dims(self) -> ParallelDims:
        """This rank's place in the mesh the strategy built (one process without a ringdit strategy). Read from the
        strategy, not handed in: the strategy builds the mesh in each spawned rank, after this module was made."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        return getattr(strategy, "parallel_dims", None) or ParallelDims()

    @classmethod
    def from_spec(cls, spec, **keywords) -> DiffusionModule:
        """The module of a checked run (``ringdit.spec.TrainSpec``): its build plan, objective, data, sampling,
        optimizer and the rest, recorded as the hyper-parameters a checkpoint rebuilds it from."""
        plan = spec.build_plan
        return cls(model=plan.config, objective=spec.objective, data=spec.data.info, sampling=spec.sampling,
                   optimizer=spec.optimizer.optimizer_factory(), scheduler=spec.optimizer.scheduler_factory(),
                   ema_decay=plan.ema_decay, seed=plan.seed, attention_backend=plan.backend, compile=plan.compile,
                   init_from=plan.init_from, init_weights=plan.init_weights, init_resize_labels=plan.resize_labels,
                   nonfinite_loss=spec.nonfinite_loss, lora=plan.lora,
                   resume_optimizer=spec.checkpoint.resume_optimizer, expert=plan.expert,
                   model_guidance=spec.model_guidance, **keywords)

    @property
    def build_plan(self) -> BuildPlan:
        """What the model is built from: the hyper-parameters (the spec's ``build_plan``, or what a checkpoint
        recorded); without an optimizer the weights stay as loaded (no expert choice, no EMA)."""
        hparams, training = self.hparams, self.optimizer_factory is not None
        return BuildPlan(hparams.model, backend=hparams.attention_backend, init_from=hparams.init_from,
                         init_weights=hparams.init_weights, resize_labels=hparams.init_resize_labels,
                         lora=hparams.lora if lora_enabled(hparams.lora) else None,
                         expert=hparams.get("expert") if training else None,
                         ema_decay=hparams.ema_decay if training else None, compile=hparams.compile,
                         seed=hparams.seed)

    def rank_build(self) -> dict:
        """``BuildPlan.build``'s keywords only the ranks know: the mesh, the strategy's sharding and offload (its
        layout's), the data's empty-prompt embedding."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        return {"dims": self.parallel_dims, "shard": getattr(strategy, "shard_model", None),
                "offload_shards": getattr(strategy, "cpu_offload", False),
                "null_condition": datamodule.null_condition() if self.text_conditioned and datamodule is not None
                else None}

    def configure_model(self) -> None:
        """Built here, not in __init__: the mesh exists only once the strategy set it up, and the model is
        parallelized over it as it is built (``ringdit.models.build.build_model``: the order of every step is there)."""
        if self.model is not None:
            return
        # a resumed run restores the checkpoint's own empty-prompt embedding after this
        self.model, self.ema = self.build_plan.build(**self.rank_build())
        if lora_enabled(self.hparams.lora):  # checkpoints hold only the adapters: the base comes from init_from
            self.strict_loading = False

    @property
    def text_conditioned(self) -> bool:
        """Text embeddings condition the model (data=text_latents), rather than class labels."""
        return text_conditioned(self.hparams.data)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if lora_enabled(self.hparams.lora):  # the frozen base is init_from's: keep the adapters (and EMA count), and
            # the empty prompt's embedding from the data, which guidance steers away from (the base's is not it)
            nulls = {prefix + name for name in null_condition_names(self.model) for prefix in ("model.", "ema.module.")}
            checkpoint["state_dict"] = {key: value for key, value in checkpoint["state_dict"].items()
                                        if is_adapter_key(key) or key == "ema.n_averaged" or key in nulls}

    def sequence_tokens(self, shape: tuple[int, ...] | None = None, model: nn.Module | None = None) -> int:
        """Model tokens of one sample of ``shape`` ``([T,] H, W)`` (a bucket's; default the data's image_size) for
        ``model`` (default this module's)."""
        shape = tuple(self.hparams.data["image_size"]) if shape is None else tuple(shape)
        return math.prod(s // p for s, p in zip(shape, (model or self.model).patch_shape))

    # ---- training ---------------------------------------------------------------------------------------------------
    def batch_expert(self, model: nn.Module, x0: Tensor, draw: torch.Generator) -> str | None:
        """The expert of a two-expert model that this batch trains (``draw``: a generator every rank shares, for
        ``diffusion.expert=both``); None for one transformer."""
        if not model.experts:
            return None
        tokens = self.sequence_tokens(x0.shape[2:], model)
        return step_expert(self.hparams.get("expert") or "both", model.boundary_ratio, self.objective, tokens, draw)

    def diffusion_loss(self, model: nn.Module, x0: Tensor, condition, generators: list[torch.Generator],
                       expert: str | None = None, mask: Tensor | None = None) -> Tensor:
        """This rank's loss for the batch: the mean squared error (+ the variational bound for a learned variance under
        DDPM) over the whole prediction; ``generators[i]`` draws sample i's time, noise and condition drop;
        ``expert``: the expert of a two-expert model that runs, on times from its own range (``batch_expert``);
        ``mask``: (B, 1, [T,] H, W) weights of the latent cells (the data's ``loss_mask``), each cell's squared error
        times its weight before the mean (diffusion-pipe's masked loss: a masked-out cell counts as a zero error).

        Every model gathers its prediction, so every rank of a sequence-parallel group holds the whole sample's loss.
        The gather's backward hands each rank the gradient of its own tokens summed over the group's sp copies of
        that loss, so DDP's gradient average over all ranks is the one-device gradient (the ranks' parameter
        gradients are partial sums: ``ringdit.parallel.collectives``)."""
        tokens = self.sequence_tokens(x0.shape[2:], model)  # this batch's bucket (Flux's shift=resolution follows)
        within = time_range(expert, model.boundary_ratio) if expert else None
        t = torch.cat([self.objective.sample_time(1, g, tokens, within) for g in generators]).to(x0.device)
        noise = draw_noise(x0.shape[1:], generators, x0.device, x0.dtype)  # float32 draws: the same in any precision
        draws = torch.cat([torch.rand(1, generator=g, dtype=torch.float32) for g in generators]).to(x0.device)
        x_t = self.objective.add_noise(x0, noise, t)
        if model.condition_dropout_prob > 0:  # no null condition, no drop
            condition = model.drop_condition(condition, draws < model.condition_dropout_prob)
        # latents denoised with x (LTX-2's audio): noised at the sample's time, their noise drawn after x's draws
        joint = {key: condition[key] for key in model.joint_latents if key in condition}
        joint_noise = {key: draw_noise(value.shape[1:], generators, x0.device, value.dtype)
                       for key, value in joint.items()}
        if joint:
            condition = {**condition, **{key: self.objective.add_noise(value, joint_noise[key], t)
                                         for key, value in joint.items()}}
        run = {"expert": expert} if expert else {}  # a two-expert model runs the one the times were drawn for
        scales = draw_scales(generators, *self.hparams.model_guidance, x0.device) \
            if self.hparams.get("model_guidance") else None  # (B,) drawn after the sample's other draws
        fed = {} if scales is None else {"guidance": scales}
        prediction = model(x_t, self.objective.model_time(t), condition, **run, **fed)  # (B, C or 2C, [T,] H, W)
        if joint:  # and each joint latent's own prediction
            prediction, joint_predictions = prediction
        channels = x0.shape[1]
        eps = prediction[:, :channels].float()
        target = self.objective.target(x0, noise, t).float()  # (B, C, [T,] H, W)
        if scales is not None:  # diffusion.model_guidance: + (w - 1) (v(c) - v(null)) of the model itself, no gradient
            target = guided_target(model, target, x_t, self.objective.model_time(t), condition, scales, run)
        error = (eps - target).square()  # (B, C, [T,] H, W)
        if prediction.shape[1] > channels and isinstance(self.objective, DDPM) and self.objective.learn_variance:
            # the original's hybrid loss: + the variational bound, which trains only the variance channels. Both
            # terms are means over a sample's elements, so adding them per element gives mse + vb.
            error = error + self.objective.vb_bits(x0.float(), x_t.float(), t, eps, prediction[:, channels:].float())
        # otherwise a learned variance gets no loss: flow matching and DDIM ignore it
        time_weights = getattr(self.objective, "loss_weight", lambda t, tokens: None)(t, tokens)
        if time_weights is not None:  # diffusion.objective.loss_weighting: each sample's loss times its time's weight
            error = error * time_weights.to(error.dtype).reshape(-1, *[1] * (error.dim() - 1))
        if mask is not None:
            error = error * mask.to(error)
        weights = model.loss_weights(x0)
        if weights is not None:  # image-to-video with a given first frame: the mean over the frames that were noised
            loss = (error * weights).sum() / weights.expand_as(error).sum()
        else:
            loss = error.mean()
        for key, value in joint.items():  # + each joint latent's own mean squared error, time-weighted alike
            joint_error = (joint_predictions[key].float()
                           - self.objective.target(value, joint_noise[key], t).float()).square()
            if time_weights is not None:
                joint_error = joint_error * time_weights.to(joint_error).reshape(-1, *[1] * (joint_error.dim() - 1))
            loss = loss + joint_error.mean()
        return loss

    def batch_generators(self, stream: Stream, batch: tuple[int, ...], batch_size: int) -> list[torch.Generator]:
        """One generator per local sample, keyed by ``batch`` and its position in the global batch (dp rank-major)."""
        first = self.parallel_dims.dp_rank * batch_size
        return [generator(stream, self.hparams.seed, *batch, first + i) for i in range(batch_size)]

    def training_step(self, batch, batch_idx: int) -> Tensor | None:
        x0, condition = batch  # condition: labels (B,), or a dict of text tensors
        # (step, micro-batch within gradient accumulation): the same after a resume, which starts at a step boundary
        micro_batch = batch_idx % self.trainer.accumulate_grad_batches
        key = (self.trainer.global_step, micro_batch)
        generators = self.batch_generators(Stream.TRAIN, key, x0.shape[0])
        expert = self.batch_expert(self.model, x0, generator(Stream.EXPERT, self.hparams.seed, *key))
        loss = self.diffusion_loss(self.model, x0, condition, generators, expert, loss_mask(condition))
        # The mean over all ranks is the batch loss (averaged over replicas), and every rank sees the same value, so
        # they all take the same decision about a non-finite loss.
        batch_loss = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
        self.log("train/loss", batch_loss, prog_bar=True)
        if expert is not None:  # the experts' losses differ in scale (their noise levels): each its own curve
            self.log(f"train/loss_{expert}", batch_loss)
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
        generators = self.batch_generators(Stream.VALIDATION, (batch_idx,), x0.shape[0])
        with self.ema_weights() as model:
            expert = self.batch_expert(model, x0, generator(Stream.EXPERT, self.hparams.seed, batch_idx))
            loss = self.diffusion_loss(model, x0, condition, generators, expert, loss_mask(condition))
        self.log("val/loss", loss, sync_dist=True, batch_size=x0.shape[0])
        if len(self.hparams.data.get("buckets", ())) > 1:  # and per bucket: a shape the model fits worse shows
            self.log(f"val/loss_{'x'.join(map(str, x0.shape[2:]))}", loss, sync_dist=True, batch_size=x0.shape[0])

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        self._step_start = time.perf_counter()

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        # Here, not in on_train_batch_end: callbacks (checkpoints) see the step before this module's batch-end hook.
        if not self._step_skipped and self.ema is not None:
            self.ema.update_parameters(self.model)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        seconds = time.perf_counter() - self._step_start
        samples, tokens = batch[0].shape[0] * self.parallel_dims.dp_degree, self.sequence_tokens(batch[0].shape[2:])
        self.log_dict({"train/samples_per_sec": samples / seconds, "train/tokens_per_sec": samples * tokens / seconds,
                       "train/sample_tokens": float(tokens)})  # this step's bucket: its own token count

    def on_before_optimizer_step(self, optimizer) -> None:
        norm = total_grad_norm(self.model)
        if norm is not None:
            self.log("train/grad_norm", norm)

    @contextlib.contextmanager
    def ema_weights(self, use_ema: bool = True):
        """The model, holding the EMA's weights inside the block (validation's, and what the preview grids' ``Sampler``
        samples) when there is an EMA and ``use_ema``, else its own; re-entrant (a preview inside validation swaps
        once)."""
        # compile=true compiles the training step's graphs; previews and validation run eager (their batch sizes and
        # no-grad mode would recompile every block's graphs once more each)
        eager = torch.compiler.set_stance("force_eager") if self.hparams.compile else contextlib.nullcontext()
        if not use_ema or self.ema is None or self._ema_applied:
            with eager:
                yield self.model
            return
        self._ema_applied = True
        try:
            with eager, self.ema.applied_to(self.model) as model:
                yield model
        finally:
            self._ema_applied = False

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self.ema is None and self.model is not None and "ema.n_averaged" in checkpoint.get("state_dict", {}):
            # a training checkpoint loaded to sample (load_from_checkpoint): keep its EMA, the weights worth sampling
            self.ema = ModelAverage(self.model, self.hparams.ema_decay)
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
            raise ValueError("DiffusionModule needs an optimizer (a partial, e.g. torch.optim.AdamW) to train")
        optimizer = self.optimizer_factory(params=[p for p in self.model.parameters() if p.requires_grad])
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer=optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loss_mask(condition) -> Tensor | None:
    """The batch's loss mask (B, 1, [T,] H, W): the data's ``loss_mask`` (prepare's mask_path=), None without."""
    return condition.get(MASK_KEY) if isinstance(condition, dict) else None


def __getattr__(name: str):
    if name == "DiTModule":  # its name until 2026-12, for code that loads checkpoints with it
        import warnings

        warnings.warn("DiTModule is now DiffusionModule (it trains every model kind); the old name will go",
                      DeprecationWarning, stacklevel=2)
        return DiffusionModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
