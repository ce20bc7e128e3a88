"""``Family``: what ringdit knows about one diffusers transformer class -- its ``ParallelPlan``, how its inputs map
onto ringdit's ``(latents, model time, conditioning)``, and its latent geometry. The registry of families is
``ringdit.models.diffusers.families``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ringdit.diffusion.schedulers import PipelineTimesteps
from ringdit.models.block_io import BlockIO
from ringdit.models.diffusers.original_names import Rule
from ringdit.models.parallel_plan import ParallelPlan

Tensor = torch.Tensor


@dataclass(frozen=True)
class ChatTemplate:
    """How a family's pipeline encodes prompts with a chat model (prepare's and infer's ``prompt_template``, which
    names the family; ``ringdit.media.text``)."""

    name: str
    system: str  # the system message
    crop: int  # template tokens before the prompt, cut off (their states are not kept)
    layers: tuple[int, ...]  # ``hidden_states`` indices, joined per token along the features
    masked: bool  # the default of ``masked``: states zeroed after the real tokens, text_mask = the real tokens
    generation_prompt: bool  # apply_chat_template's add_generation_prompt
    model_types: tuple[str, ...] | None  # config.json model_type the pipeline's encoder has (None: not checked)
    glyph: bool = False  # the pipeline also encodes the prompt's quoted text (glyph_encoder: HunyuanVideo 1.5's ByT5)
    # (prompts, system message) -> the chats the pipeline tokenizes, where it formats them its own way (Flux.2's
    # content parts); None: a system and a user message each, an empty prompt as " " (HunyuanVideo 1.5's)
    format: Callable[[list[str], str], list[list[dict]]] | None = None
    # the pipeline's own prompt string around the prompt ("...{}...", the system message in it), tokenized as it is
    # rather than through the tokenizer's chat template (Qwen-Image's prompt_template_encode); None: the chat template
    text: str | None = None
    # the diffusers pipeline that encodes each prompt together with its reference image through this encoder
    # (QwenImageEditPipeline: ringdit.media.edit_prompt reads its prompt string and crop from that pipeline's code);
    # None: the prompt alone
    edit_pipeline: str | None = None

    def messages(self, prompts: list[str]) -> list[list[dict]]:
        """The chats the pipeline tokenizes, one a prompt."""
        if self.format is not None:
            return self.format(list(prompts), self.system)
        return [[{"role": "system", "content": self.system}, {"role": "user", "content": p if p else " "}]
                for p in prompts]


@dataclass(frozen=True)
class Family:
    name: str
    model_class: str  # the diffusers class, e.g. "WanTransformer3DModel"
    plan: ParallelPlan
    forward: Callable[[nn.Module, Tensor, Tensor, dict], Tensor]
    video: bool  # latents (B, C, T, H, W) rather than (B, C, H, W)
    # the VAE its pipeline pairs it with: (video frames per latent frame after the first, or None for images; pixels per
    # latent cell), what python -m ringdit.plan turns pixel sizes into latent shapes with
    vae_factors: tuple[int | None, int]
    condition_keys: tuple[str, ...]  # the conditioning tensors the model reads (data=text_latents provides them)
    text_dim: str  # the config key of the text embedding width
    pooled_dim: str | None = None  # the config key of the pooled text embedding width, if the model takes one
    # the config key of the glyph text width (HunyuanVideo 1.5's ByT5 states of the prompt's quoted text: the data's
    # glyph_text / glyph_text_mask), if the model reads glyph text; it reads it only where the data holds it
    glyph_dim: str | None = None
    # the frame rate its videos play at, as its published pipeline writes them (infer.py, the previews and the server
    # write MP4 / GIF at it unless fps= says otherwise); None: an image model
    fps: int | None = None
    # the frames a sample of its published pipeline has by default (its num_frames): what the planner lays out
    # when data.frames is not given; None: an image model
    clip_frames: int | None = None
    # the text tokens its pipeline always pads the prompt to, from the config (CogVideoX: max_text_seq_length, 226);
    # None: the data's own length (the planner's data.text_len)
    text_len: Callable[[dict], int | None] = lambda config: None
    # latent frames padded at the front (copies of the first) to a multiple of this, as its data are prepared and its
    # fine-tuning pads them (CogVideoX 1.5: 2, its temporal patch; ringdit.media.vae); 1: none
    frame_pad: int = 1
    latent_channels: Callable[[dict], int] = lambda config: config["in_channels"]
    # the latent cells one token covers, (T, H, W) or (H, W)
    patch_shape: Callable[[dict], tuple[int, ...]] = lambda config: tuple(config["patch_size"])
    # image-to-video: "first_frame" (the clean first latent frame replaces the noisy one, per-token timesteps; Wan 2.2
    # TI2V), "channels" (the first frame's latents and a mask concatenated to the input channels; Wan 2.1 I2V) or
    # "first_frame_channels" (the image's latents in the first latent frame and a 1-channel mask concatenated;
    # HunyuanVideo 1.5 I2V); None: text only. See ringdit.models.diffusers.image_to_video.
    image_condition: str | None = None
    # the config key of the width of the image embeddings the model reads (the data's image_embeds: Wan 2.1 I2V's CLIP
    # states where its config sets image_dim, HunyuanVideo 1.5 I2V's SigLIP states); None, or the key unset in the
    # config: the model reads none
    image_embeds: str | None = None
    # diffusion.objective.shift=resolution's constants (ringdit.diffusion.resolution_shift's keywords) where the
    # family's pipeline has its own (its scheduler's base / max image_seq_len and shift, or Flux.2's rule); None: Flux's
    resolution_shift: dict | None = None
    # diffusion.sampling.shift_terminal's default: the last non-zero sampling time, where the family's scheduler
    # config stretches its sigmas to one (its shift_terminal); None: no stretch
    shift_terminal: float | None = None
    # the largest token grid ([T,] H, W) its position embedding covers, from the config (Wan's RoPE table has
    # rope_max_seq_len positions per axis: a longer axis fails inside the model); None: any grid
    max_grid: Callable[[dict], tuple[int, ...]] | None = None
    # how the family's diffusers pipeline sets and steps its scheduler (sampler=flow_euler / unipc / dpmpp step it
    # the same way); the default is WanPipeline's: set_timesteps(steps)
    pipeline_timesteps: PipelineTimesteps = PipelineTimesteps()
    # LoRA's default targets (module-name suffixes, peft's rule): every attention projection
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    # LoRA files by the model's original layer names (ComfyUI's, format=comfyui, read both ways): the rules from
    # diffusers' layer names to them (ringdit.models.diffusers.original_names) and the (down, up) key names; ():
    # the family's adapters have diffusers' names only
    original_lora_names: tuple[Rule, ...] = ()
    original_lora_keys: tuple[str, str] = ("lora_down", "lora_up")
    # the diffusers pipeline classes whose folders ringdit samples as published (ckpt_path=<pipeline folder>: their
    # defaults and scheduler, ringdit.spec.pipeline_folder); () for a family sampled only from ringdit runs
    pipelines: tuple[str, ...] = ()
    # the step cache (ringdit.caching): where a block's token streams are, when diffusers' TransformerBlockRegistry
    # does not say it; None: the registry's
    cache_blocks: BlockIO | None = None
    # TeaCache's probe: (first block, its BlockIO, args, kwargs) -> (its timestep-modulated input, whether that is a
    # (B, S_local, ...) token shard); None: cache=teacache is refused for the family
    teacache_input: Callable | None = None
    # TeaCache's published rescaling polynomials (numpy.polyfit order, highest degree first) for the family's
    # published sizes, keyed by the transformer's (width, depth); cache=teacache on another size fits its own
    # (python -m ringdit.caching calibrate)
    teacache_coefficients: Mapping[tuple[int, int], tuple[float, ...]] = field(default_factory=dict, hash=False)
    # its pipeline's chat template around the prompt (prompt_template=<family>), its constants read from diffusers'
    # own code when called, so that they cannot drift; None: the text encoder takes the prompt as it is (T5, UMT5)
    chat_template: Callable[[], ChatTemplate] | None = None
    # further prompt_template= names its pipelines encode prompts by, beyond the family's own name (Qwen-Image-Edit's
    # qwenimage_edit_plus: QwenImageEditPlusPipeline's prompt with its picture); {}: none
    chat_variants: Mapping[str, Callable[[], ChatTemplate]] = field(default_factory=dict, hash=False)
    # the config.json model_type of the text encoder whose states the pipeline runs through its text connectors
    # (connectors/ beside text_encoder/: LTX-2's Gemma 3 -> its video and audio prompt states; prompt_template=<the
    # family's name>, ringdit.media.text_connectors); None: no connectors
    text_connectors: str | None = None
    # the diffusers scheduler class its pipeline steps where that is none of the flow samplers' (MiniMax-H3's
    # MiniMaxH3Scheduler, in its own time conventions): sampler=<family name> steps it (ringdit.diffusion.schedulers);
    # None: the family samples with the generic ones (flow_euler, unipc, dpmpp)
    scheduler: str | None = None
    # conditioning keys of latents the model denoises together with the video (LTX-2's ``audio``): training noises
    # each at the sample's time and adds its own mean squared error; the forward then returns ``(prediction,
    # {key: its prediction})``. (): the model predicts the latents ``x`` alone
    joint_latents: tuple[str, ...] = ()
    # (config, the video latents' shape ([T,] H, W)) -> {key: one sample's shape} of each joint latent a sample of that
    # video has (LTX-2's audio: its frames follow the clip's duration), what sampling draws its noise in
    joint_shapes: Callable[[dict, tuple[int, ...]], dict[str, tuple[int, ...]]] | None = None
    # (channels, features) of one frame of the audio latents (N, channels, L, features) a model of this config takes,
    # what a refusal of data without audio advises (data.audio=[channels, frames, features]); None: LTX-2's audio VAE
    # (channels x mel bins = audio_in_channels, 16 bins from 128 channels up)
    audio_frame: Callable[[dict], tuple[int, int]] | None = None
    # the audio latents a second its sound is timed at (MiniMax-H3's 40); prepared audio whose VAE gives another rate
    # (its ``audio_vae`` record: sample_rate / hop_length) is refused; None: not checked here (LTX-2's is, by its
    # config's audio_sampling_rate)
    audio_latent_rate: float | None = None
    # installs the family's own attention processors on a freshly built transformer, for a model whose diffusers
    # processors call PyTorch attention directly (ringdit routes diffusers' dispatch_attention_fn only): they must
    # compute what the model's own do (CogVideoX's); None: the model's processors already dispatch
    attention_processors: Callable[[nn.Module], None] | None = None
    # (config, the token grid of the latents ([T,] H, W)) -> {stream: tokens per sample} of each stream its attention
    # sees beside the grid's tokens (Qwen-Image-Edit's reference image, Wan VACE's control video), as its forward
    # builds them: what python -m ringdit.plan counts. A stream ``plan.packed`` names joins every block's sequence;
    # another runs through the blocks its plan cuts it for (VACE's). {}: the grid's tokens are the whole sequence
    stream_tokens: Callable[[dict, tuple[int, ...]], dict[str, int]] = lambda config, grid: {}

    def __deepcopy__(self, memo) -> Family:
        # a shared immutable record: a deep copy of a model (LoRA's meta checks copy one) keeps it, and need not copy
        # its read-only tables (a MappingProxyType cannot be copied)
        return self
