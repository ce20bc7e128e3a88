"""Callbacks: checkpoints that always include the final step, and preview sample grids during training."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_warn
from omegaconf import OmegaConf

from ringdit.checkpoints.weights import read_weights
from ringdit.media.audio import AudioDecoder, sampling_audio_vae
from ringdit.media.decode import sampling_vae
from ringdit.media.images import grid_image, save_samples
from ringdit.media.text import data_text_encoder
from ringdit.media.vae import VAE
from ringdit.models.lora import adapter_state, load_adapter, load_null_condition
from ringdit.diffusion.pipeline import in_micro_batches
from ringdit.common.errors import ConfigError, require_count, require_number, require_seed
from ringdit.models.conditioning import AUDIO_KEY, CONTROL_KEY, text_conditioned
from ringdit.sampling import (FPS_HINT, Codecs, PromptLine, Sampler, SampleSizes, frame_rate, patch_shape,
                              read_prompt_file, size_pair)
from ringdit.sampling.writer import write_sample
from ringdit.common.seeding import Stream, seed_of

SETTING = "callbacks.sample_grid"
# a preview prompt file's keys beyond infer.py's (musubi-tuner's sample prompts' --d --s --l --g): the line's seed,
# sampling steps, classifier-free guidance scale and a guidance-distilled model's embedded guidance
PROMPT_OPTIONS = ("seed", "steps", "cfg_scale", "guidance")
BATCH_HINT = "samples per forward (twice that with guidance); null: all of a row at once"


def read_preview_prompts(path) -> list[PromptLine]:
    """``callbacks.sample_grid.prompt_file``: infer.py's prompt file (``read_prompt_file``) with ``PROMPT_OPTIONS``
    per line, each checked here: a mistake is one ConfigError naming the file, the line and the key."""
    lines = read_prompt_file(path, f"{SETTING}.prompt_file", PROMPT_OPTIONS)
    for line in lines:
        name = line.where.removesuffix(": ") + " "
        if "seed" in line.options:
            require_seed(name + '"seed"', line.options["seed"])
        require_count(name + '"steps"', line.options.get("steps"), optional=True)
        for key in ("cfg_scale", "guidance"):
            require_number(f'{name}"{key}"', line.options.get(key), optional=True)
    return lines


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
    captioned with its prompt or class; a model that samples sound with its video (LTX-2) gets it as the MP4s' AAC
    track, decoded with ``audio_vae`` (its audio VAE and vocoder folder; None: the one the data was prepared with,
    when that folder is here, else the videos are silent).

    ``size`` ``[H, W]`` / ``frames`` (videos): the grid's sample shape, in the units of infer.py's ``size`` /
    ``frames`` (``ringdit.sampling.SampleSizes``: pixels and video frames when the data records its VAE, else the
    data's cells); None: the data's ``image_size``, its most frequent bucket. Their form is checked when the callback
    is built (train.py: before any rank starts), against the data and the model's patch by ``check_shape`` (at the
    latest when training starts).

    ``prompt_file`` (text models): the prompts to preview instead of the held-out ones, one row each, as infer.py's
    ``prompt_file`` (``{"prompt": ..., "size": [H, W], "frames": N, "negative_prompt": ...}``) plus ``seed``,
    ``steps``, ``cfg_scale`` and ``guidance`` per line; encoded once, when training starts, with the text encoder the
    data was prepared with. ``batch_size``: samples per forward (None: a row at once), so that a preview's memory is
    one micro-batch's whatever the count: the samples are the same (each one's noise comes from its own seed).
    ``fps``: the videos' frame rate (None: the model's own, ``DiffusionModel.frame_rate``).
    """

    def __init__(self, output_dir: str, every_n_steps: int = 500, per_class: int = 8, max_classes: int = 10,
                 steps: int | None = None, cfg_scale: float | None = None, seed: int = 0,
                 size: list[int] | None = None, frames: int | None = None, vae: str | None = None,
                 vae_subfolder: str | None = "vae", fps: int | None = None, prompt_file: str | None = None,
                 batch_size: int | None = None, audio_vae: str | None = None,
                 audio_vae_subfolder: str | None = "audio_vae", vocoder_subfolder: str = "vocoder"):
        require_count("callbacks.sample_grid.every_n_steps", every_n_steps)
        for key, value in (("per_class", per_class), ("max_classes", max_classes)):
            require_count(f"{SETTING}.{key}", value)
        require_count(f"{SETTING}.fps", fps, optional=True, hint=FPS_HINT)
        require_count(f"{SETTING}.batch_size", batch_size, optional=True, hint=BATCH_HINT)
        self.vae_setting, self.vae_subfolder, self.fps, self.batch_size = vae, vae_subfolder, fps, batch_size
        self.audio_setting = (audio_vae, audio_vae_subfolder, vocoder_subfolder)
        self._audio = None  # the audio decoder, loaded at the first preview of a model that samples sound
        self.prompt_file = prompt_file
        self.lines = read_preview_prompts(prompt_file) if prompt_file else None
        self.line_shapes: list = []  # each prompt line's sample shape in the data's cells (None: the grid's)
        self._prompts = None  # the prompt file's lines encoded (conditions, negatives), at the first preview
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
        own = [name for name, value in (("prompt_file", self.prompt_file), ("size", self.size),
                                        ("frames", self.frames)) if value is not None]
        if CONTROL_KEY in (data_info.get("image_keys") or ()) and own:  # Wan VACE: the held-out clips' controls
            raise ConfigError(f"{SETTING}.{own[0]}={getattr(self, own[0])}: this model previews under the held-out "
                              f"clips' own control videos, whose latents have the data's size and prompts; leave "
                              f"{SETTING}.{own[0]} null (infer.py control=<video file> samples other prompts and sizes)")
        if self.size is None and self.frames is None:
            self.shape = None
        else:
            self.shape = SampleSizes.of(data_info, patch).shape(self.size, self.frames,
                                                                names=(f"{SETTING}.size", f"{SETTING}.frames"))
        if self.lines is not None:
            self.line_shapes = self.check_prompt_file(data_info, patch)
        return self.shape

    def check_prompt_file(self, data_info: dict, patch: tuple[int, ...]) -> list:
        """The prompt file against the run: a text model whose data name the text encoder that encodes its prompts
        (and that folder is here); each line's size / frames (default the grid's) one the model samples."""
        setting = f"{SETTING}.prompt_file={self.prompt_file}"
        if not text_conditioned(data_info):
            raise ConfigError(f"{setting}: this run's model is class-conditional and takes no prompts; drop it (the "
                              f"previews show {SETTING}.max_classes classes)")
        encoder = (data_info.get("text_encoder") or {}).get("path")
        if not encoder or not Path(encoder).expanduser().exists():
            raise ConfigError(f"{setting}: its prompts are encoded with the text encoder the data was prepared with, "
                              f"but {'the data records none' if not encoder else f'{encoder} is not here'}; prepare "
                              f"the data with ringdit.prepare (it records its encoder), or preview the held-out "
                              f"prompts ({SETTING}.prompt_file=null)")
        sizes = SampleSizes.of(data_info, patch)
        return [None if line.size is None and line.frames is None and self.shape is None else
                sizes.shape(line.size if line.size is not None else self.size,
                            line.frames if line.frames is not None else self.frames, where=line.where)
                for line in self.lines]

    def on_fit_start(self, trainer, pl_module) -> None:
        self.check_shape(pl_module.hparams.data, patch_shape(pl_module.model))  # before the first step
        self.preview_audio(pl_module)  # an audio VAE of another sample rate: refused before the first step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every_n_steps == 0 and step != self._last_step:
            self.make_grid(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step != self._last_step:
            self.make_grid(trainer, pl_module)

    def make_grid(self, trainer: L.Trainer, pl_module) -> Path | None:
        self._last_step = step = trainer.global_step
        data = pl_module.hparams.data
        vae = self.preview_vae(data) if "latent_scale" in data else None
        if "latent_scale" in data and vae is None:
            return None  # latents without their VAE cannot be looked at (said once, by preview_vae)
        sampler = preview_sampler(pl_module, vae, self.preview_audio(pl_module))
        # latents: every rank decodes its share of each sample's tiles (they all sampled the same latents), rank 0
        # gets the pixels
        group = dist.group.WORLD if not sampler.pixels and dist.is_available() and dist.is_initialized() \
            and trainer.world_size > 1 else None
        rows = self.rows(trainer, pl_module, sampler)
        shapes = {row["shape"] for row in rows}
        images, sounds, captions = [], [], []
        for row in rows:
            samples, joint = joint_in_micro_batches(sampler, row["condition"], row["seeds"], self.batch_size,
                                                    negative=row["negative"], shape=row["shape"], **row["overrides"])
            images.append(sampler.to_pixels(samples, group) if not sampler.pixels or trainer.is_global_zero else None)
            sounds += (sampler.sounds(joint) if trainer.is_global_zero else None) or [None] * len(samples)
            captions += row["captions"]
        if not trainer.is_global_zero:
            return None
        import numpy as np

        folder = self.output_dir / "samples"
        stem = folder / f"step_{step:07d}"
        if len(shapes) == 1:  # one grid, a row per prompt or class
            images = [np.concatenate(images)]
        paths = [save_samples(grid, stem if len(images) == 1 else stem.with_name(f"{stem.name}_{i:02d}"),
                              columns=self.per_class, fps=self.frame_rate(pl_module) or 8)
                 for i, grid in enumerate(images)]
        videos = []
        if images[0].ndim == 5:  # (N, T, H, W, C): each one an MP4 too (with its sound), which the loggers upload
            stem.mkdir(parents=True, exist_ok=True)
            videos = [write_sample(video, stem / f"{i:03d}.mp4", self.frame_rate(pl_module), sounds[i])
                      for i, video in enumerate(v for grid in images for v in grid)]
        for grid in images if len(images) == 1 else []:
            log_samples(trainer.loggers, grid, captions, step, videos=videos, columns=self.per_class)
        if len(images) > 1:  # rows of several shapes: each sample on its own (the grids are files)
            log_samples(trainer.loggers, [v for grid in images for v in grid], captions, step, videos=videos,
                        columns=self.per_class)
        return paths[0]

    def frame_rate(self, pl_module) -> int | None:
        """The previews' frames per second: ``fps``, else the model's own."""
        return frame_rate(f"{SETTING}.fps", self.fps, pl_module.hparams.model)

    def rows(self, trainer: L.Trainer, pl_module, sampler: Sampler) -> list[dict]:
        """What the preview samples, in calls of one shape and settings each: its ``condition``, ``seeds``,
        ``captions`` (one a sample), ``shape``, ``negative`` (None: the empty prompt) and sampling ``overrides``. The
        held-out prompts or classes are one call (``per_class`` samples each); a prompt file's lines one each, with
        their own size, seed and settings."""
        overrides = {"steps": self.steps, "cfg_scale": self.cfg_scale}
        if self.lines is not None:
            conditions, negatives = self.encoded_prompts(pl_module.hparams.data, sampler)
            rows, cell = [], 0
            for i, line in enumerate(self.lines[:self.max_classes]):
                seed = line.options.get("seed")
                seeds = [seed_of(Stream.PREVIEW, self.seed if seed is None else seed, cell + j if seed is None else j)
                         for j in range(self.per_class)]
                cell += self.per_class
                options = {key: line.options.get(key) for key in ("steps", "cfg_scale", "guidance")}
                rows.append({"condition": {key: value[i:i + 1].repeat_interleave(self.per_class, 0)
                                           for key, value in conditions.items()},
                             "seeds": seeds, "captions": [line.prompt] * self.per_class, "negative": negatives[i],
                             "shape": (self.line_shapes[i] if self.line_shapes else None) or self.shape,
                             "overrides": {**overrides, **{k: v for k, v in options.items() if v is not None}}})
            return rows
        if pl_module.text_conditioned:  # one row per held-out prompt (the same prompts at every step)
            prompts, names = trainer.datamodule.held_out(self.max_classes)
            condition = {key: value.repeat_interleave(self.per_class, 0) for key, value in prompts.items()}
            count = len(condition["text"])
        else:
            classes = min(pl_module.hparams.data["num_classes"], self.max_classes)
            condition = torch.arange(classes).repeat_interleave(self.per_class)
            names = list(pl_module.hparams.data.get("class_names") or range(classes))[:classes]
            count = len(condition)
        seeds = [seed_of(Stream.PREVIEW, self.seed, cell) for cell in range(count)]
        return [{"condition": condition, "seeds": seeds, "captions": [str(name) for name in names
                                                                       for _ in range(self.per_class)],
                 "negative": None, "shape": self.shape, "overrides": overrides}]  # one call, in micro-batches

    def encoded_prompts(self, data_info: dict, sampler: Sampler) -> tuple[dict, list]:
        """The prompt file's lines encoded once by ``sampler`` (``Sampler.encode``) with the data's text encoder as
        its prompts were (on the GPU where there is one: at the first preview the optimizer's state is not yet
        allocated; the encoder is let go once they are encoded): the conditions ``(lines, ...)`` and each line's
        negative prompt ``(1, ...)`` or None (the empty prompt)."""
        if self._prompts is None:
            described = data_info["text_encoder"]
            texts = [line.prompt for line in self.lines]
            own = [text for text in dict.fromkeys(line.negative_prompt for line in self.lines) if text]
            encoder = data_text_encoder(data_info, described["path"], described.get("tokenizer"),
                                        device="cuda" if torch.cuda.is_available() else "cpu")
            with sampler.using(codecs=replace(sampler.codecs, text_encoder=encoder)) as encoding:
                encoded = {key: value.cpu() for key, value in encoding.encode(texts + own).items()}
            negatives = [None if not line.negative_prompt else
                         {key: value[len(texts) + own.index(line.negative_prompt)][None] for key, value in
                          encoded.items()} for line in self.lines]
            self._prompts = ({key: value[:len(texts)] for key, value in encoded.items()}, negatives)
        return self._prompts

    def preview_audio(self, pl_module) -> AudioDecoder | None:
        """The audio VAE and vocoder a model that samples sound (LTX-2) previews its sound with (``audio_vae``, else
        the data's when its folder is here), checked and loaded once; None: silent previews."""
        if self._audio is None:
            model = pl_module.model
            sound = AUDIO_KEY in model.joint_latents
            path, subfolder, vocoder = self.audio_setting
            folder = sampling_audio_vae(path, subfolder, vocoder, pl_module.hparams.data,
                                        dict(model.transformer.config) if sound else None,
                                        setting=f"{SETTING}.audio_vae")
            device = "cuda" if torch.cuda.is_available() else "cpu"
            self._audio = AudioDecoder.load(folder, subfolder, vocoder, device=device,
                                            setting=f"{SETTING}.audio_vae") if folder else False
        return self._audio or None

    def preview_vae(self, data_info: dict):
        """The VAE latent previews decode with (``vae``, else the data's when its folder is here), loaded once;
        None, said once, where there is none."""
        if self._codec is None:
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


def preview_sampler(pl_module, vae=None, audio: AudioDecoder | None = None) -> Sampler:
    """The previews' own sampler: the training module's model with its EMA weights swapped in while it samples
    (``DiffusionModule.ema_weights``), the run's sampling settings, no step cache, the empty prompt as the
    negative unless a row gives its own; ``vae`` decodes a latent model's samples (``Sampler.to_pixels``), ``audio``
    the sound a model samples with them (``Sampler.sounds``)."""
    data = pl_module.hparams.data
    return Sampler.for_run(pl_module.model, pl_module.objective, pl_module.hparams.get("sampling"), data,
                           dims=pl_module.parallel_dims, device=pl_module.device, weights=pl_module.ema_weights,
                           codecs=Codecs.of_data(data, vae=vae, audio=audio))


def joint_in_micro_batches(sampler: Sampler, condition, seeds: list[int], batch_size: int | None,
                           **keywords) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``Sampler.generate_joint`` over micro-batches (``in_micro_batches``): the samples and the latents the model
    samples beside them (LTX-2's sound), each concatenated."""
    joints = []

    def generate(*arguments, **given):
        samples, joint = sampler.generate_joint(*arguments, **given)
        joints.append(joint)
        return samples

    samples = in_micro_batches(generate, condition, seeds, batch_size, **keywords)
    return samples, {key: torch.cat([joint[key] for joint in joints]) for key in joints[0]}


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
