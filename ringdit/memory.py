"""A rough estimate of the memory one rank needs, made before anything is spawned.

A sequence far too long for the machine does not fail: it swaps, or sits at step 0 until the out-of-memory killer
comes. ``warn_if_memory_short`` says so in one log line, with the sequence-parallel degree that would fit. It is an
estimate (within a factor of about 2 of what PyTorch allocates), meant to catch settings that are 10x off, not to
plan the last gigabyte. Per rank, with S tokens per sample, D = hidden size, L = depth, B = batch per dp rank:

- tokens per rank: S / (ring x ulysses) (rounded up);
- weights: 4 bytes a parameter, plus 16 when training (gradient, AdamW's two moments, the EMA copy);
- activations kept for backward: about (10 + 2 x mlp_ratio) x D values per token per block (norm and modulation
  inputs, q, k, v, attention output, projection, residuals, the MLP's hidden layer before and after its activation);
  L blocks' worth, or 1 per block plus one block's when ``activation_checkpointing`` recomputes them; one block's
  worth when sampling (nothing is kept);
- attention: flash-style kernels (torch_flash, flash_attn) need O(S) per hop -- this rank's q, k, v, output and the
  K/V block in flight, S / ring tokens of H / ulysses heads after the Ulysses exchange; the ``math`` backend also
  materialises the (S / ring)^2 score matrix per head in fp32, which dominates for long sequences.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch

log = logging.getLogger("ringdit.memory")

GiB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    tokens_per_rank: int
    weights_bytes: int
    activation_bytes: int
    attention_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.activation_bytes + self.attention_bytes


def estimate_memory(*, tokens: int, hidden_size: int, depth: int, num_heads: int, batch_size: int, parameters: int,
                    mlp_ratio: float = 4.0, ring_degree: int = 1, ulysses_degree: int = 1, bytes_per_value: int = 4,
                    training: bool = True, activation_checkpointing: bool = False,
                    math_attention: bool = False) -> MemoryEstimate:
    """The estimate described in the module docstring, in bytes per rank."""
    sp = ring_degree * ulysses_degree
    tokens_per_rank = math.ceil(tokens / sp)
    weights = parameters * (20 if training else 4)
    per_block = (10 + 2 * mlp_ratio) * hidden_size  # values kept per token by one block
    if not training:
        per_token = per_block
    elif activation_checkpointing:  # block inputs only, plus the block being recomputed
        per_token = depth * hidden_size + per_block
    else:
        per_token = depth * per_block
    activations = int(batch_size * tokens_per_rank * per_token * bytes_per_value)
    # after the Ulysses exchange: S / ring tokens of H / ulysses heads, i.e. D / ulysses values per token
    ring_tokens = math.ceil(tokens / ring_degree)
    attention = 6 * batch_size * ring_tokens * (hidden_size // ulysses_degree) * bytes_per_value  # q k v out, K/V hop
    if math_attention:
        scores = batch_size * (num_heads // ulysses_degree) * ring_tokens**2 * 4  # fp32 scores and probabilities
        attention += 2 * scores * (2 if training else 1)  # and their gradients
    return MemoryEstimate(tokens_per_rank, weights, activations, int(attention))


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


def warn_if_memory_short(*, available: int | None, training: bool = True, **settings) -> MemoryEstimate:
    """Log one warning when ``estimate_memory(**settings)`` exceeds ``available``, with the degrees that would fit."""
    estimate = estimate_memory(training=training, **settings)
    if available is None or estimate.total_bytes <= available:
        return estimate
    ring, ulysses = settings.get("ring_degree", 1), settings.get("ulysses_degree", 1)
    fits = None
    for factor in (2**i for i in range(1, 11)):  # more ring ranks (each on its own memory)
        bigger = estimate_memory(training=training, **{**settings, "ring_degree": ring * factor})
        if bigger.total_bytes <= available:
            fits = f"ring_degree={ring * factor} ({ring * factor * ulysses} ranks of this size)"
            break
    log.warning(
        "memory: about %.1f GiB per rank needed (%d tokens per rank x hidden %d x depth %d, batch %d; weights %.1f, "
        "activations %.1f, attention %.1f GiB) but %.1f GiB is available: the run would swap or be killed. %s",
        estimate.total_bytes / GiB, estimate.tokens_per_rank, settings["hidden_size"], settings["depth"],
        settings["batch_size"], estimate.weights_bytes / GiB, estimate.activation_bytes / GiB,
        estimate.attention_bytes / GiB, available / GiB,
        (f"{fits} would fit; or lower data.batch_size" if fits else "Even 1024 ring ranks would not fit; lower "
         "data.batch_size or the resolution")
        + ("" if settings.get("activation_checkpointing") or not training else
           ", or set model.activation_checkpointing=true"),
    )
    return estimate


def check_training_memory(cfg, model_cfg: dict, meta_model, attention_backend: str | None) -> MemoryEstimate | None:
    """``warn_if_memory_short`` for train.py's settings (``cfg``), the model built on the meta device. Models that do
    not describe themselves as a DiT does (hidden_size, depth, num_heads) are not estimated."""
    from ringdit.spec.layout import device_type, world_size

    if not all(key in model_cfg for key in ("hidden_size", "depth", "num_heads")):
        return None
    devices = world_size(cfg.trainer) // max(1, int(cfg.trainer.get("num_nodes", 1)))
    precision = str(cfg.trainer.get("precision", "32"))
    kind = device_type(cfg.trainer)
    return warn_if_memory_short(
        available=available_memory(kind, devices if kind == "cpu" else 1),
        tokens=math.prod(meta_model.default_grid), hidden_size=model_cfg["hidden_size"], depth=model_cfg["depth"],
        num_heads=model_cfg["num_heads"], mlp_ratio=model_cfg.get("mlp_ratio", 4.0), batch_size=cfg.data.batch_size,
        parameters=sum(p.numel() for p in meta_model.parameters()), ring_degree=cfg.ring_degree,
        ulysses_degree=cfg.ulysses_degree, bytes_per_value=2 if "16" in precision else 8 if "64" in precision else 4,
        # the models take the older name gradient_checkpointing too: either recomputes the blocks
        activation_checkpointing=bool(model_cfg.get("activation_checkpointing")
                                      or model_cfg.get("gradient_checkpointing")),
        math_attention=attention_backend == "math",
    )
