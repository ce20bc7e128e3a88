"""train.py's memory check: its composed config read into a ``Setup``, the memory a rank has, and one warning when the
estimate exceeds it, with a layout that would fit."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch
from omegaconf import OmegaConf

from ringdit.parallel.layout import Layout
from ringdit.costs.estimate import GiB, MemoryEstimate, ModelSize, Setup, estimate_memory
from ringdit.costs.model_size import model_size
from ringdit.models.checkpointing import checkpoint_fraction

log = logging.getLogger("ringdit.costs")


def available_memory(device_type: str, ranks_on_this_machine: int) -> int | None:
    """Bytes one rank can use: free memory of the GPU, or the machine's available memory shared by its ranks."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return available // max(1, ranks_on_this_machine)


def layout_that_fits(model: ModelSize, layout: Layout, setup: Setup, available: int) -> str | None:
    """The first change that brings the peak within ``available``: more ring ranks (activations shrink, and under
    FSDP the state too), else FSDP at this layout, else FSDP with more ring ranks; None if nothing up to 1024x does."""
    tries = [("", layout)]
    if not layout.fsdp and setup.training:
        tries.append(("trainer/strategy=fsdp", replace(layout, strategy="fsdp")))
    for prefix, base in tries:
        for factor in (2**i for i in range(11)):
            ring = base.ring_degree * factor
            if (prefix, factor) == ("", 1) or ring * base.ulysses_degree > model.tokens:
                continue
            bigger = replace(base, ring_degree=ring)
            if estimate_memory(model, bigger, setup).peak_bytes <= available:
                ranks = f"ring_degree={ring} ({bigger.ranks} ranks of this size)" if factor > 1 else ""
                return " ".join(part for part in (prefix, ranks) if part)
    return None


def warn_if_memory_short(*, available: int | None, model: ModelSize, layout: Layout,
                         setup: Setup = Setup()) -> MemoryEstimate:
    """Log one warning when the estimate's peak exceeds ``available``, with a layout that would fit."""
    estimate = estimate_memory(model, layout, setup)
    if available is None or estimate.peak_bytes <= available:
        return estimate
    fits = layout_that_fits(model, layout, setup, available)
    step = ", ".join(f"{name} {estimate.terms()[name] / GiB:.1f}" for name in MemoryEstimate.STEP_TERMS
                     if estimate.terms()[name])
    hint = (f"{fits} would fit; or lower data.batch_size" if fits else
            "Even 1024x the ring ranks would not fit; lower data.batch_size or the resolution")
    if setup.training and setup.checkpoint_fraction < 1:
        hint += ", or set model.activation_checkpointing=true"
    models = " (student, critic and teacher)" if setup.frozen_models else ""
    log.warning(
        "memory: about %.1f GiB per rank needed%s (%d tokens per rank x hidden %d x depth %d, batch %d, %s; start-up "
        "%.1f GiB, step: %s GiB) but %.1f GiB is available: the run would swap or be killed. %s (python -m "
        "ringdit.plan compares layouts)",
        estimate.peak_bytes / GiB, models, estimate.tokens_per_rank, model.hidden_size, model.depth,
        setup.batch_size, layout.strategy, estimate.startup_bytes / GiB, step, available / GiB, hint,
    )
    return estimate


