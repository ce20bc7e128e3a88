"""``DiffusersTransformer``: a diffusers transformer (Wan, ...) as a ringdit denoiser, sequence-parallel by its plan.

Built from a local diffusers folder (``pretrained``; nothing is downloaded) or from an architecture ``config`` with
random init. The conditioning is a dict of batch-first tensors (``text``: the text encoder's hidden states, ...);
the unconditional ("null") conditioning used for classifier-free guidance -- the empty or negative prompt's
embedding -- is a buffer of this module, so it travels with checkpoints and exports.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch
from omegaconf import OmegaConf
from torch import nn

from ringdit.common.errors import ConfigError
from ringdit.models.diffusers.building import (EXPERTS, build_transformer, check_boundary_ratio, check_folder_experts,
                                              check_same_architecture, guidance_embedding, plain_value,
                                              pretrained_folder, read_config, second_expert_subfolder)
from ringdit.models.diffusers.data_checks import (check_image_architecture, check_image_data, check_latent_shape,
                                                 check_width, glyph_shape, image_embeds_width)
from ringdit.models.diffusers.families import Family, get_family
from ringdit.models.diffusers.folders import check_weights_folder
from ringdit.models.diffusers.image_to_video import (channel_input, first_frame_channel_input,
                                                    first_frame_mask, replace_first_frame, require_image,
                                                    token_timesteps)
from ringdit.diffusion.schedulers import PipelineTimesteps
from ringdit.models.block_io import BlockIO
from ringdit.models.checkpointing import checkpoint_model_blocks
from ringdit.models.conditioning import GLYPH_KEYS, IMAGE_KEYS, NULL_KEYS, SAMPLE_KEYS, TEXT, check_guidance_scale
from ringdit.models.parallelize import repeated_blocks
from ringdit.models.parallel_plan import ParallelPlan
from ringdit.models.protocol import KindDefaults

Tensor = torch.Tensor


class DiffusersTransformer(KindDefaults, nn.Module):
    """``family``'s diffusers transformer, unchanged; ``parallel_plan`` says where ringdit parallelizes it.

    Args:
        family: a key of ``ringdit.models.diffusers.FAMILIES`` (``wan``).
        config: the diffusers architecture config (used when ``pretrained`` is None).
        pretrained: a local diffusers folder; ``subfolder`` inside it holds ``config.json`` and the weights.
        input_size: the latent shape ``(T, H, W)`` / ``(H, W)`` of the data; in_channels: latent channels.
        text_len, text_dim: the shape of one text embedding ``(L, D_text)``, for the null-condition buffer.
        glyph_len, glyph_dim: the shape ``(G, D_glyph)`` of the data's glyph text (HunyuanVideo 1.5's ByT5 states of
            the quoted text), for its null-condition buffers; None: the data have none, and the model reads none.
        condition_dropout_prob: the chance that training replaces a sample's conditioning by the null one.
        activation_checkpointing: recompute all (true), a share (0.5) or every N-th (every_2) of the transformer
            blocks in backward (``ringdit.models.checkpointing``; ``gradient_checkpointing``: alias).
        activation_offload: the checkpointed blocks' inputs in pinned CPU memory (CUDA; ignored on CPU).
        boundary_ratio: a two-expert model (Wan 2.2 A14B): ``transformer`` denoises model times at and above
            ``boundary_ratio * 1000`` (the high-noise expert), ``transformer_2`` those below (the low-noise expert),
            as WanPipeline switches them; ``pretrained`` then holds ``<subfolder>/`` and ``<subfolder>_2/``.
    """

    # a diffusers model may hold parameters its loss never reaches (QwenImage's last text-stream MLP): DDP learns
    # which in the first step (static_graph)
    loss_reaches_every_parameter = False
    diffusers_folders = True  # its weights load from and export to diffusers folders

    def __init__(
        self,
        family: str,
        config: dict | None = None,
        pretrained: str | None = None,
        subfolder: str | None = "transformer",
        input_size: tuple[int, ...] | None = None,
        in_channels: int | None = None,
        text_len: int | None = None,
        text_dim: int | None = None,
        pooled_dim: int | None = None,
        glyph_len: int | None = None,
        glyph_dim: int | None = None,
        condition_dropout_prob: float = 0.1,
        guidance: float | None = None,
        activation_checkpointing: bool | float | str = False,
        gradient_checkpointing: bool = False,
        activation_offload: bool = False,
        boundary_ratio: float | None = None,
    ):
        super().__init__()
        if not 0 <= condition_dropout_prob < 1:
            raise ValueError(f"model.condition_dropout_prob must be in [0, 1), got {condition_dropout_prob}")
        self.family: Family = get_family(family)
        if OmegaConf.is_config(config):  # Hydra passes nested settings as DictConfig; diffusers wants plain values
            config = OmegaConf.to_container(config, resolve=True)
        self.boundary_ratio = check_boundary_ratio(boundary_ratio, pretrained, subfolder)
        if pretrained is not None and subfolder:
            check_folder_experts(pretrained, subfolder, self.boundary_ratio)
        self.transformer = build_transformer(self.family, config, pretrained, subfolder)
        if self.boundary_ratio is not None:  # the low-noise expert: the same architecture, its own weights
            self.transformer_2 = build_transformer(self.family, config, pretrained, second_expert_subfolder(subfolder))
            check_same_architecture(self.transformer, self.transformer_2, pretrained)
        self.pretrained = (pretrained, subfolder) if pretrained is not None else None  # the weights to load
        arch = dict(self.transformer.config)
        self.in_channels = self.family.latent_channels(arch)  # of the latents ringdit sees
        self.image_condition = self.family.image_condition  # image-to-video: how the first frame enters
        check_image_architecture(self.family, arch)
        # the conditioning the model reads: image embeddings too where the architecture takes them (Wan's image_dim,
        # HunyuanVideo 1.5 I2V's image_embed_dim)
        self.condition_keys = self.family.condition_keys + (("image_embeds",) if image_embeds_width(self.family, arch)
                                                            else ())
        self.condition_dropout_prob = condition_dropout_prob
        self.guidance = guidance = check_guidance_scale(guidance)
        if arch.get("guidance_embeds") and guidance is None:
            raise ConfigError(f"model.guidance is not set: this {self.family.model_class} is guidance-distilled "
                              f"(guidance_embeds); set it, e.g. model.guidance=3.5 for sampling, 1.0 to fine-tune")
        if guidance is not None and "guidance_embeds" in arch and not arch["guidance_embeds"]:
            raise ConfigError(f"model.guidance={guidance}: this {self.family.model_class} has no guidance embedding "
                              f"(guidance_embeds: false, e.g. FLUX.1-schnell); set model.guidance=null")
        self.input_size = tuple(input_size) if input_size is not None else None
        self.patch_size = self.family.patch_shape(arch)
        if self.input_size is not None:
            check_latent_shape(self.input_size, self.patch_size, in_channels, self.in_channels)
            self.default_grid = tuple(s // p for s, p in zip(self.input_size, self.patch_size))
        text_len, text_dim = text_len or 1, text_dim or arch[self.family.text_dim]
        check_width("text embeddings", text_dim, self.family.text_dim, arch)
        self.register_buffer("null_text", torch.zeros(1, text_len, text_dim))  # (1, L, D_text)
        self.register_buffer("null_text_mask", torch.zeros(1, text_len, dtype=torch.bool))  # (1, L)
        if "audio_text" in self.family.condition_keys:  # LTX-2: the empty prompt's audio states (1, L, D_text)
            self.register_buffer("null_audio_text", torch.zeros(1, text_len, text_dim))
        if self.family.pooled_dim is not None:
            pooled_dim = pooled_dim or arch[self.family.pooled_dim]
            check_width("pooled text embeddings", pooled_dim, self.family.pooled_dim, arch)
            self.register_buffer("null_pooled", torch.zeros(1, pooled_dim))  # (1, P)
        if glyph_len:  # the empty prompt's glyph text: zero and all masked (no quoted text) unless the data say
            glyph_shape(self.family, {"glyph_len": glyph_len, "glyph_dim": glyph_dim})  # a family that reads it
            check_width("glyph text embeddings", glyph_dim, self.family.glyph_dim, arch)
            self.register_buffer("null_glyph_text", torch.zeros(1, glyph_len, glyph_dim))  # (1, G, D_glyph)
            self.register_buffer("null_glyph_text_mask", torch.zeros(1, glyph_len, dtype=torch.bool))  # (1, G)
            self.condition_keys += GLYPH_KEYS
        # all or a share of the blocks recompute in backward (ringdit.models.checkpointing)
        checkpoint_model_blocks(self, activation_checkpointing or gradient_checkpointing, activation_offload)

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """LoRA's default targets: the family's attention projections."""
        return self.family.lora_targets

    @classmethod
    def config_for_data(cls, config: dict, data: dict) -> dict:
        """``config`` with the data's latent channels and shape and its text embedding shape (``data``: what the data
        module describes)."""
        if data.get("conditioning") != "text":
            raise ConfigError(f"model.family={config['family']} is conditioned on text, but the data gives class "
                              f"labels; use data=text_latents (or data=synthetic_text_latents)")
        video_data, family = len(data["image_size"]) == 3, get_family(config["family"])
        if video_data != family.video:
            raise ConfigError(f"the data gives {'videos (T, H, W)' if video_data else 'images (H, W)'} = "
                              f"{list(data['image_size'])} but model.family={family.name} is a "
                              f"{'video' if family.video else 'image'} model")
        if family.pooled_dim is not None and not data.get("pooled_dim"):
            raise ConfigError(f"model.family={family.name} takes a pooled text embedding, but the data has none; "
                              f"encode the captions with the model's pooled text encoder too (text_latents 'pooled')")
        check_image_data(config, family, data)
        glyph = glyph_shape(family, data)
        if config.get("pretrained"):  # the run records the architecture it trains: the folder's, not a preset's
            folder = pretrained_folder(family, config["pretrained"], config.get("subfolder", "transformer"))
            config = {**config, "config": read_config(family, folder, config["pretrained"])}
        return {**config, "input_size": list(data["image_size"]), "in_channels": data["channels"],
                "text_len": data["text_len"], "text_dim": data["text_dim"], "pooled_dim": data.get("pooled_dim"),
                **glyph}

    @property
    def parallel_plan(self) -> ParallelPlan:
        """The family's plan, for the diffusers model this wraps as ``transformer`` (and ``transformer_2``: the
        pattern matches both experts, which share one sequence state, as only one runs in a forward)."""
        return self.family.plan.under("transformer*" if self.experts else "transformer")

    # ---- two experts (Wan 2.2 A14B) ------------------------------------------------------------------------------
    @property
    def experts(self) -> tuple[str, ...]:
        """``("high", "low")`` for a two-expert model, ``()`` for one transformer."""
        return EXPERTS if self.boundary_ratio is not None else ()

    @property
    def expert_modules(self) -> tuple[nn.Module, ...]:
        """The experts' transformers (high, low), each a unit FSDP gathers only when it runs; ``()`` for one."""
        return (self.transformer, self.transformer_2) if self.experts else ()

    def expert_at(self, t: Tensor) -> str | None:
        """The expert that denoises model time ``t`` (B,) in 0..1000: ``high`` at and above the boundary, as
        WanPipeline's ``t >= boundary_ratio * num_train_timesteps``; None for a one-expert model."""
        if not self.experts:
            return None
        high = t >= self.boundary_ratio * 1000
        if bool(high.all()) or not bool(high.any()):
            return "high" if bool(high[0]) else "low"
        raise ValueError(f"a batch's model times {t.tolist()} straddle the experts' boundary "
                         f"{self.boundary_ratio * 1000:g}: a two-expert model denoises one side of it per forward")

    def train_only(self, expert: str) -> None:
        """Freeze the other expert (``diffusion.expert=high|low``): it keeps its weights for sampling, and no
        gradient, optimizer state or EMA is spent on it."""
        (self.transformer_2 if expert == "high" else self.transformer).requires_grad_(False)

    def forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor], expert: str | None = None,
                guidance: Tensor | None = None) -> Tensor:
        """x (B, C, [T,] H, W) noisy latents, t (B,) model time 0..1000 -> the prediction (B, C, [T,] H, W),
        gathered from every sequence-parallel rank. ``expert``: the expert that runs (training names the one whose
        time range it drew t from); default the one ``t`` falls to. ``guidance``: (B,) scales for a guidance-distilled
        model's embedding (None: the condition's, else ``model.guidance``)."""
        if guidance is not None:
            cond = {**cond, "guidance": guidance}
        expert = expert or self.expert_at(t)
        transformer = self.transformer_2 if expert == "low" else self.transformer
        if x.dtype == torch.float32 and transformer.dtype == torch.float64:  # trainer.precision=64-true: the float32
            x = x.double()  # noise in the model's dtype, as diffusers' pipelines hand their latents over
        if self.guidance is not None and "guidance" not in cond:  # a guidance-distilled model's embedding input
            cond = {**cond, "guidance": x.new_full((x.shape[0],), float(self.guidance))}
        if self.image_condition == "first_frame":  # Wan 2.2 TI2V: the clean first frame, its tokens at time 0
            x = replace_first_frame(x, require_image(self.image_condition, cond, self.family.name))
            t = token_timesteps(t.to(x.dtype), x.shape, self.patch_size)  # (B, S)
        elif self.image_condition == "channels":  # Wan 2.1 I2V: (B, 2C + 4, T, H, W) [video ; mask ; image]
            x = channel_input(x, require_image(self.image_condition, cond, self.family.name))
        elif self.image_condition == "first_frame_channels":  # HunyuanVideo 1.5 I2V: (B, 2C + 1, T, H, W)
            x = first_frame_channel_input(x, require_image(self.image_condition, cond, self.family.name))
        return self.family.forward(transformer, x, t, cond)

    # ---- image-to-video ------------------------------------------------------------------------------------------
    def loss_weights(self, x0: Tensor) -> Tensor | None:
        """(1, 1, T, 1, 1) 0/1 weights of the latents the loss covers, None for all: Wan 2.2 TI2V's first frame is
        given, not denoised, so only the frames that were noised count (Wan 2.1 I2V and HunyuanVideo 1.5 I2V denoise
        the whole video, their first frame too)."""
        if self.image_condition != "first_frame":
            return None
        return first_frame_mask(x0.shape, x0.device, x0.dtype)[..., :1, :1]

    def with_condition_frames(self, x: Tensor, cond: dict[str, Tensor]) -> Tensor:
        """A finished sample with the given first frame in place (the pipeline's last blend, Wan 2.2 TI2V); others
        unchanged."""
        if self.image_condition != "first_frame":
            return x
        return replace_first_frame(x, require_image(self.image_condition, cond, self.family.name))

    # ---- conditioning --------------------------------------------------------------------------------------------
    def null_buffers(self) -> dict[str, Tensor]:
        """The empty prompt's conditioning (1, ...) by key: its text and mask, and its pooled embedding and glyph
        text where the model reads them (``NULL_KEYS``: the buffers of pooled and glyph text only where the model has
        them)."""
        return {key: getattr(self, name) for key, name in NULL_KEYS.items() if hasattr(self, name)}

    def null_condition(self, batch: int) -> dict[str, Tensor]:
        """The empty prompt's conditioning, expanded to ``batch``."""
        return {key: value.expand(batch, *value.shape[1:]) for key, value in self.null_buffers().items()}

    def drop_condition(self, cond: dict[str, Tensor], drop: Tensor) -> dict[str, Tensor]:
        """Replace the conditioning of the samples where ``drop`` (B,) is True by the null conditioning."""
        null = self.null_condition(drop.shape[0])
        return {key: torch.where(drop.view(-1, *[1] * (value.dim() - 1)), null[key].to(value), value)
                if key in null else value for key, value in cond.items()}

    def model_condition(self, cond: dict[str, Tensor]) -> dict[str, Tensor]:
        """The conditioning tensors this family reads (the data may carry more, e.g. a text mask). A key the
        condition lacks is left out: the null condition holds the prompt's keys only (text, pooled, glyph text), and
        classifier-free guidance then shares the image between its halves (Wan keeps the image in the unconditional
        prediction); ``forward`` refuses a conditional batch without its image."""
        return {key: cond[key] for key in self.condition_keys if key in cond}

    @torch.no_grad()
    def set_null_condition(self, null: dict[str, Tensor]) -> None:
        """The empty / negative prompt's conditioning: ``text`` (L, D) [, ``text_mask`` (L,), ``pooled`` (P,),
        ``glyph_text`` (G, D_glyph), ``glyph_text_mask`` (G,), ``audio_text`` (L, D)]; the keys the model has no buffer
        for are not read. Without ``audio_text`` the audio's empty prompt is the video's (``text``), as the LTX-2
        forward reads a prompt without audio states."""
        if "audio_text" not in null and "text" in null:
            null = {**null, "audio_text": null["text"]}
        for key, buffer in self.null_buffers().items():
            if key not in null:
                continue
            value = null[key].reshape(buffer.shape) if null[key].numel() == buffer.numel() else None
            if value is None:
                raise ValueError(f"the empty prompt's {key} of shape {tuple(null[key].shape)} does not fit "
                                 f"{tuple(buffer.shape[1:])}")
            buffer.copy_(value)

    @property
    def tokens_per_sample(self) -> int:
        return math.prod(self.default_grid)

    @property
    def stream_tokens(self) -> dict[str, int]:
        """{stream: tokens per sample} of the streams its attention sees beside ``default_grid``'s tokens
        (``Family.stream_tokens``: Qwen-Image-Edit's reference image, Wan VACE's control video)."""
        return self.stream_tokens_at(self.default_grid)

    def stream_tokens_at(self, grid: tuple[int, ...]) -> dict[str, int]:
        """``stream_tokens`` beside a token grid other than ``default_grid`` (a preview's size)."""
        return self.family.stream_tokens(self.transformer.config, grid)

    @property
    def patch_shape(self) -> tuple[int, ...]:
        return self.patch_size

    @property
    def text_tokens(self) -> int:
        """Text tokens per sample it was built to read: the text's, and the glyph text's joined to it (HunyuanVideo
        1.5)."""
        glyph = self.null_glyph_text.shape[1] if hasattr(self, "null_glyph_text") else 0
        return self.null_text.shape[1] + glyph

    @property
    def architecture(self) -> dict:
        """The diffusers transformer's config."""
        return self.transformer.config

    @property
    def joint_latents(self) -> tuple[str, ...]:
        """Conditioning keys of latents denoised together with ``x`` (``Family.joint_latents``: LTX-2's audio)."""
        return self.family.joint_latents

    def joint_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """{key: one sample's shape} of the joint latents of a sample of latents ``shape`` ([T,] H, W)."""
        if self.family.joint_shapes is None:
            raise NotImplementedError(f"model.family={self.family.name} denoises {list(self.joint_latents)} with the "
                                      f"video but says no shape of them per sample (Family.joint_shapes): it cannot "
                                      f"be sampled")
        return self.family.joint_shapes(self.transformer.config, tuple(shape))

    @property
    def teacache_size(self) -> tuple[int, int]:
        """(width, depth): what TeaCache coefficients are fitted to, beside ``kind_name``."""
        config = self.transformer.config
        width = config.get("num_attention_heads", 0) * config.get("attention_head_dim", 0)
        return int(width), int(config.get("num_layers", len(repeated_blocks(self))))

    @property
    def published_teacache_coefficients(self) -> tuple[float, ...] | None:
        """TeaCache's published polynomial for this transformer's size (``Family.teacache_coefficients``); None:
        none was published for it (``python -m ringdit.caching calibrate`` fits one)."""
        config = self.transformer.config
        width = config.get("num_attention_heads", 0) * config.get("attention_head_dim", 0)
        return self.family.teacache_coefficients.get((int(width), int(config.get("num_layers", 0))))

    # the members of the model-kind contract (ringdit.models.protocol.DiffusionModel) whose values are its family's:
    # code outside ringdit/models asks the model, never which record holds them
    @property
    def kind_name(self) -> str:
        return self.family.name

    @property
    def cache_blocks(self) -> BlockIO | None:
        return self.family.cache_blocks

    @property
    def teacache_input(self) -> Callable | None:
        return self.family.teacache_input

    @property
    def pipeline_timesteps(self) -> PipelineTimesteps:
        return self.family.pipeline_timesteps

    # ---- what a diffusers model declares as a model kind (ringdit.models.protocol.DiffusionModel): its family's ----

    @staticmethod
    def planned_data(config: dict, data: dict) -> dict:
        """What ``python -m ringdit.plan`` lays out for a model of ``config`` (its architecture: the preset's, or
        ``model.pretrained``'s config.json) on its ``data`` settings: the family's patch, video or image, VAE factors,
        and the text data it reads (an image-to-video family planned as prepare task=i2v stores its data)."""
        family = get_family(config["family"])
        if config.get("pretrained"):
            folder = pretrained_folder(family, config["pretrained"], config.get("subfolder"))
            arch = read_config(family, folder, config["pretrained"])
        elif config.get("config"):
            arch = config["config"]
        else:
            raise ConfigError("model: give model.pretrained=<local diffusers folder> or pick a preset with an "
                              "architecture (model=wan_14b, model=flux_dev, ...)")
        text_len, fixed = data.get("text_len"), family.text_len(arch)
        if fixed and text_len not in (None, fixed):
            raise ConfigError(f"data.text_len={text_len}: {family.name}'s pipeline pads every prompt to {fixed} "
                              f"tokens; leave data.text_len null")
        return {"patch": family.patch_shape(arch), "video": family.video, "vae_factors": family.vae_factors,
                "frame_pad": family.frame_pad, "clip_frames": family.clip_frames,
                "data": {"conditioning": TEXT, "channels": family.latent_channels(arch),
                         "text_len": fixed or text_len or 512, "text_dim": arch[family.text_dim],
                         "pooled_dim": arch.get(family.pooled_dim) if family.pooled_dim else None,
                         # the per-sample tensors beside the text that the family's data hold: its first frame,
                         # control video, reference image or the latents it denoises with the video (audio)
                         "image_keys": [*(IMAGE_KEYS if family.image_condition else ()),
                                        *(key for key in SAMPLE_KEYS if key not in IMAGE_KEYS
                                          and key in family.condition_keys + family.joint_latents)]}}

    @staticmethod
    def frame_rate(config: dict) -> int | None:
        """The frame rate the family's videos play at (``Family.fps``, its published pipeline's); None: images."""
        return get_family(config["family"]).fps

    @staticmethod
    def sampling_defaults(config: dict) -> dict:
        """The flow objective's settings a run leaves unset, as the family's pipeline fixes them: the resolution
        shift's constants (``diffusion.objective.resolution``) and the last sampling time (``shift_terminal``); the
        latents it denoises with the video (``joint_latents``: what ``diffusion.sampling.joint_shift`` may name); the
        sampler of its pipeline's own scheduler (``scheduler``: the family's name where ``Family.scheduler`` is set,
        else None)."""
        family = get_family(config["family"])
        return {"resolution": family.resolution_shift, "shift_terminal": family.shift_terminal,
                "joint_latents": family.joint_latents, "scheduler": family.name if family.scheduler else None}

    @property
    def takes_guidance(self) -> bool:
        """Whether the model has a guidance-scale input (Flux-dev's ``guidance_embeds``): what
        ``diffusion.model_guidance`` trains."""
        return self.guidance is not None

    @staticmethod
    def check_guidance(config: dict, sampling: dict, prefix: str = "") -> None:
        """The guidance embedding's value only for a model that has one (Flux-dev); classifier-free guidance always:
        away from the empty or negative prompt, which pretrained models learnt."""
        check_guidance_scale(sampling.get("guidance"))
        if sampling.get("guidance") is not None and guidance_embedding(config) is False:
            raise ConfigError(f"model.guidance={sampling['guidance']!r} is the guidance embedding's value of a "
                              f"guidance-distilled model (Flux-dev), but this {config['family']} model has none "
                              f"(guidance_embeds) and would ignore it: leave it unset, and set the strength of "
                              f"classifier-free guidance with {prefix}cfg_scale")

    @staticmethod
    def image_conditioning(config: dict) -> tuple[str | None, str | None]:
        """The family's first-frame conditioning (``Family.image_condition``) and the key of the image embeddings it
        reads (``Family.image_embeds``: Wan's image_dim, HunyuanVideo 1.5 I2V's image_embed_dim) where the config's
        architecture sets it."""
        family = get_family(config["family"])
        embeds = family.image_embeds
        return family.image_condition, embeds if embeds and (config.get("config") or {}).get(embeds) else None

    @staticmethod
    def kind_name_of(config: dict) -> str:
        """``kind_name`` of a model of ``config`` (its family's name), before it is built."""
        return get_family(config["family"]).name

    @staticmethod
    def patch_shape_of(config: dict) -> tuple[int, ...] | None:
        """The patch a model of ``config`` (``config_for_data``'s: its architecture recorded) will have, before it is
        built; None where the config holds no architecture (it does not build either)."""
        arch = config.get("config")
        return tuple(get_family(config["family"]).patch_shape(arch)) if arch else None

    @property
    def max_grid(self) -> tuple[int, ...] | None:
        """The largest token grid ([T,] H, W) the transformer's position embedding covers; None: any."""
        return None if self.family.max_grid is None else tuple(self.family.max_grid(self.transformer.config))

    def pretrained_files(self, pretrained: str, subfolder: str | None = "transformer", setting: str = "init_from"
                         ) -> dict[str, list[Path]]:
        """The safetensors files of a local diffusers folder of this architecture (``model.pretrained``,
        ``init_from=<folder>``), checked whole, by the prefix of their keys in this module: ``transformer.`` (and
        ``transformer_2.``, the low-noise expert's, from ``<subfolder>_2/``)."""
        files = {}
        for prefix, part in self.subfolders(subfolder):
            folder = pretrained_folder(self.family, pretrained, part, setting=setting)
            files[prefix] = check_weights_folder(folder, setting=setting, value=pretrained,
                                                 class_name=self.family.model_class)
        return files

    def subfolders(self, subfolder: str | None = "transformer") -> list[tuple[str, str | None]]:
        """(key prefix in this module, subfolder of a diffusers folder) of each transformer this model holds."""
        parts = [("transformer.", subfolder)]
        if self.experts:
            parts.append(("transformer_2.", second_expert_subfolder(subfolder)))
        return parts

    def initial_value(self, name: str, shape: torch.Size, generator: torch.Generator) -> Tensor | None:
        """The random init of the parameters whose module has no ``reset_parameters``, as diffusers' constructors
        draw them: modulation tables N(0, 1 / width) (Wan's ``scale_shift_table``), norm scales one, shifts zero.
        None for the rest (their modules' own ``reset_parameters`` apply)."""
        owner_name, _, attr = name.rpartition(".")
        owner = self.get_submodule(owner_name)
        if attr in ("scale_shift_table", "audio_scale_shift_table"):  # (LTX-2's audio stream has its own)
            return torch.randn(shape, generator=generator) / shape[-1] ** 0.5
        if attr.endswith("scale_shift_table"):  # LTX-2's cross-modal and prompt tables: N(0, 1), as it draws them
            return torch.randn(shape, generator=generator)
        if not hasattr(owner, "reset_parameters") and "Norm" in type(owner).__name__:
            return torch.ones(shape) if attr == "weight" else torch.zeros(shape)
        return None

    def check_pretrained(self, pretrained: str, subfolder: str | None = "transformer") -> None:
        """Raise a ConfigError unless ``pretrained`` holds this family's model with the same architecture (each
        expert's, for a two-expert model)."""
        check_boundary_ratio(self.boundary_ratio, pretrained, subfolder, setting="init_from")
        ours = {key: value for key, value in self.transformer.config.items() if not key.startswith("_")}
        for _, part in self.subfolders(subfolder):
            folder = pretrained_folder(self.family, pretrained, part, setting="init_from")
            config = read_config(self.family, folder, pretrained, setting="init_from")
            differing = sorted(key for key in config
                               if key in ours and plain_value(config[key]) != plain_value(ours[key]))
            if differing:
                details = ", ".join(f"{key}={config[key]!r} vs {ours[key]!r}" for key in differing[:6])
                raise ConfigError(f"init_from={pretrained} is another {self.family.model_class} architecture than "
                                  f"the model ({details}); pick the model preset that matches it, or model.pretrained")
            check_weights_folder(folder, setting="init_from", value=pretrained, class_name=self.family.model_class)
