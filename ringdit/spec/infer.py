"""``InferSpec``: everything a sampling run is, checked once, before any process is spawned.

``InferSpec.from_config(cfg)`` reads infer.py's composed config and the checkpoint's own configs (model, data,
objective, sampling: data, never code -- ``ringdit.common.safe_config``); infer.py builds the trainer, module and sample
requests from the spec alone. The checkpoint is read once and checked against the model built on the meta device;
what the samples are conditioned on (class ids, prompts) is checked against what the model takes, and each sample's
shape (``size`` / ``frames``, a prompt file's per prompt) against the model's patch (``ringdit.sampling.SampleSizes``:
pixels and video frames when the data records its VAE, else the data's cells). An adapter-only
LoRA checkpoint is sampled on its base (``LoraBase``: ``base=``, else the run's init_from / model.pretrained), which
is checked against the adapter the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from ringdit.caching import CacheSettings, teacache_coefficients
from ringdit.caching import check_model as check_cache_model
from ringdit.checkpoints.weights import WEIGHT_CHOICES
from ringdit.checkpoints.lora_formats import LoraFile, lora_file_entries
from ringdit.diffusion.samplers import is_guided
from ringdit.common.errors import ConfigError, require_choice, require_count, require_number, require_seed
from ringdit.media.audio import sampling_audio_vae
from ringdit.media.decode import sampling_vae
from ringdit.media.frames import UnreadableImage, decoded, open_image, upright_size
from ringdit.models.conditioning import AUDIO_KEY, text_conditioned
from ringdit.sampling import FPS_HINT, SampleSizes, frame_rate, patch_shape, read_prompt_file, resolve_labels
from ringdit.spec.control import ControlInput
from ringdit.spec.checkpoint import LoraBase, check_weights_file, read_weights_file, resolve_sampling_ckpt
from ringdit.spec.diffusion import (check_sampling, check_shift, check_shift_terminal, resolve_scheduler,
                                    resolve_shift_terminal)
from ringdit.parallel.layout import Layout
from ringdit.spec.model import ModelSpec, kind_name, model_class
from ringdit.spec.pipeline_folder import is_pipeline_folder, pipeline_checkpoint
from ringdit.spec.trainer import TrainerSpec, group_targets

if TYPE_CHECKING:
    from ringdit.sampling import SampleSizes

SAMPLING_PREFIX = "diffusion.sampling."  # infer.py's sampler settings carry train.py's names
TEXT_SETTINGS = ("prompts", "prompt_file", "negative_prompt", "text_embeds", "negative_text_embeds", "text_encoder",
                 "tokenizer")


PROMPTS_FORM = "'prompts=[\"a red fox, running in the snow\", \"a cat\"]'"  # each prompt quoted: no comma splits it


def check_prompt_list(prompts, overrides: list[str] | None = None) -> None:
    """Hydra splits ``prompts=[a red fox, running in the snow]`` at the comma, into two prompts: a list of several
    prompts of which any is unquoted is refused, pointing to the quoted form that cannot split (``PROMPTS_FORM``).
    ``prompts``: the setting's value, which the override must have made; ``overrides``: the command line's (default:
    Hydra's record of them; none for a config composed by hand)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import QuotedString

    if overrides is None:
        from hydra.core.hydra_config import HydraConfig

        try:
            overrides = list(HydraConfig.get().overrides.task)
        except ValueError:  # not composed by Hydra: nothing says how the list was written
            return
    for raw in overrides:
        if raw.lstrip("+~").split("=", 1)[0] != "prompts":
            continue
        value = OverridesParser.create().parse_overrides([raw])[0]._value  # as written: quoted items stay marked
        if isinstance(value, list) and len(value) > 1 and not all(isinstance(v, QuotedString) for v in value):
            items = [str(v.text if isinstance(v, QuotedString) else v) for v in value]
            if OmegaConf.is_list(prompts) and items != [str(p) for p in prompts]:  # another config's record
                return
            one = ", ".join(items).replace('"', '\\"')
            many = ", ".join('"' + item.replace('"', '\\"') + '"' for item in items)
            raise ConfigError(f"{raw.lstrip('+~')}: Hydra splits an unquoted list at every comma, so this is "
                              f"{len(items)} prompts ({' | '.join(items)}); quote each prompt: 'prompts=[\"{one}\"]' "
                              f"for one prompt, 'prompts=[{many}]' for {len(items)}")


@dataclass(frozen=True)
class Conditioning:
    """What the samples are conditioned on: a class id each (a class-conditional model), or prompts (a text model)."""

    labels: tuple[int, ...] | None = None  # class-conditional: one id per sample
    prompts: tuple[str, ...] = ()          # text to encode, cycled over the samples
    negative_prompt: str | None = None     # text to encode; None: the empty prompt, as trained
    text_embeds: str | None = None         # a .safetensors of encoded prompts; None (and no prompts): held-out ones
    negative_text_embeds: str | None = None
    text_encoder: str | None = None        # for prompts / negative_prompt: given, else the data's own encoder
    tokenizer: str | None = None
    prompt_file: str | None = None         # where ``prompts`` came from (a .jsonl / .txt file), when they did
    prompt_shapes: tuple[tuple[int, ...], ...] = ()   # prompt_file: each prompt's sample shape (in the data's cells)
    negative_prompts: tuple[str | None, ...] = ()    # prompt_file: each prompt's own negative prompt (None: the run's)

    @classmethod
    def from_config(cls, cfg: DictConfig, data_info: dict, *, ckpt_path: str, num_samples: int,
                    sizes: SampleSizes | None = None) -> Conditioning:
        if not text_conditioned(data_info):
            given = [key for key in TEXT_SETTINGS if cfg.get(key)]
            if given:  # a class-conditional model has no text input: prompts would be ignored, not followed
                raise ConfigError(f"{', '.join(f'{key}={cfg[key]}' for key in given)}: ckpt_path={ckpt_path} is a "
                                  f"class-conditional model, which takes no text; choose classes with labels=[...] "
                                  f"(ids or names), or sample a text-conditioned checkpoint (model=wan, flux, "
                                  f"qwenimage)")

            labels = OmegaConf.to_container(cfg.labels) if OmegaConf.is_list(cfg.labels) else cfg.labels
            return cls(labels=tuple(resolve_labels(labels, num_samples, data_info)))
        if cfg.labels is not None:
            raise ConfigError("labels are for class-conditional models; this model is text-conditioned: give prompt "
                              "embeddings with text_embeds=<file> (or none for the training data's held-out prompts)")
        if cfg.prompts and cfg.text_embeds:
            raise ConfigError("give prompts= (text to encode) or text_embeds= (encoded prompts), not both")
        prompt_file = cfg.get("prompt_file")
        for other in ("prompts", "text_embeds"):
            if prompt_file and cfg.get(other):
                raise ConfigError(f"give prompt_file= (prompts with their own sizes) or {other}=, not both: "
                                  f"prompt_file={prompt_file}, {other}={cfg[other]}")
        if cfg.negative_prompt and cfg.negative_text_embeds:
            raise ConfigError("give negative_prompt= (text to encode) or negative_text_embeds= (encoded), not both")
        prepared = data_info.get("text_encoder") or {}
        encoder = cfg.text_encoder or prepared.get("path")
        if (cfg.prompts or prompt_file or cfg.negative_prompt) and not encoder:
            raise ConfigError("prompts / prompt_file / negative_prompt need a text encoder: pass text_encoder=FOLDER "
                              "(the T5 / UMT5 / CLIP folder the training data was encoded with), or give text_embeds= "
                              "instead")
        check_prompt_list(cfg.prompts)
        prompts = () if not cfg.prompts else (cfg.prompts,) if isinstance(cfg.prompts, str) else \
            tuple(str(p) for p in cfg.prompts)
        file_settings = {}
        if prompt_file:  # each prompt at its own size (default: size / frames, else the data's)

            lines = read_prompt_file(prompt_file)
            if cfg.negative_text_embeds and any(line.negative_prompt for line in lines):
                raise ConfigError(f"prompt_file={prompt_file} gives negative prompts to encode, and "
                                  f"negative_text_embeds= an encoded one: give one of them")
            prompts = tuple(line.prompt for line in lines)
            file_settings = dict(
                prompt_file=str(prompt_file), negative_prompts=tuple(line.negative_prompt for line in lines),
                prompt_shapes=tuple(sizes.shape(line.size if line.size is not None else _plain(cfg.get("size")),
                                                line.frames if line.frames is not None else cfg.get("frames"),
                                                where=line.where) for line in lines))
        return cls(prompts=prompts, negative_prompt=cfg.negative_prompt or None, text_embeds=cfg.text_embeds or None,
                   negative_text_embeds=cfg.negative_text_embeds or None, text_encoder=encoder or None,
                   tokenizer=cfg.tokenizer or (None if cfg.text_encoder else prepared.get("tokenizer")),
                   **file_settings)


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


@dataclass(frozen=True)
class ImageInput:
    """``image=``: the first frames of an image-to-video model's samples, read and checked before anything starts.
    Image i % len(files) conditions sample i (as the prompts are cycled). Each image must have the samples' aspect
    ratio (it is then resized to the samples' size; a different ratio is refused rather than cropped silently)."""

    files: tuple[str, ...]
    kind: str                  # the model's Family.image_condition: "first_frame" | "channels" | "first_frame_channels"
    size: tuple[int, int]      # (H, W) in pixels of the samples
    frames: int                # video frames of the samples
    latent: bool               # encoded with the data's VAE (encode_image_condition), else used as pixels
    image_encoder: str | None  # the image encoder (CLIP, SigLIP) of models that read image embeddings (given, else the
                               # data's)

    @classmethod
    def from_config(cls, cfg: DictConfig, model_config: dict, data_info: dict, *, ckpt_path: str,
                    user_size: tuple[list[int], int | None], conditioning: Conditioning) -> ImageInput | None:
        kind = image_kind(model_config)
        image = cfg.get("image")
        if not image:
            if kind is not None and (conditioning.prompts or conditioning.text_embeds):
                raise ConfigError(f"ckpt_path={ckpt_path} is an image-to-video model (model.family="
                                  f"{kind_name(model_config)}): give the first frame(s) with image=<file or "
                                  f"folder>, or neither prompts nor text_embeds for the training data's held-out "
                                  f"prompts and their first frames")
            return None
        if kind is None:
            raise ConfigError(f"image={image}: ckpt_path={ckpt_path} is not an image-to-video model "
                              f"(model.family={kind_name(model_config)}: it takes no image); leave image= "
                              f"unset, or train an image-to-video model (model=wan22_ti2v*, model=wan_i2v*, "
                              f"model=hunyuan_video15_i2v*)")
        if len(set(conditioning.prompt_shapes)) > 1:
            raise ConfigError(f"image={image} with prompt_file={conditioning.prompt_file} of several sizes: the first "
                              f"frames fit one size; give the prompts one size (or one prompt file per size)")
        (height, width), frames = user_size
        files = image_files(str(image))
        for file in files:
            check_image(file, height, width)
        latent = "vae" in data_info
        prepared = data_info.get("image_encoder") if isinstance(data_info.get("image_encoder"), dict) else {}
        encoder = cfg.get("image_encoder") or prepared.get("path")  # given, else the CLIP the data was prepared with
        embeds = model_class(model_config).image_conditioning(model_config)[1]
        if latent and embeds and not encoder:
            raise ConfigError(f"image={image}: the model takes image embeddings (model.config.{embeds}); give the "
                              f"image encoder folder the data was prepared with, image_encoder=FOLDER")
        return cls(files=tuple(files), kind=kind, size=(height, width), frames=int(frames or 1), latent=latent,
                   image_encoder=encoder)


def image_kind(model_config: dict) -> str | None:
    """The model's first-frame conditioning (the model kind's ``image_conditioning``), None for text-to-video and DiT
    models."""
    return model_class(model_config).image_conditioning(model_config)[0]


def image_files(image: str) -> list[str]:
    """``image=``: one image file, or a folder's images in name order."""
    from pathlib import Path

    path = Path(image).expanduser()
    if path.is_dir():
        files = sorted(str(f) for f in path.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise ConfigError(f"image={image} is a folder without images ({', '.join(IMAGE_SUFFIXES)}); give an image "
                              f"file or a folder of them")
        return files
    if not path.is_file():
        raise ConfigError(f"image={image} does not exist; give an image file or a folder of them")
    return [str(path)]


def check_image(file: str, height: int, width: int) -> None:
    """The image opens and has the samples' aspect ratio (within one pixel of rounding)."""
    try:
        with open_image(file) as opened:
            h, w = upright_size(decoded(opened))  # as it is shown: a phone photo's EXIF rotation applied
    except UnreadableImage as error:
        raise ConfigError(f"image={error}; give a PNG / JPEG / WebP file") from None
    if abs(w * height - h * width) >= max(height, width):  # not the same ratio up to one pixel's rounding
        raise ConfigError(f"image={file} is {w}x{h} (W x H) but the samples are {width}x{height}: a different aspect "
                          f"ratio; crop the image to {width}:{height} (nothing is cropped for you), or sample at "
                          f"size=[H, W] of the image's ratio")


@dataclass(frozen=True)
class OutputSpec:
    """How the samples are written besides samples.npz: decoded with a VAE (latent models), videos at fps."""

    vae: str | None          # resolved: given, else the VAE the data was prepared with when that folder exists
    vae_subfolder: str | None
    vae_tile: int | None     # spatial tile in pixels for decoding; None: diffusers' default
    fps: int | None          # videos' frames per second: fps=, else the model's own (None: an image model)
    audio_vae: str | None = None  # a model that samples sound (LTX-2): its audio VAE + vocoder folder, checked
    audio_vae_subfolder: str | None = "audio_vae"
    vocoder_subfolder: str = "vocoder"


@dataclass(frozen=True)
class InferSpec:
    seed: int                # sample i starts from noise seeded by (seed, i)
    num_samples: int
    batch_size: int          # samples per forward, per data-parallel rank
    output_dir: str
    layout: Layout
    trainer: TrainerSpec
    ckpt_path: str           # resolved ('last': the newest training run's last.ckpt)
    weights: str             # ema | model
    model: ModelSpec         # the checkpoint's model (a LoRA checkpoint's: built on its base)
    data: dict               # the checkpoint's description of its training data
    objective: dict
    sampling: dict           # the checkpoint's sampling defaults with this run's overrides
    conditioning: Conditioning
    output: OutputSpec
    sizes: SampleSizes       # size / frames <-> the data's cells, for this model's patch
    shape: tuple[int, ...]   # the samples' shape ([T,] H, W) in the data's cells: size / frames, else image_size
    lora: LoraBase | None = None  # an adapter-only LoRA checkpoint: its base, under the adapters of ckpt_path
    cache: CacheSettings = CacheSettings()  # cache=: step caching; teacache's coefficients resolved for this model
    loggers: tuple[dict, ...] = ()  # logger=wandb: the run's written samples logged there (ringdit.training.wandb)
    image: ImageInput | None = None  # image=: an image-to-video model's first frames (None: text-to-video, or the
    # training data's held-out first frames)
    pipeline: bool = False  # ckpt_path is a diffusers pipeline folder, sampled as published (ringdit.spec.pipeline_folder)
    lora_files: tuple[LoraFile, ...] = ()  # lora=[...]: adapter files stacked on the model (ringdit.models.lora)
    control: ControlInput | None = None  # control=: a control-video model's control clip (None: the held-out
    # prompts' own control latents, or a model without one)

    def sample_shapes(self) -> list[tuple[int, ...]]:
        """Each sample's shape: a prompt file's per prompt (cycled, as the prompts are), else ``shape``."""
        shapes = self.conditioning.prompt_shapes
        return [shapes[i % len(shapes)] if shapes else self.shape for i in range(self.num_samples)]

    @classmethod
    def from_config(cls, cfg: DictConfig) -> InferSpec:
        """Check every setting of infer.py's ``cfg`` and the checkpoint; return the run (nothing is spawned)."""
        overrides = sampling_overrides(cfg)
        for key in ("cfg_scale", "cfg_scale_2"):  # cfg_scale=nan gives black images
            require_number(SAMPLING_PREFIX + key, overrides.get(key), optional=True)
        require_number("model.guidance", overrides.get("guidance"), optional=True)  # an embedding's input value
        check_shift(SAMPLING_PREFIX + "shift", overrides.get("shift"))
        check_shift_terminal(SAMPLING_PREFIX + "shift_terminal", overrides.get("shift_terminal"))
        TrainerSpec.check_settings(cfg, training=False)
        ckpt_path = resolve_sampling_ckpt(cfg.ckpt_path, cfg.paths.log_dir)
        require_count("num_samples", cfg.num_samples)
        require_count("batch_size", cfg.batch_size)
        require_seed("seed", cfg.seed)
        require_choice("weights", cfg.weights, WEIGHT_CHOICES)
        require_count("fps", cfg.fps, optional=True, hint=FPS_HINT)  # with or without a VAE: wrong before it is used
        require_count("vae_tile", cfg.vae_tile, optional=True,
                      hint="the VAE's spatial tile size in pixels for decoding, e.g. vae_tile=256")
        cache = CacheSettings.from_config(cfg.get("cache"))
        layout = Layout.from_config(cfg, training=False)
        if cfg.num_samples < layout.dp_degree:  # split over the data-parallel ranks, none repeated: each needs one
            raise ConfigError(f"num_samples={cfg.num_samples} is fewer than the {layout.dp_degree} data-parallel ranks "
                              f"(dp_degree={layout.dp_degree}): each rank needs a sample; use num_samples>="
                              f"{layout.dp_degree} or fewer devices")
        trainer = TrainerSpec.from_config(cfg, training=False)
        pipeline = is_pipeline_folder(ckpt_path)
        if pipeline:  # a diffusers pipeline folder, sampled as published (ringdit.spec.pipeline_folder)
            state, info = None, pipeline_checkpoint(ckpt_path)
        else:  # shapes only (headers, a mapped file): a 14B checkpoint is not read into the launching process
            state, info = read_weights_file("ckpt_path", ckpt_path, prefer=cfg.weights, load_tensors=False)
        missing = [key for key in ("model", "data", "objective") if key not in info]
        if missing:
            raise ConfigError(f"ckpt_path={ckpt_path} does not say which model it holds (no {', '.join(missing)}): "
                              f"sample from a ringdit checkpoint (.ckpt) or export (.safetensors), or fine-tune it "
                              f"first with init_from")
        output = OutputSpec(vae=sampling_vae(cfg.vae, cfg.vae_subfolder, info["data"]), vae_subfolder=cfg.vae_subfolder,
                            vae_tile=cfg.vae_tile, fps=frame_rate("fps", cfg.fps, info["model"]))
        if pipeline and cfg.get("base"):
            raise ConfigError(f"base={cfg.base} is the base model under a LoRA adapter, but ckpt_path={ckpt_path} is a "
                              f"pipeline folder, sampled whole; drop base=")
        lora = None if pipeline else LoraBase.from_checkpoint(ckpt_path, state, info, base=cfg.get("base"))
        if lora is None:
            model, meta_model = ModelSpec.from_config(info["model"], layout.ulysses_degree)
            if not pipeline:  # a folder's weights are checked as the model loads them (diffusers' from_pretrained)
                check_weights_file("ckpt_path", ckpt_path, meta_model, state=state)
        else:
            model, meta_model = lora.model_spec(layout.ulysses_degree)
            lora.check(meta_model, state)

        sizes = SampleSizes.of(info["data"], patch_shape(meta_model), meta_model.max_grid)
        check_cache_model(cache, meta_model)  # blocks the step cache cannot wrap: refused here, not on the ranks
        lora_files = lora_file_entries(cfg.get("lora"), meta_model)  # lora=[...]: read and checked, not yet applied
        if cache.kind == "teacache":  # the polynomial this model needs, found (or refused) before anything starts
            cache = replace(cache, coefficients=teacache_coefficients(cache, meta_model, ckpt_path))
        # the sound's decoder: refused in one line (another sample rate, another model) before anything is sampled
        sound = AUDIO_KEY in meta_model.joint_latents
        output = replace(output, audio_vae=sampling_audio_vae(
            cfg.get("audio_vae"), cfg.get("audio_vae_subfolder", "audio_vae"), cfg.get("vocoder_subfolder", "vocoder"),
            info["data"], dict(meta_model.transformer.config) if sound else None),
            audio_vae_subfolder=cfg.get("audio_vae_subfolder", "audio_vae"),
            vocoder_subfolder=cfg.get("vocoder_subfolder", "vocoder"))
        del state, meta_model
        shape = sizes.shape(_plain(cfg.get("size")), cfg.get("frames"))
        sampling = {**info.get("sampling", {}), **overrides}
        check_sampling(info["model"], info["objective"], sampling, prefix=SAMPLING_PREFIX)
        resolve_shift_terminal(sampling, info["model"], info["objective"])  # a checkpoint of before: the family's
        resolve_scheduler(sampling, info["model"], prefix=SAMPLING_PREFIX)  # sampler=unipc ...: the pipeline folder's scheduler config
        if layout.cfg_parallel and not is_guided(sampling):  # a pair would sample the same videos twice
            raise ConfigError(f"cfg_parallel=true splits classifier-free guidance's two halves over two data-parallel "
                              f"ranks, but this run samples unguided ({SAMPLING_PREFIX}cfg_scale="
                              f"{sampling.get('cfg_scale', 1.0):g}, as a distilled student's few steps do), so each "
                              f"pair would compute the same samples twice; set cfg_parallel=false (the ranks then "
                              f"sample different samples) or {SAMPLING_PREFIX}cfg_scale above 1")
        conditioning = Conditioning.from_config(cfg, info["data"], ckpt_path=ckpt_path, num_samples=cfg.num_samples,
                                                sizes=sizes)
        image_shape = conditioning.prompt_shapes[0] if conditioning.prompt_shapes else shape  # one size (checked)
        image = ImageInput.from_config(cfg, info["model"], info["data"], ckpt_path=ckpt_path,
                                       user_size=sizes.user_size(image_shape), conditioning=conditioning)
        control = ControlInput.from_config(cfg, info["model"], info["data"], ckpt_path=ckpt_path, vae=output.vae,
                                           user_size=sizes.user_size(image_shape),
                                           given_prompts=bool(conditioning.prompts or conditioning.text_embeds),
                                           prompt_sizes=len(set(conditioning.prompt_shapes)))
        other = sorted(set(cfg.get("logger") or {}) - {"wandb"})  # the entries logger=<option> selected
        if other:  # the samples are pictures: wandb shows them; a metrics file would hold nothing
            raise ConfigError(f"logger={other[0]}: infer.py logs its samples to wandb only; use logger=wandb or "
                              f"logger=none")
        loggers = group_targets(cfg, "logger")
        return cls(seed=cfg.seed, num_samples=cfg.num_samples, batch_size=cfg.batch_size,
                   output_dir=cfg.paths.output_dir, layout=layout, trainer=trainer, ckpt_path=ckpt_path,
                   weights=cfg.weights, model=model, data=info["data"], objective=info["objective"],
                   sampling=sampling, conditioning=conditioning, output=output, sizes=sizes, shape=shape, lora=lora,
                   cache=cache, image=image, loggers=loggers, pipeline=pipeline, lora_files=lora_files,
                   control=control)


def sampling_overrides(cfg: DictConfig) -> dict:
    """The sampler settings infer.py's ``cfg`` sets (``diffusion.sampling.*``, ``model.guidance``: train.py's names),
    over the checkpoint's; unset (null) ones are left out."""
    sampling = OmegaConf.to_container(OmegaConf.select(cfg, "diffusion.sampling", default=None) or {})
    overrides = {key: value for key, value in sampling.items() if value is not None}
    guidance = OmegaConf.select(cfg, "model.guidance", default=None)
    return overrides if guidance is None else {**overrides, "guidance": guidance}


def _plain(value):
    """A Hydra list (``size=[480,832]``) as a plain list, for the checks and their messages; anything else as is."""
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
