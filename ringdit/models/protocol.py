"""``DiffusionModel``: what a model needs to be trained and sampled by ringdit -- the whole contract of a model kind.

A new model kind (or diffusers family) is its single-device module with these members, plus a preset in
``conf/model/``; ``ringdit.models.build.build_model`` and ``DiffusionModule`` need nothing else of it. It inherits
``KindDefaults`` (as the DiT and ``DiffusersTransformer`` do), whose members answer for a kind without experts, joint
latents, a given first frame or diffusers folders; code outside ``ringdit/models/`` calls every member plainly and
never asks whether a model has one (``tests/test_kind_records.py``). Optional, asked only inside ``ringdit/models/``:
``initial_value(name, shape, generator)`` (the initial value of a parameter whose module has no
``reset_parameters``, or that the model initialises its own way: ``ringdit.models.materialize``),
``pretrained_files(folder)`` (``{key prefix: safetensors files}``) and ``pretrained`` (weights from a diffusers
folder: ``init_from=<folder>``, ``model.pretrained``) and ``set_null_condition(null)`` (text conditioning: the empty
prompt's embedding, from the data). Its constructor must work with its parameters on the meta device (it is built
so, then materialized shard by shard). Checkpoints may name its class once it is allowed
(``ringdit.common.safe_config.allow_target``).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from ringdit.common.errors import ConfigError
from ringdit.diffusion.schedulers import PipelineTimesteps
from ringdit.models.block_io import BlockIO
from ringdit.models.parallel_plan import ParallelPlan

Tensor = torch.Tensor
Condition = Any  # class labels (B,), or a dict of batch-first tensors (text embeddings, masks, ...)


class DiffusionModel(Protocol):
    parallel_plan: ParallelPlan  # where it splits, gathers and attends sequence-parallel (ringdit.models.parallel_plan)
    in_channels: int  # channels of the data it denoises
    default_grid: tuple[int, ...]  # its token grid for the data's (most frequent) shape
    # {stream: tokens per sample} its attention sees beside that grid's tokens (a reference image, a control video);
    # {}: none. A stream its parallel plan packs after the tokens (``packed``) joins every block's sequence
    stream_tokens: dict[str, int]
    patch_shape: tuple[int, ...]  # the data cells one token covers, ([T,] H, W): any shape divisible by it works
    max_grid: tuple[int, ...] | None  # the largest token grid its position embedding covers per axis; None: any
    condition_dropout_prob: float  # the chance training replaces a sample's condition by the null one
    loss_reaches_every_parameter: bool  # False: DDP learns which parameters get no gradient (static_graph)
    diffusers_folders: bool  # its weights load from (base=, init_from=) and export to diffusers folders
    # its kind's facts that code outside ringdit/models asks the model for (a diffusers model answers from its
    # ``Family`` record, the DiT from its class), never by testing which kind it is
    kind_name: str  # "dit", or the diffusers family's name: what checkpoints, TeaCache files and ComfyUI names key on
    cache_blocks: BlockIO | None  # the step cache: its blocks' token streams; None: diffusers' block registry's
    # TeaCache's probe of the first block: (block, BlockIO, args, kwargs) -> (its timestep-modulated input, whether it
    # is a token shard); None: cache=teacache is refused
    teacache_input: Callable | None
    teacache_size: tuple[int, int]  # (width, depth): what TeaCache coefficients are fitted to
    published_teacache_coefficients: tuple[float, ...] | None  # TeaCache's published polynomial at this size
    pipeline_timesteps: PipelineTimesteps  # how its pipeline sets and steps a diffusers scheduler
    lora_targets: tuple[str, ...]  # the module-name suffixes LoRA adapts when lora.targets names none
    # the members KindDefaults answers for most kinds (see there)
    experts: tuple[str, ...]
    expert_modules: tuple[torch.nn.Module, ...]
    joint_latents: tuple[str, ...]
    text_tokens: int
    architecture: dict | None
    takes_guidance: bool

    @classmethod
    def config_for_data(cls, config: dict, data: dict) -> dict:
        """Its config (``_target_`` and settings) with what the data module describes filled in: channels, shape,
        classes or text embedding shape; a ConfigError where the data does not fit the model."""

    @classmethod
    def planned_data(cls, config: dict, data: dict) -> dict:
        """What ``python -m ringdit.plan`` needs of the kind on the planner's ``data`` settings: ``patch``,
        ``video``, ``vae_factors``, ``clip_frames`` where the kind has a default clip length, and the ``data``
        description ``config_for_data`` takes, but the shape."""

    @staticmethod
    def sampling_defaults(config: dict) -> dict:
        """The flow objective's settings a run leaves unset, as the kind's pipeline fixes them: ``resolution`` (the
        resolution shift's constants; None: Flux's) and ``shift_terminal`` (the last sampling time; None: none)."""

    @staticmethod
    def frame_rate(config: dict) -> int | None:
        """The frames per second a model of ``config`` makes videos at (its published pipeline's rate): what infer.py,
        the previews and the server write MP4s / GIFs at unless ``fps=`` says otherwise; None for an image model."""

    @staticmethod
    def check_guidance(config: dict, sampling: dict, prefix: str = "") -> None:
        """A ConfigError for guidance a model of ``config`` cannot take: a guidance embedding's value (``guidance``)
        it has no embedding for, classifier-free guidance without a learnt null condition."""

    @staticmethod
    def image_conditioning(config: dict) -> tuple[str | None, str | None]:
        """How a model of ``config`` takes a first frame (image-to-video): (the conditioning, ``Family.image_condition``
        -- None for a text-to-video or class-conditional model; the config key of the image embeddings it reads where
        its config sets one, None for none)."""

    @staticmethod
    def kind_name_of(config: dict) -> str:
        """The ``kind_name`` a model of ``config`` will have, read from the config alone."""

    @staticmethod
    def patch_shape_of(config: dict) -> tuple[int, ...] | None:
        """The ``patch_shape`` a model of ``config`` (``config_for_data``'s) will have, read from the config alone:
        the data's buckets are checked against it before the model is built around the most frequent one."""

    def joint_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """{joint latent key: its per-sample shape} for samples of ``shape`` (``KindDefaults``: none)."""

    def stream_tokens_at(self, grid: tuple[int, ...]) -> dict[str, int]:
        """``stream_tokens`` beside the token ``grid`` (``KindDefaults``: none)."""

    def loss_weights(self, x0: Tensor) -> Tensor | None:
        """Weights (broadcast to ``x0``) of the latents the loss covers; None: all (``KindDefaults``)."""

    def with_condition_frames(self, x: Tensor, condition: Condition) -> Tensor:
        """A finished sample with the given conditioning frames in place (``KindDefaults``: ``x`` unchanged)."""

    def check_pretrained(self, folder: str) -> None:
        """A ConfigError unless the diffusers folder ``folder`` holds this model's architecture (asked where
        ``diffusers_folders`` is true)."""

    def forward(self, x: Tensor, t: Tensor, condition: Condition) -> Tensor:
        """x (B, C, [T,] H, W) noisy data, t (B,) model time -> the prediction (B, C or 2C, [T,] H, W), whole (the
        plan gathers it): 2C when the model also predicts a variance."""

    def drop_condition(self, condition: Condition, drop: Tensor) -> Condition:
        """``condition`` with the null condition where ``drop`` (B,) is True."""

    def null_condition(self, batch: int) -> Condition:
        """The condition guidance guides away from (the null class, the empty prompt), ``batch`` times."""

    def model_condition(self, condition: Condition) -> Condition:
        """What ``forward`` reads of a batch's condition (the data may carry more)."""


class KindDefaults:
    """The contract's members as a kind without them answers: the DiT and ``DiffusersTransformer`` inherit it and
    override what they have, so code outside ``ringdit/models/`` calls them plainly on any model."""

    experts: tuple[str, ...] = ()  # the experts' names, ("high", "low") for a two-expert model (Wan 2.2 A14B)
    expert_modules: tuple[torch.nn.Module, ...] = ()  # their modules, each an FSDP unit; (): one network
    joint_latents: tuple[str, ...] = ()  # condition keys of latents denoised with x (LTX-2's audio); (): none
    text_tokens: int = 0  # text tokens per sample the model was built to read (the glyph text's too); 0: no text
    # the diffusers transformer's config (its architecture); None for a kind whose model config says it (the DiT)
    architecture: dict | None = None
    takes_guidance: bool = False  # it has a guidance-scale input (Flux-dev's guidance embedding, the DiT's g_embedder)
    # set by ringdit.models.parallelize: the forward's token counts and mesh (its SequenceState); None before
    _ringdit_sequence = None

    def joint_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        return {}

    def stream_tokens_at(self, grid: tuple[int, ...]) -> dict[str, int]:
        return {}

    def loss_weights(self, x0: Tensor) -> Tensor | None:
        return None

    def with_condition_frames(self, x: Tensor, condition: Condition) -> Tensor:
        return x

    def check_pretrained(self, folder: str) -> None:
        raise ConfigError(f"{folder} is a folder, but a {self.kind_name} model's weights are a ringdit checkpoint "
                          f"file (.ckpt, .safetensors) or a sharded checkpoint folder; give one of those")
