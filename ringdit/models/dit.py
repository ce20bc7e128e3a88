"""Diffusion Transformer with adaLN-Zero blocks (Peebles & Xie, 2023), for images and video.

The model is written for one device and follows facebookresearch/DiT ``models.py`` (same parameter names and
shapes, so original checkpoints load with strict key checking); nothing in it knows about ranks. Sequence
parallelism is data next to the model, ``DiT.parallel_plan``, applied by ``ringdit.models.parallelize`` exactly as a
diffusers family's plan: each block's attention kernel (``inner_attention``) becomes ``USPAttention``, the tokens
split where they enter the first block and gather where they leave the final layer.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import nn

from ringdit.attention import LocalAttention
from ringdit.common.errors import ConfigError
from ringdit.diffusion.schedulers import PipelineTimesteps
from ringdit.models.block_io import BlockIO
from ringdit.models.checkpointing import checkpoint_model_blocks
from ringdit.models.conditioning import check_guidance_scale
from ringdit.models.embeddings import LabelEmbedder, PatchEmbed, TimestepEmbedder, sincos_pos_embed
from ringdit.models.parallel_plan import ParallelPlan
from ringdit.models.protocol import KindDefaults

Tensor = torch.Tensor


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN: per-sample affine of normalised tokens. x (B, N, D), shift/scale (B, D)."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class Attention(nn.Module):
    """Multi-head self-attention with timm's parameter names (qkv, proj); the kernel is ``inner_attention``."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden_size={dim} is not divisible by num_heads={num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.inner_attention = LocalAttention()  # one device; the parallel plan puts USPAttention here
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, self.head_dim).unbind(2)  # (B, N, H, Dh)
        out = self.inner_attention(q, k, v)  # (B, N, H, Dh)
        return self.proj(out.reshape(batch, tokens, dim))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


# the frame rate the moving-digits demos write their videos at (ringdit's one rate before rates were the model's)
DIGITS_FPS = 16


