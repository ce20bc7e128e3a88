"""Callbacks: checkpoints that always include the final step, and preview sample grids during training."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_warn
from omegaconf import OmegaConf

from ringdit.checkpoints.weights import read_weights
from ringdit.images import grid_image, save_samples, to_uint8
from ringdit.lora import adapter_state, load_adapter, load_null_condition
from ringdit.media.writing import write_mp4
from ringdit.errors import require_count
from ringdit.sampling import SampleSizes, patch_shape, size_pair
from ringdit.seeding import Stream, seed_of

SETTING = "callbacks.sample_grid"


class StepCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, plus ``last.ckpt`` at the end of training when the final step fell between two
    periodic saves (Lightning writes it at the end only if nothing was saved before), and the checkpoint of a step
    whose end-of-step hooks failed: Lightning runs checkpoint callbacks after all others, so an error in another
    callback (a preview grid, a logger) would otherwise cost the step's checkpoint."""

    _step_before_batch = -1

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx) -> None:
        self._step_before_batch = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._step_before_batch = trainer.global_step  # this step's saving is done

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if self.save_last and getattr(self, "_last_global_step_saved", -1) != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        step = trainer.global_step
        if self._step_before_batch < 0 or step == self._step_before_batch or self._last_global_step_saved == step:
            return  # the error came before this batch's optimizer step (e.g. in training_step), or it was saved
        # The optimizer step (and the EMA update) completed; an end-of-step hook before this callback raised.
        # Only this rank may have failed, so no barrier: global rank 0 writes, as Lightning's DDP saving does.
        candidates = self._monitor_candidates(trainer)
        paths = [self.format_checkpoint_name(candidates, self.CHECKPOINT_NAME_LAST)] if self.save_last else []
        if self._every_n_train_steps and step % self._every_n_train_steps == 0 or not paths:
            paths.insert(0, self.format_checkpoint_name(candidates))
        self.last_model_path, self._last_global_step_saved = paths[-1], step
        try:
            if trainer.is_global_zero:
                checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
                for path in paths:
                    trainer.strategy.save_checkpoint(checkpoint, path)
                rank_zero_warn(f"step {step} ended with an error ({type(exception).__name__}) after its update; its "
                               f"checkpoint was saved all the same: {paths[-1]}")
        except Exception as error:  # noqa: BLE001 - never hide the error that ended the run behind this one
            rank_zero_warn(f"could not save the checkpoint of step {step} after the error: {error}")


