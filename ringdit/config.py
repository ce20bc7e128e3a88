"""Config-time checks shared by train.py and infer.py.

Everything that can be wrong with the settings is found here, in the launching process, before Lightning spawns
any rank: a typo costs seconds, not a hung cluster. Errors name the setting, the value and what would work.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import secrets
import sys
from pathlib import Path

import torch
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

from ringdit.attention import validate_attention_config
from ringdit.errors import ConfigError
from ringdit.models.diffusers.families import get_family
from ringdit.parallel import check_degrees, check_heads_divisible
from ringdit.weights import (
    LABEL_TABLE,
    CheckpointError,
    check_compatible,
    is_sharded_checkpoint,
    read_weights,
    recover_checkpoint,
    resize_label_embedding,
)

log = logging.getLogger(__name__)


def register_resolvers() -> None:
    """``${mul:a,b,c}``: the product (the default device count dp x ring x ulysses); ``${min:a,b}``;
    ``${run_id:}``: a short random suffix that keeps two runs started in the same second apart (cached per config,
    like Hydra's ``${now:}``, so that a run and the jobs of one sweep see one value)."""
    OmegaConf.register_new_resolver("mul", lambda *xs: math.prod(int(x) for x in xs), replace=True)
    OmegaConf.register_new_resolver("min", lambda *xs: min(int(x) for x in xs), replace=True)
    OmegaConf.register_new_resolver("run_id", lambda: secrets.token_hex(3), use_cache=True, replace=True)


SETTINGS_ERRORS = (ValueError, TypeError, FileNotFoundError, InstantiationException)


@contextlib.contextmanager
def user_errors(*kinds: type[BaseException]):
    """Show an error of ``kinds`` (default: what checking settings raises) as its one-line cause and exit with code
    2; ``HYDRA_FULL_ERROR=1`` shows the traceback. Wrap only the phase where such errors mean a user mistake."""
    try:
        yield
    except kinds or SETTINGS_ERRORS as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        message = str(error).strip()
        if isinstance(error, InstantiationException) and error.__cause__ is not None:
            message = f"{message.splitlines()[0]} {error.__cause__}"
        print(f"Error: {message}\n(set HYDRA_FULL_ERROR=1 for the full traceback)", file=sys.stderr, flush=True)
        sys.exit(2)


def require_positive(setting: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{setting} must be a positive integer, got {value!r}")


def require_seed(setting: str, value) -> None:
    """A seed numpy and Lightning accept: an integer in [0, 2**32 - 1]."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**32 - 1:
        raise ConfigError(f"{setting} must be an integer from 0 to 2**32 - 1 = {2**32 - 1}, got {value!r}")


def require_choice(setting: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{setting} must be one of {' | '.join(map(str, choices))}, got {value!r}")


def device_type(trainer_cfg: DictConfig) -> str:
    accelerator = str(trainer_cfg.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"trainer.accelerator={accelerator} but no CUDA device is visible; use trainer=cpu")
        return "cuda"
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator != "cpu":
        raise ConfigError(f"trainer.accelerator must be auto, cpu or gpu, got {accelerator!r}")
    return "cpu"


def world_size(trainer_cfg: DictConfig) -> int:
    """Processes the trainer will run: devices per node x nodes."""
    devices, nodes = trainer_cfg.get("devices", 1), trainer_cfg.get("num_nodes", 1)
    if devices in ("auto", -1, "-1"):
        devices = torch.cuda.device_count() if device_type(trainer_cfg) == "cuda" else 1
    elif isinstance(devices, str) and "," in devices:
        devices = len([d for d in devices.split(",") if d.strip()])
    elif OmegaConf.is_list(devices) or isinstance(devices, (list, tuple)):
        devices = len(devices)
    try:
        devices = int(devices)
    except (TypeError, ValueError):
        raise ConfigError(f"trainer.devices must be a count, a list of ids or 'auto', got {devices!r}") from None
    require_positive("trainer.devices", devices)
    require_positive("trainer.num_nodes", nodes)
    return devices * nodes


def validate_parallel(cfg: DictConfig, *, training: bool) -> str:
    """Check degrees, world size and attention backend; return the backend to use."""
    check_degrees(cfg.ring_degree, cfg.ulysses_degree)
    world = world_size(cfg.trainer)
    try:
        check_degrees(cfg.ring_degree, cfg.ulysses_degree, world)
    except ValueError as error:
        raise ConfigError(f"{error} (trainer.devices={cfg.trainer.devices}, trainer.num_nodes={cfg.trainer.num_nodes})") from None
    replicate = OmegaConf.select(cfg, "trainer.strategy.replicate_degree", default=1)
    if isinstance(replicate, int) and replicate > 1 and world % replicate:
        raise ConfigError(f"trainer.strategy.replicate_degree={replicate} does not divide the world size {world} "
                          f"(HSDP shards within world / replicate_degree ranks); use a divisor of {world}, e.g. the dp_degree "
                          f"to shard within each sequence-parallel group and replicate across them")
    return validate_attention_config(
        cfg.attention_backend, ring_degree=cfg.ring_degree, training=training, device_type=device_type(cfg.trainer)
    )


def is_diffusers_model(config: dict) -> bool:
    """A diffusers transformer (``model=wan`` ...) rather than ringdit's own DiT."""
    return "family" in config


def model_config(model_cfg: DictConfig | dict, data_info: dict) -> dict:
    """The model config with the data's shape filled in: channels, size and classes (DiT), or channels, latent shape
    and text embedding shape (diffusers models)."""
    config = OmegaConf.to_container(model_cfg, resolve=True) if isinstance(model_cfg, DictConfig) else dict(model_cfg)
    text_data = data_info.get("conditioning") == "text"
    if is_diffusers_model(config):
        if not text_data:
            raise ConfigError(f"model.family={config['family']} is conditioned on text, but the data gives class "
                              f"labels; use data=text_latents (or data=synthetic_text_latents)")
        video_data, family = len(data_info["image_size"]) == 3, get_family(config["family"])
        if video_data != family.video:
            raise ConfigError(f"the data gives {'videos (T, H, W)' if video_data else 'images (H, W)'} = "
                              f"{list(data_info['image_size'])} but model.family={family.name} is a "
                              f"{'video' if family.video else 'image'} model")
        if family.pooled_dim is not None and not data_info.get("pooled_dim"):
            raise ConfigError(f"model.family={family.name} takes a pooled text embedding, but the data has none; "
                              f"encode the captions with the model's pooled text encoder too (text_latents 'pooled')")
        return {**config, "input_size": list(data_info["image_size"]), "in_channels": data_info["channels"],
                "text_len": data_info["text_len"], "text_dim": data_info["text_dim"],
                "pooled_dim": data_info.get("pooled_dim")}
    if text_data:
        raise ConfigError("the data is text-conditioned (data=text_latents) but the model is the class-conditional "
                          "DiT; use a text-to-video / text-to-image model: model=wan_tiny, model=wan ...")
    video_data, video_model = len(data_info["image_size"]) == 3, config.get("temporal_patch_size") is not None
    if video_data != video_model:
        raise ConfigError(
            f"the data gives {'videos (T, H, W)' if video_data else 'images (H, W)'} = {list(data_info['image_size'])} "
            f"but the model is {'a video' if video_model else 'an image'} model; "
            + ("use a video model: model=dit_video, or set model.temporal_patch_size" if video_data
               else "use an image model (model.temporal_patch_size=null) or video data")
        )
    from_data = {"in_channels": data_info["channels"], "input_size": list(data_info["image_size"]),
                 "num_classes": data_info["num_classes"]}
    for key, value in from_data.items():
        given = config.get(key)
        if given is not None and given != value and not (key == "input_size" and [given] * 2 == value):
            raise ConfigError(f"model.{key}={given!r} does not match the data ({value!r}); leave it unset")
        config[key] = value
    return config


def build_on_meta(config: dict, ulysses_degree: int = 1):
    """Instantiate the model without memory to check its settings (sizes, heads, patches) before any spawn."""
    import hydra

    if not is_diffusers_model(config):
        require_positive("model.num_heads", config.get("num_heads", 1))
        check_heads_divisible(config.get("num_heads", 16), ulysses_degree)
    with torch.device("meta"):
        try:
            model = hydra.utils.instantiate(config, attention_backend="math")
        except InstantiationException as error:
            if isinstance(error.__cause__, ConfigError):
                raise error.__cause__ from None
            raise ConfigError(f"model: {error.__cause__ or error}") from None
    if is_diffusers_model(config):
        check_heads_divisible(model.transformer.config.num_attention_heads, ulysses_degree)
    return model


def read_weights_file(setting: str, path: str, prefer: str = "ema", load_tensors: bool = True) -> tuple[dict, dict]:
    """``read_weights`` with its errors attributed to the setting that named the file."""
    try:
        return read_weights(path, prefer, load_tensors=load_tensors)
    except CheckpointError as error:
        raise ConfigError(f"{setting}: {error}") from None


def check_weights_file(setting: str, path: str, model, prefer: str = "ema", state: dict | None = None,
                       resize_labels: bool = False) -> None:
    """``path`` exists, is safely readable and fits ``model`` (pass ``state`` if it was read already); for a
    diffusers model, ``path`` may also be a diffusers folder of the same architecture."""
    if state is None and Path(path).expanduser().is_dir() and not is_sharded_checkpoint(path) \
            and hasattr(model, "check_pretrained"):
        model.check_pretrained(str(Path(path).expanduser()))
        return
    if state is None:  # a sharded checkpoint's shapes come from its metadata: nothing is read into memory
        state, _ = read_weights_file(setting, path, prefer, load_tensors=False)
    if resize_labels:
        state = resize_label_embedding(state, model.state_dict()[LABEL_TABLE].shape[0])
    try:
        check_compatible(model, state, source=f"{setting}={path}")
    except CheckpointError as error:
        raise ConfigError(f"{setting}: {error}") from None


def group_targets(cfg: DictConfig, group: str) -> list:
    """The entries of a ``callbacks`` / ``logger`` group; an entry without ``_target_`` is a leftover setting."""
    entries = cfg.get(group) or {}
    for name, entry in entries.items():
        if "_target_" not in entry:
            raise ConfigError(f"{group}.{name} has settings ({', '.join(entry)}) but no _target_: its config was "
                              f"removed (e.g. {group}=none with an experiment that tunes it); drop the settings or "
                              f"keep the {group} config")
    return list(entries.values())


def resolve_shift(objective: dict, sampling: dict, tokens: int) -> None:
    """``diffusion.objective.shift=resolution``: Flux's shift for this many image tokens, for training and sampling."""
    if objective.get("shift") != "resolution":
        if isinstance(objective.get("shift"), str):
            raise ConfigError(f"diffusion.objective.shift must be a number > 0 or 'resolution', got "
                              f"{objective['shift']!r}")
        return
    from ringdit.diffusion import resolution_shift

    objective["shift"] = resolution_shift(tokens)
    log.info("diffusion.objective.shift=resolution: %.4f for %d image tokens", objective["shift"], tokens)
    if sampling.get("shift") in (None, "resolution"):
        sampling["shift"] = objective["shift"]


SAMPLERS = {"FlowMatching": ("euler", "heun"), "DDPM": ("ddim",)}


def check_sampling(model_cfg: dict, objective_cfg, sampling: dict) -> None:
    """The sampler fits the objective, steps are positive, and guidance has a null class to guide with."""
    objective = str(objective_cfg["_target_"]).rsplit(".", 1)[-1]
    allowed = SAMPLERS.get(objective, ())
    if sampling.get("sampler") is not None and sampling["sampler"] not in allowed:
        raise ConfigError(f"sampler={sampling['sampler']!r} does not fit the {objective} objective; use one of {allowed}")
    if sampling.get("steps") is not None:
        require_positive("steps", sampling["steps"])
    cfg_scale = sampling.get("cfg_scale")
    if is_diffusers_model(model_cfg):  # guidance away from the empty or negative prompt: pretrained models learnt it
        return
    if cfg_scale is not None and cfg_scale != 1.0 and not model_cfg.get("class_dropout_prob", 0.1) > 0:
        raise ConfigError(f"cfg_scale={cfg_scale} needs a model trained with label dropout (a null class), but "
                          f"model.class_dropout_prob={model_cfg.get('class_dropout_prob')}; use cfg_scale=1")


def resolve_ckpt_path(ckpt_path: str | None, log_dir: str, task_name: str) -> str | None:
    """``last`` -> the newest ``checkpoints/last.ckpt`` of this task's earlier runs; a path must exist."""
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        root = Path(log_dir, task_name)  # runs/<time>/ and multiruns/<time>/<job>/
        for interrupted in [*root.glob("*/*/checkpoints/.last.ckpt.old"), *root.glob("*/*/*/checkpoints/.last.ckpt.old")]:
            recover_checkpoint(interrupted.with_name("last.ckpt"))
        candidates = [*root.glob("*/*/checkpoints/last.ckpt"), *root.glob("*/*/*/checkpoints/last.ckpt")]
        if not candidates:
            raise ConfigError(f"ckpt_path=last: no checkpoints/last.ckpt under {Path(log_dir, task_name)}; "
                              f"pass the checkpoint's path instead")
        newest = max(candidates, key=lambda p: p.stat().st_mtime)
        log.info("ckpt_path=last resolved to %s", newest)
        return str(newest)
    recover_checkpoint(Path(ckpt_path))
    if not Path(ckpt_path).is_file() and not is_sharded_checkpoint(ckpt_path):
        raise ConfigError(f"ckpt_path={ckpt_path!r} does not exist" + (
            " (a folder, but not a sharded checkpoint: it lacks meta.pt or .metadata)" if Path(ckpt_path).is_dir() else ""))
    return ckpt_path


def check_lora(meta_model, lora: dict) -> None:
    """The LoRA settings are valid and ``lora.targets`` match modules of the model (on a meta copy)."""
    from ringdit.lora import add_lora

    with torch.device("meta"):
        add_lora(copy.deepcopy(meta_model), **lora)  # a copy: the weights files are checked against the plain model


def check_lora_checkpoint(ckpt_path: str) -> None:
    """A LoRA run resumes adapter weights: the checkpoint must hold some (its base weights come from init_from)."""
    from ringdit.lora import adapter_state

    state, _ = read_weights_file("ckpt_path", ckpt_path, prefer="model", load_tensors=False)
    if not adapter_state(state):
        raise ConfigError(f"ckpt_path={ckpt_path} holds no LoRA adapter weights but lora.rank > 0: resume it without "
                          f"LoRA (lora.rank=0), or start LoRA from its weights with init_from={ckpt_path}")
