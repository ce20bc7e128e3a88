"""Config-time checks shared by train.py and infer.py.

Everything that can be wrong with the settings is found here, in the launching process, before Lightning spawns
any rank: a typo costs seconds, not a hung cluster. Errors name the setting, the value and what would work.
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

import torch
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

from ringdit.attention import validate_attention_config
from ringdit.errors import ConfigError, require_count, require_number
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
    require_count("trainer.devices", devices)
    require_count("trainer.num_nodes", nodes)
    return devices * nodes


def validate_parallel(cfg: DictConfig, *, training: bool) -> str:
    """Check the degrees, that they match the device count, and the attention backend; return the backend to use.

    The one place the parallel layout is validated: the strategies, the mesh and the models trust it. The layout
    is the settings' dp x ring x ulysses; the processes Lightning starts (trainer.devices per node x
    trainer.num_nodes) must be exactly that many, so that dp_degree is what runs, not a default that the device
    count can silently overrule.
    """
    dp, ring, ulysses = cfg.get("dp_degree", 1), cfg.ring_degree, cfg.ulysses_degree
    require_count("dp_degree", dp)
    check_degrees(ring, ulysses)
    world, layout = world_size(cfg.trainer), dp * ring * ulysses
    if world != layout:
        devices, nodes = cfg.trainer.devices, cfg.trainer.get("num_nodes", 1)
        fix = (f"set dp_degree={world // (ring * ulysses)}" if world % (ring * ulysses) == 0
               else f"choose degrees whose product is {world}")
        raise ConfigError(f"dp_degree x ring_degree x ulysses_degree = {dp} x {ring} x {ulysses} = {layout} ranks, "
                          f"but trainer.devices x trainer.num_nodes = {devices} x {nodes} = {world} processes; {fix}, "
                          f"or leave trainer.devices unset (it defaults to the product, on one node)")
    replicas = dp
    if cfg.get("cfg_parallel") and replicas % 2:
        raise ConfigError(f"cfg_parallel=true runs the two halves of guidance on two data-parallel replicas, so it "
                          f"needs an even number of them, got {replicas}; set dp_degree to an even number (2)")
    replicate = OmegaConf.select(cfg, "trainer.strategy.replicate_degree", default=1)
    require_count("trainer.strategy.replicate_degree", replicate, hint="use 1 to shard over every rank")
    if replicate > 1 and world % replicate:
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
        require_count("model.num_heads", config.get("num_heads", 1))
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


def check_sampling(model_cfg: dict, objective_cfg, sampling: dict, prefix: str = "") -> None:
    """The sampler fits the objective, steps are positive, guidance has a null class to guide with and guides some
    of the model's channels. ``prefix``: where the keys live (train.py's ``diffusion.sampling.``)."""
    from ringdit.diffusion import objectives

    objective = str(objective_cfg["_target_"]).rsplit(".", 1)[-1]
    allowed = getattr(getattr(objectives, objective, None), "samplers", ())  # each objective declares its samplers
    if sampling.get("sampler") is not None and sampling["sampler"] not in allowed:
        raise ConfigError(f"sampler={sampling['sampler']!r} does not fit the {objective} objective; use one of {allowed}")
    if sampling.get("steps") is not None:
        require_count("steps", sampling["steps"])
    timesteps = objective_cfg.get("num_timesteps", 1000) if objective == "DDPM" else None
    if timesteps is not None and sampling.get("steps") is not None and sampling["steps"] > timesteps:
        raise ConfigError(f"{prefix}steps={sampling['steps']} is more than the DDPM schedule's {timesteps} steps; "
                          f"use at most {timesteps}")
    guided, channels = sampling.get("guidance_channels"), model_cfg.get("in_channels")
    if guided is not None and (isinstance(guided, bool) or not isinstance(guided, int) or guided < 1
                               or channels is not None and guided > channels):
        raise ConfigError(f"{prefix}guidance_channels={guided!r} is not a number of the model's {channels} latent "
                          f"channels; use null to guide all of them, or 1..{channels} (3: the original DiT's)")
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


# ---- numbers that Lightning / torch would only reject (or silently misuse) once training has started ---------------


def check_training_settings(cfg: DictConfig) -> None:
    """The numeric settings of a training run, before anything is built: each would otherwise fail only once
    training started (with a traceback, after spawning), or be accepted and quietly do something else."""
    require_number("ema_decay", cfg.ema_decay, low=0, high=1)
    model = cfg.get("model") or {}
    for key in ("hidden_size", "depth"):  # depth=0 would train a model without blocks, and say nothing
        if key in model:
            require_count(f"model.{key}", model[key])
    if "mlp_ratio" in model:
        require_number("model.mlp_ratio", model.mlp_ratio, low=0, low_open=True)
    if "class_dropout_prob" in model:
        require_number("model.class_dropout_prob", model.class_dropout_prob, low=0, high=1)
    if cfg.nonfinite_loss not in ("stop", "skip"):
        raise ConfigError(f"nonfinite_loss must be 'stop' or 'skip', got {cfg.nonfinite_loss!r}")
    optimizer = cfg.get("optimizer") or {}
    if "lr" in optimizer:
        require_number("optimizer.lr", optimizer.lr, low=0)  # 0 is legitimate: evaluate a start, freeze a run
    for key in ("weight_decay", "momentum"):
        if key in optimizer:
            require_number(f"optimizer.{key}", optimizer[key], low=0)
    for i, beta in enumerate(optimizer.get("betas") or []):
        require_number(f"optimizer.betas[{i}]", beta, low=0, high=1)
    scheduler = cfg.get("scheduler") or {}
    if "warmup_steps" in scheduler:
        require_count("scheduler.warmup_steps", scheduler.warmup_steps, minimum=0)
    if "total_steps" in scheduler:
        require_count("scheduler.total_steps", scheduler.total_steps)
    if "final_lr_fraction" in scheduler:
        require_number("scheduler.final_lr_fraction", scheduler.final_lr_fraction, low=0, high=1)
    require_count("data.num_workers", cfg.data.get("num_workers", 0), minimum=0)
    if "val_fraction" in cfg.data:
        require_number("data.val_fraction", cfg.data.val_fraction, low=0, high=1)
    _check_trainer_numbers(cfg.trainer)
    callbacks = cfg.get("callbacks") or {}
    checkpoint = callbacks.get("model_checkpoint") or {}
    if "every_n_train_steps" in checkpoint:
        require_count("callbacks.model_checkpoint.every_n_train_steps", checkpoint.every_n_train_steps, minimum=0,
                      optional=True)
    grid = callbacks.get("sample_grid") or {}
    for key in ("every_n_steps", "per_class", "max_classes"):
        if key in grid:
            require_count(f"callbacks.sample_grid.{key}", grid[key])
    if "steps" in grid:
        require_count("callbacks.sample_grid.steps", grid.steps, optional=True)
    if "cfg_scale" in grid:
        require_number("callbacks.sample_grid.cfg_scale", grid.cfg_scale, optional=True)
    require_number("diffusion.sampling.cfg_scale", cfg.diffusion.sampling.get("cfg_scale"), optional=True)


def _check_trainer_numbers(trainer: DictConfig) -> None:
    strategy = trainer.get("strategy")
    if isinstance(strategy, DictConfig):
        require_number("trainer.strategy.timeout_s", strategy.get("timeout_s"), low=0, low_open=True, optional=True)
        require_number("trainer.strategy.rendezvous_timeout_s", strategy.get("rendezvous_timeout_s"), low=0,
                       low_open=True, optional=True)
    require_count("trainer.accumulate_grad_batches", trainer.get("accumulate_grad_batches", 1))
    require_number("trainer.gradient_clip_val", trainer.get("gradient_clip_val"), low=0, optional=True)
    require_count("trainer.log_every_n_steps", trainer.get("log_every_n_steps", 1), optional=True)
    interval = trainer.get("val_check_interval")
    if isinstance(interval, float):  # a fraction of an epoch
        require_number("trainer.val_check_interval", interval, low=0, high=1, low_open=True)
    else:  # a number of training batches
        require_count("trainer.val_check_interval", interval, optional=True)


def check_infer_settings(cfg: DictConfig) -> None:
    """The numeric settings of a sampling run that nothing else would refuse (cfg_scale=nan gives black images)."""
    require_number("cfg_scale", cfg.get("cfg_scale"), optional=True)
    _check_trainer_numbers(cfg.trainer)


# ---- launches whose other ranks would never come ----------------------------------------------------------------------


def cluster_launcher() -> str | None:
    """The launcher that started this process and will start the other ranks, as Lightning detects them."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")):
        return "torchrun"
    if "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return "SLURM"
    if "LSB_JOBID" in env and "JSM_NAMESPACE_RANK" in env:
        return "LSF"
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        return "MPI"
    if "KUBERNETES_PORT" in env and all(k in env for k in ("MASTER_ADDR", "RANK", "WORLD_SIZE")):
        return "Kubeflow"
    return None


