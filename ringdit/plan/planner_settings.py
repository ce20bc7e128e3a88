"""The planner's settings, each checked (one line naming the setting, the value and a fix): the hardware, the layout's
settings, the run's ``Setup``, and the strategies and memory options left open to search over."""

from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf

from ringdit.attention import list_backends
from ringdit.common.dtypes import dtype_named
from ringdit.common.errors import ConfigError, require_count, require_number
from ringdit.models.checkpointing import checkpoint_fraction
from ringdit.models.lora import check_lora_settings, resolve_base_dtype
from ringdit.parallel.layout import Layout, check_strategy_degrees, strategy_kind
from ringdit.costs import DISTILL_METHODS, GiB, Setup
from ringdit.costs.check import regression_pairs_per_update
from ringdit.plan.search import DEGREES, Hardware, divisors
from ringdit.spec.distill import DistillSpec
from ringdit.training.optimizers import STATES
from ringdit.training.optimizers import optimizer_states as states_of

PRECISIONS = ("32-true", "32", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true", "64")


def preset_name(model_cfg: dict) -> str:
    from hydra.core.hydra_config import HydraConfig

    try:
        return f"model={HydraConfig.get().runtime.choices['model']}"
    except (ValueError, KeyError):
        return model_cfg.get("_target_", "model")


def _positive(setting: str, value, example: str, *, at_most: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0 \
            or (at_most is not None and value > at_most):
        bound = f" and at most {at_most}" if at_most is not None else ""
        raise ConfigError(f"{setting} must be a number above 0{bound}, got {value!r}; e.g. {setting}={example}")
    return float(value)


def _choice(setting: str, value, choices: tuple) -> None:
    """``value`` is one of ``choices`` and of its type (1 is not true, 0.0 not false)."""
    if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
        words = ("null" if c is None else str(c).lower() if isinstance(c, bool) else str(c) for c in choices)
        raise ConfigError(f"{setting} must be one of {' | '.join(words)}, got {value!r}")


def gpu_counts(cfg: DictConfig, fixed: dict[str, int]) -> tuple[int, int]:
    """(gpus, gpus_per_node) from the planner's names or train.py's (``trainer.devices`` per node x
    ``trainer.num_nodes``), which must agree where both are given; none given: as train.py, the product of the
    degrees when all three are ``fixed``, else 8. The ranks fill whole nodes, as train.py runs devices x num_nodes
    processes."""
    gpus, per_node = cfg.gpus, cfg.gpus_per_node
    devices, nodes = cfg.trainer.get("devices"), cfg.trainer.get("num_nodes")
    require_count("gpus", gpus, optional=True, hint="the GPUs to lay out, e.g. gpus=16")
    require_count("gpus_per_node", per_node, optional=True, hint="the GPUs of one node, e.g. gpus_per_node=8")
    require_count("trainer.devices", devices, optional=True, hint="the GPUs of one node, e.g. trainer.devices=8")
    require_count("trainer.num_nodes", nodes, optional=True, hint="e.g. trainer.num_nodes=2")
    if per_node is not None and devices is not None and per_node != devices:
        raise ConfigError(f"gpus_per_node={per_node} and trainer.devices={devices} both name the GPUs of one node; "
                          f"give one of them")
    per_node = per_node or devices
    if nodes is not None:
        if per_node is None:
            per_node = gpus // nodes if gpus and gpus % nodes == 0 else 8
        if gpus is not None and gpus != per_node * nodes:
            raise ConfigError(f"gpus={gpus} but {'trainer.devices' if devices else 'gpus_per_node'} x "
                              f"trainer.num_nodes = {per_node} x {nodes} = {per_node * nodes}; give gpus or "
                              f"trainer.num_nodes, not both")
        gpus = per_node * nodes
    gpus = gpus or devices or (math.prod(fixed.values()) if len(fixed) == len(DEGREES) else 8)
    per_node = per_node or min(gpus, 8)
    if gpus > per_node and gpus % per_node:
        below, above = gpus // per_node * per_node, -(-gpus // per_node) * per_node
        fits = [d for d in divisors(gpus) if d < per_node][-1]
        raise ConfigError(f"gpus={gpus} do not fill whole nodes of gpus_per_node={per_node} (train.py runs "
                          f"trainer.devices x trainer.num_nodes processes); use gpus={below} or gpus={above}, or "
                          f"gpus_per_node={fits}")
    return gpus, min(gpus, per_node)


def fixed_degrees(cfg: DictConfig) -> dict[str, int]:
    """The degrees the settings fix (train.py's names), each a positive integer; null ones are laid out."""
    fixed = {name: cfg.get(name) for name in DEGREES if cfg.get(name) is not None}
    for name, value in fixed.items():
        require_count(name, value, optional=True, hint=f"or null to lay out every {name}")
    check_strategy_degrees(cfg)
    return fixed




def optimizer_states(cfg: DictConfig) -> tuple[int, tuple[bool, ...]]:
    """The optimizer's states per trainable parameter and the 8-bit choices to lay out, from ``optimizer=`` (train.py's
    group) or ``optimizer_states`` / ``optimizer_8bit``, which must agree with it where both are given."""
    states, eight_bit = cfg.optimizer_states, cfg.optimizer_8bit
    require_count("optimizer_states", states, minimum=0, optional=True,
                  hint="AdamW 2, SGD with momentum 1, SGD 0")
    _choice("optimizer_8bit", eight_bit, (None, True, False))
    optimizer = cfg.get("optimizer")
    if optimizer is None:
        return (2 if states is None else states), ((False, True) if eight_bit is None else (eight_bit,))
    target = optimizer.get("_target_")
    if target not in STATES:
        if states is None or eight_bit is None:
            raise ConfigError(f"optimizer._target_={target!r}: the planner knows the states of "
                              f"{', '.join(STATES)}; for another, give optimizer_states=N and optimizer_8bit=false")
        return states, (eight_bit,)
    require_number("optimizer.momentum", optimizer.get("momentum", 0), low=0)
    own_states, own_8bit = states_of(optimizer)
    for setting, given, own in (("optimizer_states", states, own_states), ("optimizer_8bit", eight_bit, own_8bit)):
        if given is not None and given != own:
            raise ConfigError(f"{setting}={str(given).lower()} but optimizer={choice_name('optimizer', target)} "
                              f"keeps {own_states} states per parameter{' in 8 bits' if own_8bit else ''}; drop "
                              f"{setting}= (or choose another optimizer=)")
    return own_states, (own_8bit,)


def choice_name(group: str, target: str) -> str:
    """The option ``group=...`` that was chosen (Hydra's record), else the class it names."""
    from hydra.core.hydra_config import HydraConfig

    try:
        return HydraConfig.get().runtime.choices[group]
    except (ValueError, KeyError):
        return target


def settings(cfg: DictConfig) -> tuple[Hardware, Layout, Setup, tuple[str, ...], tuple, dict[str, tuple],
                                       dict[str, int]]:
    """Every setting but the model's, checked: the hardware, the layout's settings (its degrees and strategy are
    filled in per candidate), the run's setup, the strategies and checkpointed shares to try, the other memory
    options' values to try and the degrees the settings fix (``candidates``)."""
    fixed = fixed_degrees(cfg)
    gpus, per_node = gpu_counts(cfg, fixed)
    memory = _positive("gpu_memory_gb", cfg.gpu_memory_gb, "80")
    usable = _positive("usable_memory", cfg.usable_memory, "0.9", at_most=1)
    hardware = Hardware(gpus=gpus, gpus_per_node=per_node, usable_bytes=memory * usable * GiB,
                        flops=_positive("gpu_tflops", cfg.gpu_tflops, "400") * 1e12,
                        intra_node=_positive("intra_node_gbps", cfg.intra_node_gbps, "150") * 1e9,
                        inter_node=_positive("inter_node_gbps", cfg.inter_node_gbps, "25") * 1e9,
                        host=_positive("host_gbps", cfg.host_gbps, "25") * 1e9)
    require_count("data.batch_size", cfg.data.batch_size, hint="samples per data-parallel rank, e.g. 1")
    require_count("data.text_len", cfg.data.text_len, optional=True, hint="text tokens per sample, e.g. 512")
    require_count("data.channels", cfg.data.channels, optional=True, hint="null takes the model's")
    require_count("data.num_classes", cfg.data.num_classes, hint="e.g. 1000")
    _choice("data.latent", cfg.data.latent, (True, False))
    strategy = cfg.trainer.strategy
    kind = strategy_kind(cfg.trainer) if "_target_" in strategy else None  # none selected: both are laid out
    checkpointing = cfg.model.get("activation_checkpointing")
    checkpointing = (0.0, 0.5, 1.0) if checkpointing is None else (checkpoint_fraction(checkpointing),)
    offload = cfg.model.get("activation_offload")
    _choice("model.activation_offload", offload, (None, True, False))
    states, eight_bit = optimizer_states(cfg)
    require_count("show", cfg.show, hint="rows of the table that fit (and as many that do not)")
    precision = str(cfg.trainer.precision)
    _choice("trainer.precision", precision, PRECISIONS)
    if str(cfg.trainer.get("accelerator", "gpu")) not in ("gpu", "cuda", "auto"):
        raise ConfigError(f"trainer.accelerator={cfg.trainer.accelerator}: the planner lays out GPUs; use "
                          f"trainer=gpu")
    _choice("trainer.strategy.cpu_offload", strategy.cpu_offload, (True, False))
    _choice("attention_backend", cfg.attention_backend, list_backends())
    if strategy.param_dtype is not None:
        dtype_named("trainer.strategy.param_dtype", strategy.param_dtype)
    base = cfg.lora.base_dtype
    if base is not None:
        resolve_base_dtype(base)
    replicate = strategy.replicate_degree
    require_count("trainer.strategy.replicate_degree", replicate, hint="1 shards over every GPU")
    if gpus % replicate:
        raise ConfigError(f"trainer.strategy.replicate_degree={replicate} does not divide gpus={gpus} (HSDP "
                          f"shards within gpus / replicate_degree ranks); use a divisor of {gpus}")
    decay = cfg.ema_decay
    if decay is not None and (isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay < 1):
        raise ConfigError(f"ema_decay must be a number in [0, 1) or null, got {decay!r}; null or 0 turns the EMA "
                          f"off, e.g. ema_decay=0.999")
    check_lora_settings(OmegaConf.to_container(cfg.lora, resolve=True))
    layout = Layout(devices=per_node, num_nodes=math.ceil(gpus / per_node), device_type="cuda",
                    attention_backend=cfg.attention_backend, replicate_degree=replicate,
                    cpu_offload=strategy.cpu_offload)
    distill_cfg = cfg.get("distill") or {}
    distill = distill_cfg.get("method", "none")
    _choice("distill", distill, DISTILL_METHODS)
    DistillSpec.check_settings(cfg)  # train.py's own checks of the distill.* settings: one vocabulary, one verdict
    setup = Setup(batch_size=cfg.data.batch_size, param_dtype=strategy.param_dtype, precision=precision,
                  ema=bool(decay), lora_base_dtype=base or "bfloat16", optimizer_states=states,
                  distill=distill, gan_loss=bool(distill_cfg.get("gan_loss", False)),
                  gan_block=distill_cfg.get("gan_block"),
                  regression_pairs=regression_pairs_per_update(distill_cfg))
    strategies = (kind,) if kind else ("ddp", "fsdp")
    lora = (cfg.lora.rank or 0) > 0
    options = {
        "activation_offload": (False, True) if offload is None else (offload,),
        "lora_base_dtype": ("bfloat16", "float8_e4m3fn") if base is None and lora else (base or "bfloat16",),
        "optimizer_8bit": eight_bit,
    }
    return hardware, layout, setup, strategies, checkpointing, options, fixed
