"""Model guidance (``diffusion.model_guidance``): training a model with a guidance-scale input (Flux-dev's guidance
embedding, the DiT's ``guidance_embed``) toward the classifier-free-guided target, so that fine-tuning it on new data
keeps what its guidance input means.

Fine-tuning such a model with the plain flow target at one fixed scale (musubi-tuner and diffusion-pipe feed 1.0,
or the configured ``guidance``) trains only that scale's prediction; the embedding's other values drift with the
shared weights. Model guidance (Tang et al. 2025, *Diffusion Models without Classifier-free Guidance*,
arXiv 2502.12154) trains every scale: each sample draws a scale w from ``[low, high]``, the model is fed it, and its
target is the data target plus the guidance direction of the model's own unguided predictions, under stop-gradient:

    target = target(x0, noise, t) + (w - 1) (sg v(x_t, c, 1) - sg v(x_t, null, 1))

In expectation over the data the first term is v(x_t, c), so the target is classifier-free guidance at scale w. The
reference is the trained model itself (its current weights under ``torch.no_grad``), not a frozen copy: the
guidance direction then follows the new data as the model learns it, the unguided prediction (w near 1) and the null
condition (the condition drop) keep training on the plain target that it is read from, and it costs no second copy
of the weights -- the same parallelized model runs, so it is exact under every layout. (The paper's code reads an
EMA of the weights; at ringdit's 0.999 an EMA lags a short fine-tune by its whole length.) A sample whose condition
the drop replaced gets no guidance term (its two references are the same prediction).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ringdit.common.errors import ConfigError

Tensor = torch.Tensor

SETTING = "diffusion.model_guidance"


def check_model_guidance(setting, model: nn.Module, distill: str | None) -> tuple[float, float] | None:
    """``diffusion.model_guidance``: null (off), or ``[low, high]`` with 1 <= low <= high, finite, for a model with a
    guidance-scale input and a null condition it trains, without distillation. One line naming what is wrong."""
    if setting is None:
        return None
    values = list(setting) if isinstance(setting, (list, tuple)) else None
    if values is None or len(values) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                     and math.isfinite(v) for v in values) \
            or not 1 <= values[0] <= values[1]:
        raise ConfigError(f"{SETTING}={setting!r} is not a range of guidance scales: give [low, high] with "
                          f"1 <= low <= high (1: unguided), e.g. {SETTING}=[1,4]; null trains without it")
    if not model.takes_guidance:
        raise ConfigError(f"{SETTING}={list(values)} trains a model's guidance-scale input, but this "
                          f"{type(model).__name__} has none; use a guidance-distilled model (model=flux with "
                          f"guidance_embeds and model.guidance, or model.guidance_embed=true for the DiT), or set "
                          f"{SETTING}=null")
    if not model.condition_dropout_prob > 0:
        raise ConfigError(f"{SETTING}={list(values)} guides away from the null condition, which the model learns "
                          f"only from the condition drop, but its drop probability is 0; set "
                          f"model.class_dropout_prob (DiT) or model.condition_dropout_prob to e.g. 0.1")
    if distill is not None:
        raise ConfigError(f"{SETTING}={list(values)} is a target for plain training, but distill={distill} trains "
                          f"with its own losses; set {SETTING}=null, or distill=none")
    return float(values[0]), float(values[1])


def draw_scales(generators: list[torch.Generator], low: float, high: float, device) -> Tensor:
    """(B,) guidance scales, sample i's uniform in [low, high] from ``generators[i]`` (every rank of a
    sequence-parallel group draws the same)."""
    draws = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    return (low + (high - low) * draws).to(device)


@torch.no_grad()
def guided_target(model: nn.Module, target: Tensor, x_t: Tensor, time: Tensor, condition, scales: Tensor,
                  run: dict) -> Tensor:
    """``target`` (B, C, ...) plus (scales - 1) times the model's own unguided guidance direction at ``x_t``:
    its prediction for ``condition`` (as the condition drop left it) minus that for the null condition, both fed
    scale 1, without gradient; ``run``: the forward's other keywords (a two-expert model's expert)."""
    ones = torch.ones_like(scales)
    null = model.drop_condition(condition, torch.ones(x_t.shape[0], dtype=torch.bool, device=x_t.device))
    channels = target.shape[1]  # a learned variance's channels are not guided
    conditional = model(x_t, time, condition, guidance=ones, **run)[:, :channels].float()
    unconditional = model(x_t, time, null, guidance=ones, **run)[:, :channels].float()
    weight = (scales.float() - 1).reshape(-1, *[1] * (target.dim() - 1))  # (B, 1, ...)
    return target + weight * (conditional - unconditional)