class DiTBlock(nn.Module):
    """Transformer block whose LayerNorms are modulated by the conditioning, with zero-initialised gates."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size, bias=True))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    def __init__(self, hidden_size: int, patch_volume: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_volume * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(KindDefaults, nn.Module):
    """Class-conditional DiT over image latents/pixels ``(B, C, H, W)`` or videos ``(B, C, T, H, W)``.

    Args mirror the original; additions: ``input_size`` may be ``(H, W)`` or ``(T, H, W)``,
    ``temporal_patch_size`` makes it a video model, ``activation_checkpointing`` recomputes all, a share or every N-th
    of the blocks in backward (``ringdit.models.checkpointing``; ``gradient_checkpointing``: its older name), and
    ``activation_offload`` keeps their inputs in CPU memory on CUDA. Any grid divisible by the patch works at run
    time; ``input_size`` only fixes the stored ``pos_embed`` (the original's parameter) and the default shape.
    ``guidance_embed`` gives it a guidance-scale input, as Flux-dev's guidance embedding (``g_embedder``: the scale x
    1000 through a timestep embedder, added to the conditioning; its output layer starts at zero, so a model trained
    without it starts unchanged); ``guidance``: the scale it is fed when the call gives none (``model.guidance``).
    """

    # Sequence parallelism (ringdit.models.parallel_plan): the tokens, patch- and position-embedded, split where they enter
    # the first block and gather where the final layer leaves them; every block attends through USPAttention.
    parallel_plan = ParallelPlan(
        blocks=("blocks",),
        self_attention=("blocks.*.attn",),
        split_inputs={"blocks.0": {0: 1}},  # (B, N, D) tokens
        gather_outputs={"final_layer": {None: 1}},  # (B, N, patch_volume * out_channels)
    )
    lora_targets = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")  # LoRA's default: attention and MLP projections
    vae_factors = (1, 8)  # on latents: an image VAE's 8x (SD's); a video DiT's frames are the data's own
    cache_blocks = BlockIO("x")  # the step cache: a block's token stream in and out
    # what a diffusers model reads from its Family record, the DiT's own: its name (in checkpoints' and TeaCache's
    # records), how a scheduler steps it (as WanPipeline: set_timesteps(steps)), no published TeaCache polynomial
    kind_name = "dit"
    pipeline_timesteps = PipelineTimesteps()
    published_teacache_coefficients = None

    @property
    def stream_tokens(self) -> dict[str, int]:
        """None beside the patches (the class label is no token): the grid's tokens are the whole sequence."""
        return {}

    @staticmethod
    def teacache_input(block, io, args, kwargs) -> tuple[Tensor, bool]:
        """TeaCache's probe: the first block's modulated input (B, N_local, D), a token shard."""
        x, c = io.argument(block, "x", args, kwargs), io.argument(block, "c", args, kwargs)
        shift, scale = block.adaLN_modulation(c).chunk(6, dim=1)[:2]
        return modulate(block.norm1(x), shift, scale), True

    def __init__(
        self,
        input_size: int | tuple[int, ...] = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        hidden_size: int = 1152,
        depth: int = 28,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        class_dropout_prob: float = 0.1,
        num_classes: int = 1000,
        learn_sigma: bool = True,
        temporal_patch_size: int | None = None,
        activation_checkpointing: bool | float | str = False,
        gradient_checkpointing: bool = False,
        activation_offload: bool = False,
        guidance_embed: bool = False,
        guidance: float | None = None,
    ):
        super().__init__()
        guidance = check_guidance_scale(guidance)
        if guidance is not None and not guidance_embed:
            raise ConfigError(f"model.guidance={guidance} is the guidance embedding's input, but this DiT has none "
                              f"(model.guidance_embed=false); set model.guidance=null, or model.guidance_embed=true")
        self.guidance = (1.0 if guidance is None else float(guidance)) if guidance_embed else None
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.learn_sigma = learn_sigma
        self.num_classes = num_classes
        self.class_dropout_prob = class_dropout_prob
        self.activation_checkpointing = activation_checkpointing or gradient_checkpointing
        self.input_size = _input_shape(input_size, video=temporal_patch_size is not None)

        self.x_embedder = PatchEmbed(patch_size, in_channels, hidden_size, temporal_patch_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        self.g_embedder = TimestepEmbedder(hidden_size) if guidance_embed else None  # the guidance scale's input
        _check_divisible(self.input_size, self.x_embedder.patch_shape)
        self.default_grid = tuple(s // p for s, p in zip(self.input_size, self.x_embedder.patch_shape))
        # Fixed sin-cos table for the default grid, a frozen parameter as in the original checkpoints.
        self.pos_embed = nn.Parameter(sincos_pos_embed(hidden_size, self.default_grid), requires_grad=False)
        self.blocks = nn.ModuleList([DiTBlock(hidden_size, num_heads, mlp_ratio) for _ in range(depth)])
        self.final_layer = FinalLayer(hidden_size, math.prod(self.x_embedder.patch_shape), self.out_channels)
        self.initialize_weights()
        checkpoint_model_blocks(self, self.activation_checkpointing, activation_offload)

    def initialize_weights(self) -> None:
        """The original's init (``initial_value``), drawn from the global RNG; a model built on the meta device
        gets it from ``ringdit.models.materialize`` instead, one module at a time."""
        with torch.no_grad():
            for name, param in self.named_parameters():
                if not param.is_meta:
                    param.copy_(self.initial_value(name, param.shape))

    def initial_value(self, name: str, shape: torch.Size, generator: torch.Generator | None = None) -> Tensor | None:
        """The original's initial value of parameter ``name``: xavier-uniform linears (the patch embedding's conv as
        the linear of its flattened kernel) with zero biases, N(0, 0.02) label and timestep embeddings, zeroed adaLN
        modulation and output layer (adaLN-Zero), the sin-cos position table. None for a parameter that is not the
        DiT's own (a LoRA adapter)."""
        if ".lora_" in name:
            return None
        if name == "pos_embed":
            return sincos_pos_embed(self.pos_embed.shape[-1], self.default_grid).reshape(shape)
        value = torch.zeros(shape)
        if name.endswith("bias") or "adaLN_modulation" in name or name.startswith("final_layer.linear."):
            return value
        if name == "g_embedder.mlp.2.weight":  # zero: the guidance input adds nothing until it is trained
            return value
        if name in ("y_embedder.embedding_table.weight", "t_embedder.mlp.0.weight", "t_embedder.mlp.2.weight",
                    "g_embedder.mlp.0.weight"):
            return nn.init.normal_(value, std=0.02, generator=generator)
        nn.init.xavier_uniform_(value.view(shape[0], -1), generator=generator)
        return value

    # ---- tokens <-> pixels -----------------------------------------------------------------------------------------
    def patchify(self, x: Tensor) -> Tensor:
        """(B, C, [T,] H, W) -> (B, N, patch_volume * C), the layout of the model's output tokens."""
        grid, patch = self.x_embedder.grid(x), self.x_embedder.patch_shape
        batch, channels = x.shape[:2]
        # split every spatial axis into (grid, patch): (B, C, g0, p0, g1, p1, ...)
        x = x.reshape(batch, channels, *[n for pair in zip(grid, patch) for n in pair])
        dims = len(grid)
        order = [0, *range(2, 2 + 2 * dims, 2), *range(3, 3 + 2 * dims, 2), 1]  # (B, g..., p..., C)
        return x.permute(order).reshape(batch, math.prod(grid), math.prod(patch) * channels)

    def unpatchify(self, tokens: Tensor, grid: tuple[int, ...], channels: int | None = None) -> Tensor:
        """(B, N, patch_volume * C) -> (B, C, [T,] H, W); the inverse of ``patchify``."""
        channels = channels or self.out_channels
        patch = self.x_embedder.patch_shape
        batch, dims = tokens.shape[0], len(grid)
        x = tokens.reshape(batch, *grid, *patch, channels)  # (B, g..., p..., C)
        order = [0, 1 + 2 * dims, *[i for d in range(dims) for i in (1 + d, 1 + dims + d)]]  # (B, C, g0, p0, ...)
        return x.permute(order).reshape(batch, channels, *[g * p for g, p in zip(grid, patch)])

    def position_embedding(self, grid: tuple[int, ...]) -> Tensor:
        if grid == self.default_grid:
            return self.pos_embed
        return _cached_pos_embed(self.pos_embed.shape[-1], grid).to(self.pos_embed.device)

    # ---- forward ----------------------------------------------------------------------------------------------------
    def forward(self, x: Tensor, t: Tensor, y: Tensor, drop_labels: Tensor | None = None,
                guidance: Tensor | None = None) -> Tensor:
        """(B, C, [T,] H, W) -> (B, out_channels, [T,] H, W).

        t: (B,) timesteps in the embedder's scale (0..1000); y: (B,) labels; drop_labels: (B,) bool, True where the
        label is replaced by the null class (classifier-free guidance training); guidance: (B,) guidance scales of a
        model with a guidance input (None: ``self.guidance`` for every sample).
        """
        grid = self.x_embedder.grid(x)
        x = x.to(self.pos_embed.dtype)  # float32 noise into a float64 model (trainer.precision=64-true), as diffusers'
        # transformers take their latents; a no-op otherwise
        tokens = self.x_embedder(x) + self.position_embedding(grid)  # (B, N, D)
        c = self.t_embedder(t) + self.y_embedder(y, drop_labels)  # (B, D)
        if self.g_embedder is not None:  # x 1000 into the timestep features' range, as Flux's guidance embedding
            scales = guidance if guidance is not None else t.new_full((x.shape[0],), self.guidance)
            c = c + self.g_embedder(scales.to(t.device).float() * 1000)
        for block in self.blocks:  # the checkpointed ones recompute in backward (ringdit.models.checkpointing)
            tokens = block(tokens, c)
        return self.unpatchify(self.final_layer(tokens, c), grid)  # (B, N, patch_volume * out_channels) -> pixels

    @classmethod
    def config_for_data(cls, config: dict, data: dict) -> dict:
        """``config`` with the data's channels, size and classes (``data``: what the data module describes); a value
        the config sets must agree with the data's."""
        if data.get("conditioning") == "text":
            raise ConfigError("the data is text-conditioned (data=text_latents) but the model is the class-conditional "
                              "DiT; use a text-to-video / text-to-image model: model=wan_tiny, model=wan ...")
        video_data, video_model = len(data["image_size"]) == 3, config.get("temporal_patch_size") is not None
        if video_data != video_model:
            raise ConfigError(
                f"the data gives {'videos (T, H, W)' if video_data else 'images (H, W)'} = {list(data['image_size'])} "
                f"but the model is {'a video' if video_model else 'an image'} model; "
                + ("use a video model: model=dit_video, or set model.temporal_patch_size" if video_data
                   else "use an image model (model.temporal_patch_size=null) or video data")
            )
        config = dict(config)
        from_data = {"in_channels": data["channels"], "input_size": list(data["image_size"]),
                     "num_classes": data["num_classes"]}
        for key, value in from_data.items():
            given = config.get(key)
            if given is not None and given != value and not (key == "input_size" and [given] * 2 == value):
                raise ConfigError(f"model.{key}={given!r} does not match the data ({value!r}); leave it unset")
            config[key] = value
        return config

    @property
    def patch_shape(self) -> tuple[int, ...]:
        return self.x_embedder.patch_shape

    @property
    def teacache_size(self) -> tuple[int, int]:
        """(width, depth): what TeaCache coefficients are fitted to, beside ``kind_name``."""
        return int(self.pos_embed.shape[-1]), len(self.blocks)

    @classmethod
    def kind_name_of(cls, config: dict) -> str:
        """``kind_name`` of a model of ``config``, before it is built."""
        return cls.kind_name

    @staticmethod
    def patch_shape_of(config: dict) -> tuple[int, ...]:
        """The patch a model of ``config`` will have, before it is built: ([T,] H, W) data cells per token."""
        patch, temporal = int(config.get("patch_size", 2)), config.get("temporal_patch_size")
        return (patch, patch) if temporal is None else (int(temporal), patch, patch)

    max_grid = None  # its sin-cos position embedding is computed for any grid
    loss_reaches_every_parameter = True  # DDP needs no search for parameters without a gradient
    diffusers_folders = False  # its weights are ringdit's (.ckpt, .safetensors), never a diffusers folder

    # ---- what the DiT declares as a model kind (ringdit.models.protocol.DiffusionModel), read from a config -------

    @classmethod
    def planned_data(cls, config: dict, data: dict) -> dict:
        """What ``python -m ringdit.plan`` lays out for a model of ``config`` on its ``data`` settings: its ``patch``,
        whether it is a ``video`` model, the ``vae_factors`` sizes in pixels go through, and the ``data`` description
        (``config_for_data``'s) but the shape: channels (4 on latents, SD's VAE; 3 on pixels) and classes."""
        video = config.get("temporal_patch_size") is not None
        patch = (config.get("temporal_patch_size"),) * video + (config.get("patch_size", 2),) * 2
        channels = data.get("channels") or (4 if data.get("latent") else 3)
        return {"patch": patch, "video": video, "vae_factors": cls.vae_factors,
                "data": {"channels": channels, "num_classes": data.get("num_classes")}}

    @staticmethod
    def frame_rate(config: dict) -> int | None:
        """The frame rate a video DiT's samples play at: the digits demos' 16 fps (their clips have no rate of their
        own); None for an image DiT."""
        return DIGITS_FPS if config.get("temporal_patch_size") is not None else None

    @staticmethod
    def sampling_defaults(config: dict) -> dict:
        """The flow objective's settings a run leaves unset: Flux's resolution-shift constants, no terminal stretch."""
        return {"resolution": None, "shift_terminal": None}

    @staticmethod
    def image_conditioning(config: dict) -> tuple[str | None, str | None]:
        """The DiT takes no first frame: class-conditional."""
        return None, None

    @staticmethod
    def check_guidance(config: dict, sampling: dict, prefix: str = "") -> None:
        """The DiT has no guidance embedding unless ``guidance_embed`` (its scale is then ``model.guidance``), and
        classifier-free guidance needs the null class it learnt only where it was trained with label dropout."""
        check_guidance_scale(sampling.get("guidance"))
        if sampling.get("guidance") is not None and not config.get("guidance_embed"):
            raise ConfigError(f"model.guidance={sampling['guidance']!r} is the guidance embedding's value of a "
                              f"guidance-distilled model (Flux-dev); the DiT has none and would ignore it: leave it "
                              f"unset, and set the strength of classifier-free guidance with {prefix}cfg_scale")
        recorded = float(config.get("guidance") or 1.0)
        if sampling.get("guidance") is not None and float(sampling["guidance"]) != recorded:
            # the sampling pipeline hands the scale to a text model's conditioning; the DiT reads it from its config
            raise ConfigError(f"model.guidance={sampling['guidance']!r}: a DiT with a guidance input samples at the "
                              f"scale its run recorded, model.guidance={recorded:g}; leave it unset here, or sample "
                              f"other scales with benchmarks/digits_guidance.py --scales")
        cfg_scale = sampling.get("cfg_scale")
        if cfg_scale is not None and cfg_scale != 1.0 and not config.get("class_dropout_prob", 0.1) > 0:
            raise ConfigError(f"{prefix}cfg_scale={cfg_scale} needs a model trained with label dropout (a null class), "
                              f"but model.class_dropout_prob={config.get('class_dropout_prob')}; use {prefix}cfg_scale=1")

    @property
    def takes_guidance(self) -> bool:
        """Whether the model has a guidance-scale input (``guidance_embed``): what ``diffusion.model_guidance`` trains."""
        return self.g_embedder is not None

    # ---- conditioning: the interface every model ringdit trains shares (``DiffusersTransformer``'s for text) -----
    @property
    def null_label(self) -> int:
        return self.y_embedder.null_label

    @property
    def condition_dropout_prob(self) -> float:
        return self.class_dropout_prob

    def drop_condition(self, labels: Tensor, drop: Tensor) -> Tensor:
        """The labels (B,) with the null class where ``drop`` (B,) is True (classifier-free guidance training)."""
        return torch.where(drop, torch.full_like(labels, self.null_label), labels)

    def null_condition(self, batch: int) -> Tensor:
        """The null class, ``batch`` times: what guidance guides away from."""
        return torch.full((batch,), self.null_label, dtype=torch.long, device=self.pos_embed.device)

    def model_condition(self, labels: Tensor) -> Tensor:
        """What ``forward`` reads of a batch's condition: the labels themselves."""
        return labels


def _input_shape(input_size, video: bool) -> tuple[int, ...]:
    size = (input_size, input_size) if isinstance(input_size, int) else tuple(int(s) for s in input_size)
    expected = 3 if video else 2
    if len(size) != expected:
        what = "(T, H, W) for a video model" if video else "an int or (H, W) for an image model"
        raise ValueError(f"input_size must be {what}, got {input_size!r}")
    return size


def _check_divisible(size: tuple[int, ...], patch: tuple[int, ...]) -> None:
    if any(s % p for s, p in zip(size, patch)):
        raise ValueError(
            f"input_size {size} is not divisible by the patch size {patch}; choose a patch size that divides it"
        )


@lru_cache(maxsize=16)
def _cached_pos_embed(embed_dim: int, grid: tuple[int, ...]) -> Tensor:
    return sincos_pos_embed(embed_dim, grid)