def memory_setup(layout: Layout, *, batch_size: int, precision: str, param_dtype: str | None, model_config: dict,
                 lora: dict | None, optimizer_states: tuple[int, bool], ema: bool,
                 distill: dict | None = None) -> Setup:
    """The ``Setup`` a training run has on ``layout`` (its devices decide the defaults of the LoRA base and whether
    offloading acts), from the run's own settings: ``TrainSpec`` passes its parts (``TrainSpec.memory``).
    ``param_dtype``: the FSDP strategy's; ``lora``: the LoRA settings (their ``base_dtype``); ``optimizer_states``:
    (states per trainable parameter, whether 8-bit: ``OptimizerSpec.states``); ``distill``: the distillation's
    settings (``DistillSpec.settings``), None for plain training."""
    lora, distill = lora or {}, distill or {}
    checkpointing = model_config.get("activation_checkpointing") or model_config.get("gradient_checkpointing")
    offload = bool(model_config.get("activation_offload")) and checkpoint_fraction(checkpointing) > 0
    device_type = layout.device_type
    if offload and device_type != "cuda":
        log.warning("model.activation_offload=true is ignored on %s ranks: the activations already live in host "
                    "memory there, and offloading would only copy them; it acts on CUDA", device_type.upper())
    base_dtype = lora.get("base_dtype") or ("bfloat16" if device_type == "cuda" else "float32")
    return Setup(
        batch_size=batch_size,
        param_dtype=param_dtype if layout.fsdp else None,
        precision=str(precision),
        # the models take the older name gradient_checkpointing too: either recomputes the blocks
        activation_checkpointing=checkpoint_fraction(checkpointing),
        activation_offload=offload and device_type == "cuda",
        ema=ema, lora_base_dtype=base_dtype,
        optimizer_states=optimizer_states[0], optimizer_8bit=optimizer_states[1],
        distill=distill.get("method") or "none",
        gan_loss=bool(distill.get("gan_loss")),
        gan_block=distill.get("gan_block"),
        regression_pairs=regression_pairs_per_update(distill),
    )


def regression_pairs_per_update(distill) -> int:
    """How many teacher pairs a student update runs the student on (the memory estimates'): ``regression_batch``
    of them, or all ``regression_pairs``; 0 without the regression loss."""
    if not distill.get("regression_loss"):
        return 0
    return distill.get("regression_batch") or distill.get("regression_pairs") or 0


def setup_from_config(cfg, layout: Layout) -> Setup:
    """``memory_setup`` for a composed train.py config alone (a benchmark, a test: no ``TrainSpec`` built); a run
    gets its own from its spec's parts (``TrainSpec.memory``)."""
    from ringdit.training.optimizers import optimizer_states  # (ringdit.training imports Lightning)

    optimizer = OmegaConf.to_container(cfg.optimizer, resolve=True) if cfg.get("optimizer") else {}
    distill = OmegaConf.select(cfg, "distill", default=None)
    return memory_setup(
        layout, batch_size=cfg.data.batch_size, precision=str(cfg.trainer.get("precision", "32")),
        param_dtype=OmegaConf.select(cfg, "trainer.strategy.param_dtype", default=None),
        model_config=cfg.get("model") or {}, lora=cfg.get("lora") or {},
        optimizer_states=optimizer_states(optimizer) or (2, False), ema=bool(cfg.get("ema_decay")),
        distill=OmegaConf.to_container(distill, resolve=True) if distill else None)


def check_training_memory(cfg, layout: Layout, model_cfg: dict, meta_model,
                          largest_step: tuple[int, int] | None = None) -> MemoryEstimate | None:
    """``check_memory`` for a composed train.py config alone (``setup_from_config``)."""
    return check_memory(setup_from_config(cfg, layout), layout, model_cfg, meta_model,
                        OmegaConf.to_container(cfg.lora) if cfg.get("lora") else None, largest_step)


def check_memory(setup: Setup, layout: Layout, model_cfg: dict, meta_model, lora: dict | None,
                 largest_step: tuple[int, int] | None = None) -> MemoryEstimate | None:
    """``warn_if_memory_short`` for a run's ``setup`` on ``layout`` and the model built on the meta device
    (``model_cfg`` its config, ``lora`` its LoRA settings); None for a model kind whose sizes cannot be read (neither
    a DiT nor a diffusers transformer). ``largest_step``: (tokens per sample, batch size) of the data's most
    demanding bucket, which sets the peak (default: the model's default grid at ``setup.batch_size``)."""
    size = model_size(model_cfg, meta_model, lora)
    if size is None:
        return None
    if largest_step is not None:
        size = replace(size, tokens=largest_step[0])
        setup = replace(setup, batch_size=largest_step[1])
    cpu = layout.device_type == "cpu"
    return warn_if_memory_short(available=available_memory(layout.device_type, layout.devices if cpu else 1),
                                model=size, layout=layout, setup=setup)
