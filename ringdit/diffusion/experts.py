"""Two-expert models (Wan 2.2 A14B): which expert a training step trains, and the times its samples are noised to.

Such a model denoises model times at and above its boundary (``model.boundary_ratio`` x 1000) with its high-noise
expert and those below with its low-noise one. A training step runs one expert -- the same on every rank of the world,
so FSDP gathers and DDP reduces the same parameters everywhere -- and draws each sample's time from the objective's
distribution restricted to that expert's range (``FlowMatching.sample_time(within=)``). ``diffusion.expert=both``
draws the step's expert with the probability the objective gives its range: over the steps, the times are those of
training one model on the whole range.
"""

from __future__ import annotations

from typing import Callable

import torch

Tensor = torch.Tensor

EXPERT_SETTINGS = ("high", "low", "both")


def time_range(expert: str, boundary: float) -> tuple[float, float]:
    """The flow-matching times (model time / 1000) that ``expert`` denoises."""
    return (boundary, 1.0) if expert == "high" else (0.0, boundary)


def step_expert(setting: str, boundary: float, objective, tokens: int | None, generator: torch.Generator) -> str:
    """The expert one step trains: ``setting`` itself, or for ``both`` a draw from ``generator`` (a key every rank
    shares) with the chance of the high expert's range under ``objective``'s times for samples of ``tokens``."""
    if setting != "both":
        return setting
    low, high = time_range("high", boundary)
    chance = objective.cumulative(high, tokens) - objective.cumulative(low, tokens)
    return "high" if float(torch.rand(1, generator=generator, dtype=torch.float64)) < chance else "low"


def expert_guidance(model, scale: float, scale_2: float | None) -> float | Callable[[Tensor], float]:
    """Classifier-free guidance's scale: ``scale`` for the high-noise expert and ``scale_2`` for the low-noise one
    (WanPipeline's ``guidance_scale`` / ``guidance_scale_2``), as ``scale(t)``; ``scale`` alone where the model has
    one expert or ``scale_2`` is None (then it guides both, as WanPipeline does)."""
    if scale_2 is None or not model.experts:
        return scale
    return lambda t: scale if model.expert_at(t) == "high" else scale_2
