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
from ringdit.costs.sizes import model_size
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


def setup_from_config(cfg, layout: Layout) -> Setup:
    """The ``Setup`` train.py's composed config ``cfg`` runs with on ``layout`` (its devices decide the defaults of
    the LoRA base and whether offloading acts)."""
    model = cfg.get("model") or {}
    lora = cfg.get("lora") or {}
    optimizer = str(OmegaConf.select(cfg, "optimizer._target_", default="AdamW") or "")
    checkpointing = model.get("activation_checkpointing") or model.get("gradient_checkpointing")
    offload = bool(model.get("activation_offload")) and checkpoint_fraction(checkpointing) > 0
    device_type = layout.device_type
    if offload and device_type != "cuda":
        log.warning("model.activation_offload=true is ignored on %s ranks: the activations already live in host "
                    "memory there, and offloading would only copy them; it acts on CUDA", device_type.upper())
    momentum = OmegaConf.select(cfg, "optimizer.momentum", default=0) or 0
    base_dtype = lora.get("base_dtype") or ("bfloat16" if device_type == "cuda" else "float32")
    return Setup(
        batch_size=cfg.data.batch_size,
        param_dtype=OmegaConf.select(cfg, "trainer.strategy.param_dtype", default=None) if layout.fsdp else None,
        precision=str(cfg.trainer.get("precision", "32")),
        # the models take the older name gradient_checkpointing too: either recomputes the blocks
        activation_checkpointing=checkpoint_fraction(checkpointing),
        activation_offload=offload and device_type == "cuda",
        ema=bool(cfg.get("ema_decay")), lora_base_dtype=base_dtype,
        optimizer_states=(1 if momentum else 0) if "SGD" in optimizer else 2,
        optimizer_8bit=optimizer.endswith("adamw8bit"),
        distill=str(OmegaConf.select(cfg, "distill.method", default="none") or "none"),
        gan_loss=bool(OmegaConf.select(cfg, "distill.gan_loss", default=False)),
        gan_block=OmegaConf.select(cfg, "distill.gan_block", default=None),
        regression_pairs=(OmegaConf.select(cfg, "distill.regression_pairs", default=0) or 0)
        if OmegaConf.select(cfg, "distill.regression_loss", default=False) else 0,
    )


def check_training_memory(cfg, layout: Layout, model_cfg: dict, meta_model,
                          largest_step: tuple[int, int] | None = None) -> MemoryEstimate | None:
    """``warn_if_memory_short`` for train.py's settings (``cfg``) on ``layout`` and the model built on the meta device
    (``model_cfg`` its config); None for a model kind whose sizes cannot be read (neither a DiT nor a diffusers
    transformer). ``largest_step``: (tokens per sample, batch size) of the data's most demanding bucket, which sets
    the peak (default: the model's default grid at ``data.batch_size``)."""
    size = model_size(model_cfg, meta_model, OmegaConf.to_container(cfg.lora) if cfg.get("lora") else None)
    if size is None:
        return None
    setup = setup_from_config(cfg, layout)
    if largest_step is not None:
        size = replace(size, tokens=largest_step[0])
        setup = replace(setup, batch_size=largest_step[1])
    cpu = layout.device_type == "cpu"
    return warn_if_memory_short(available=available_memory(layout.device_type, layout.devices if cpu else 1),
                                model=size, layout=layout, setup=setup)