def check_launch_environment(trainer_cfg: DictConfig) -> None:
    """Refuse launches that would wait for ranks nobody starts (the rest is bounded by
    ``trainer.strategy.rendezvous_timeout_s``)."""
    if cluster_launcher() is not None:
        return
    nodes, env = trainer_cfg.get("num_nodes", 1), os.environ
    if nodes > 1 and not ("NODE_RANK" in env and "MASTER_ADDR" in env):
        raise ConfigError(
            f"trainer.num_nodes={nodes} but no cluster launcher started this process (no torchrun, SLURM, MPI "
            f"environment) and NODE_RANK / MASTER_ADDR are not set, so the other nodes' ranks would never join: "
            f"launch with srun or `torchrun --nnodes={nodes} ...` on every node, or set NODE_RANK, MASTER_ADDR and "
            f"MASTER_PORT on each; on one machine use trainer.num_nodes=1 and trainer.devices")
    if "LOCAL_RANK" in env and "WORLD_SIZE" not in env and world_size(trainer_cfg) > 1:
        raise ConfigError(
            f"LOCAL_RANK={env['LOCAL_RANK']} is set in the environment but no launcher started this process (no "
            f"WORLD_SIZE, torchrun or SLURM): Lightning would take it for one rank of an external launch and wait "
            f"for {world_size(trainer_cfg)} ranks that never come; unset LOCAL_RANK (Lightning then starts the ranks "
            f"itself) or launch with torchrun")


def check_samples_per_rank(cfg: DictConfig) -> None:
    """Sampling splits ``num_samples`` over the data-parallel ranks without repeating any; each needs one (call after
    ``validate_parallel``)."""
    replicas = cfg.get("dp_degree", 1)
    if cfg.num_samples < replicas:
        raise ConfigError(f"num_samples={cfg.num_samples} is fewer than the {replicas} data-parallel ranks "
                          f"(dp_degree={cfg.get('dp_degree', 1)}): each rank needs a sample; use num_samples>="
                          f"{replicas} or fewer devices")


def resolve_sampling_ckpt(ckpt_path: str | None, log_dir: str, train_task: str = "train") -> str:
    """infer.py's ``ckpt_path``: ``last`` (the default) -> the newest training run's ``last.ckpt``; a missing run
    says how to make one."""
    if ckpt_path in (None, "", "last"):
        try:
            return resolve_ckpt_path("last", log_dir, train_task)
        except ConfigError:
            raise ConfigError(f"ckpt_path={ckpt_path or 'last'}: no training run under {Path(log_dir, train_task)} "
                              f"(no checkpoints/last.ckpt); train one with `python train.py`, or pass "
                              f"ckpt_path=PATH to a .ckpt or .safetensors") from None
    return ckpt_path