class SampleGrid(L.Callback):
    """Every ``every_n_steps`` optimizer steps (and at the end), sample a grid with the EMA weights through the
    same sharded model, save it under ``<output_dir>/samples/`` and log it to wandb / TensorBoard.

    All ranks sample (the model is sharded across them); only global rank 0 writes. One row per class
    (up to ``max_classes``; text models: per held-out prompt), ``per_class`` samples each, from fixed seeds so grids
    are comparable across steps. Models trained on latents are previewed through their VAE (``vae``, else the one
    the data was prepared with, when that folder is here), each sample's tiles decoded over the ranks that sampled
    it, as infer.py decodes. Loggers get images as images and videos as MP4 videos (``samples/step_N/``), each
    captioned with its prompt or class.

    ``size`` ``[H, W]`` / ``frames`` (videos): the grid's sample shape, in the units of infer.py's ``size`` /
    ``frames`` (``ringdit.sampling.SampleSizes``: pixels and video frames when the data records its VAE, else the
    data's cells); None: the data's ``image_size``, its most frequent bucket. Their form is checked when the callback
    is built (train.py: before any rank starts), against the data and the model's patch by ``check_shape`` (at the
    latest when training starts).
    """

    def __init__(self, output_dir: str, every_n_steps: int = 500, per_class: int = 8, max_classes: int = 10,
                 steps: int | None = None, cfg_scale: float | None = None, seed: int = 0,
                 size: list[int] | None = None, frames: int | None = None, vae: str | None = None,
                 vae_subfolder: str | None = "vae", fps: int = 16):
        require_count("callbacks.sample_grid.every_n_steps", every_n_steps)
        require_count(f"{SETTING}.fps", fps)
        self.vae_setting, self.vae_subfolder, self.fps = vae, vae_subfolder, fps
        self._codec = None  # the VAE, loaded at the first preview of a latent model (None: no VAE here)
        self.output_dir = Path(output_dir)
        self.every_n_steps, self.per_class, self.max_classes = every_n_steps, per_class, max_classes
        self.steps, self.cfg_scale, self.seed = steps, cfg_scale, seed
        size = OmegaConf.to_container(size) if OmegaConf.is_config(size) else size
        self.size = size_pair(size, f"{SETTING}.size", "(null: the data's image_size)") if size is not None else None
        require_count(f"{SETTING}.frames", frames, optional=True, hint="video frames (null: the data's)")
        self.frames = frames
        self.shape: tuple[int, ...] | None = None  # the grid's sample shape in the data's cells; None: image_size
        self._last_step = -1

    def check_shape(self, data_info: dict, patch: tuple[int, ...]) -> tuple[int, ...] | None:
        """``size`` / ``frames`` as the sample shape of this data (its ``describe()``) for a model of ``patch``, kept
        for the grids; a ``ConfigError`` naming the setting if the model cannot sample it. None: image_size."""
        if self.size is None and self.frames is None:
            self.shape = None
        else:
            self.shape = SampleSizes.of(data_info, patch).shape(self.size, self.frames,
                                                                names=(f"{SETTING}.size", f"{SETTING}.frames"))
        return self.shape

    def on_fit_start(self, trainer, pl_module) -> None:
        self.check_shape(pl_module.hparams.data, patch_shape(pl_module.model))  # before the first step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every_n_steps == 0 and step != self._last_step:
            self.make_grid(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step != self._last_step:
            self.make_grid(trainer, pl_module)

    def make_grid(self, trainer: L.Trainer, pl_module) -> Path | None:
        self._last_step = step = trainer.global_step
        if not pl_module.samples_are_pixels and self.preview_vae(pl_module.hparams.data) is None:
            return None  # latents without their VAE cannot be looked at (said once, by preview_vae)
        if pl_module.text_conditioned:  # one row per held-out prompt (the same prompts at every step)
            prompts, names = trainer.datamodule.held_out(self.max_classes)
            condition = {key: value.repeat_interleave(self.per_class, 0) for key, value in prompts.items()}
            count = len(condition["text"])
        else:
            classes = min(pl_module.hparams.data["num_classes"], self.max_classes)
            condition = torch.arange(classes).repeat_interleave(self.per_class)
            names = list(pl_module.hparams.data.get("class_names") or range(classes))[:classes]
            count = len(condition)
        captions = [str(name) for name in names for _ in range(self.per_class)]
        seeds = [seed_of(Stream.PREVIEW, self.seed, cell) for cell in range(count)]
        samples = pl_module.generate(condition, seeds, steps=self.steps, cfg_scale=self.cfg_scale, shape=self.shape)
        if pl_module.samples_are_pixels:
            images = to_uint8(samples).numpy() if trainer.is_global_zero else None
        else:  # every rank decodes its share of each sample's tiles; rank 0 gets the pixels
            images = self.decode(samples, pl_module.hparams.data, trainer)
        if not trainer.is_global_zero:
            return None
        folder = self.output_dir / "samples"
        path = save_samples(images, folder / f"step_{step:07d}", columns=self.per_class)
        videos = []
        if images.ndim == 5:  # (N, T, H, W, C): each one an MP4 too, which the loggers upload
            (folder / f"step_{step:07d}").mkdir(parents=True, exist_ok=True)
            videos = [write_mp4(video, folder / f"step_{step:07d}" / f"{i:03d}.mp4", self.fps)
                      for i, video in enumerate(images)]
        log_samples(trainer.loggers, images, captions, step, videos=videos, columns=self.per_class)
        return path

    def preview_vae(self, data_info: dict):
        """The VAE latent previews decode with (``vae``, else the data's when its folder is here), loaded once;
        None, said once, where there is none."""
        if self._codec is None:
            from ringdit.media.decode import sampling_vae
            from ringdit.media.vae import VAE

            folder = sampling_vae(self.vae_setting, self.vae_subfolder, data_info)
            if folder is None:
                rank_zero_warn(f"{SETTING}: no previews: the model samples latents and the VAE the data was prepared "
                               f"with ({(data_info.get('vae') or {}).get('path')}) is not here; set "
                               f"{SETTING}.vae=<the VAE folder> to see them")
                self._codec = False
            else:
                device = "cuda" if torch.cuda.is_available() else "cpu"
                self._codec = VAE(folder, self.vae_subfolder, device=device)
        return self._codec or None

    def decode(self, latents: torch.Tensor, data_info: dict, trainer: L.Trainer):
        """(N, C, [T,] H, W) latents -> uint8 pixels on global rank 0 (None elsewhere), each sample's VAE tiles
        decoded over every rank (``ringdit.media.parallel_vae``): they all sampled the same latents."""
        import torch.distributed as dist

        from ringdit.media.decode import decode_latents, latents_normalised

        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() and trainer.world_size > 1 else None
        return decode_latents(latents.float().cpu(), self.preview_vae(data_info), latents_normalised(data_info),
                              group=group)


def log_samples(loggers, images, captions: list[str], step: int | None, *, videos: list[Path] = (),
                columns: int | None = None, key: str = "samples") -> None:
    """To wandb: images (N, H, W, C) one by one (upscaled RGB, as the grid shows them), videos as the MP4 files
    ``videos`` (wandb uploads the files themselves), each with its caption; to TensorBoard: the grid (for videos,
    its first frame: TensorBoard's own video encoder needs moviepy)."""
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            if len(videos):
                logger.log_video(key=key, videos=[str(v) for v in videos], step=step, caption=list(captions),
                                 format=["mp4"] * len(videos))
            else:
                logger.log_image(key=key, images=[grid_image(image[None], 1) for image in images], step=step,
                                 caption=list(captions))
        elif isinstance(logger, TensorBoardLogger):
            logger.experiment.add_image(key, grid_image(images, columns), step, dataformats="HWC")


class LoadLoraAdapter(L.Callback):
    """Loads a LoRA checkpoint's adapters (``weights``: EMA or raw) into the module's model when prediction starts:
    by then the model is built on its base and adapted (``configure_model``), and sharded under FSDP -- each rank
    keeps its shard -- and the empty prompt's embedding the run trained with (the base's null condition is not it). The
    checkpoint holds nothing else, so Lightning's own loading has nothing to do with it."""

    def __init__(self, ckpt_path: str, weights: str):
        self.ckpt_path, self.weights = ckpt_path, weights

    def on_predict_start(self, trainer: L.Trainer, pl_module) -> None:
        state, _ = read_weights(self.ckpt_path, prefer=self.weights)
        load_adapter(pl_module.model, adapter_state(state))
        if not load_null_condition(pl_module.model, state) and trainer.is_global_zero:
            rank_zero_warn(f"{self.ckpt_path} holds no empty-prompt embedding (written before LoRA checkpoints kept "
                           f"it): guidance steers away from the base's, not the training data's; give the negative "
                           f"prompt to steer from with negative_prompt= or negative_text_embeds=")
