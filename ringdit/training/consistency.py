"""sCM's continuous-time consistency loss (Lu and Song, "Simplifying, Stabilizing and Scaling Continuous-Time
Consistency Models", 2024) on a flow-matching model, in TrigFlow's parameterisation: the functions
``DistillationModule`` (``distill=scm`` / ``rcm``) composes.

**TrigFlow from a flow model.** TrigFlow noises data x0 (scale ``sigma_d``) as ``x_s = cos(s) x0 + sin(s) sigma_d e``,
s in [0, pi/2], e ~ N(0, I); its model F gives the probability-flow ODE ``dx_s/ds = sigma_d F(x_s, s)`` and the
consistency function ``f(x_s, s) = cos(s) x_s - sin(s) sigma_d F(x_s, s)``. A flow model noises as
``x_t = (1 - t) x0 + t e`` and predicts ``v = e - x0``. Dividing x_s by ``D(s) = cos(s) + sigma_d sin(s)``::

    x_s / D = (cos(s) / D) x0 + (sigma_d sin(s) / D) e      = the flow's x_t at   t = sigma_d sin(s) / D(s)

(the coefficients sum to 1: the same point on the flow's straight path), so the flow model at (x_s / D, t(s))
gives E[x0] = x_t - t v and E[e] = x_t + (1 - t) v, and TrigFlow's F is their combination
``sigma_d F = -sin(s) E[x0] + sigma_d cos(s) E[e]``; collecting terms (t sin(s) + sigma_d (1 - t) cos(s) =
sigma_d / D)::

    F(x_s, s) = (cos(s) - sin(s) / sigma_d) x_t + v(x_t, t) / D(s),     x_t = x_s / D(s),  t = sigma_d sin(s) / D(s)

This holds for the teacher (its F, the ODE's direction) and for the student, whose network stays a flow model
(initialised from the teacher, sampled by the flow few-step sampler): its consistency function is then exactly the
flow's clean prediction, ``f = cos(s) x_s - sin(s) sigma_d F = x_t - t v`` (substitute x_s = cos(s) E[x0] +
sigma_d sin(s) E[e]), so ``sample_fewstep`` samples an sCM student unchanged. sCM's training times, tan(s) =
exp(tau) / sigma_d with tau ~ N(p_mean, p_std), are the flow's logit-normal: t = sigmoid(tau), whatever sigma_d.

**The loss** (the paper's Algorithm 1, without its learned adaptive weighting, as rCM's code): with F_teacher the
teacher's (guided) F, the tangent of F_student along the ODE (its total derivative in s, by forward-mode AD through
the model, the tangents scaled by sin(s) cos(s) as the paper's "JVP rearrangement" does), and the warm-up weight r
rising from 0 to 1 over ``warmup_steps`` student updates::

    g = -w(s) sigma_d (F^- - F_teacher) - r (sin(s) cos(s) x_s + sigma_d sin(s) cos(s) dF^-/ds)
    g = g / (||g|| + c)                                        (per sample: tangent normalisation)
    loss = mean over samples of ||F_theta - F^- - g||^2       (F^-, g: no gradient)

with ``w(s) = cos(s) sqrt(1 - r^2 sin^2(s))``: the paper's cos^2(s) at r = 1, blended from cos(s) at r = 0 during the
warm-up as rCM's code does (NVlabs/rcm, ``training_step_generator``). The loss's gradient at theta = theta^- is
-2 g dF/dtheta: the consistency gradient, normalised.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.autograd.forward_ad as fwAD

from ringdit.common.linear_tangents import linear_tangents

Tensor = torch.Tensor
Velocity = Callable[[Tensor, Tensor], Tensor]  # (x_t, flow time t in [0, 1]) -> the flow model's velocity


def column(values: Tensor, like: Tensor) -> Tensor:
    """(B,) -> (B, 1, ...) broadcasting over ``like``'s sample dims."""
    return values.reshape(-1, *([1] * (like.dim() - 1))).to(like.dtype)


def training_times(generators: list[torch.Generator], p_mean: float, p_std: float, sigma_d: float) -> Tensor:
    """One TrigFlow time s per sample: ``arctan(exp(tau) / sigma_d)``, tau ~ N(p_mean, p_std), drawn in float64 from
    each sample's generator (the same values on every rank and in every precision)."""
    tau = torch.cat([p_mean + p_std * torch.randn(1, generator=g, dtype=torch.float64) for g in generators])
    return torch.atan(torch.exp(tau) / sigma_d)


def flow_time(s: Tensor, sigma_d: float) -> Tensor:
    """The flow time of TrigFlow's s: ``sigma_d sin(s) / (cos(s) + sigma_d sin(s))``."""
    return sigma_d * torch.sin(s) / (torch.cos(s) + sigma_d * torch.sin(s))


def trigflow_F(velocity: Velocity, x_s: Tensor, s: Tensor, sigma_d: float) -> Tensor:
    """TrigFlow's F of the flow model ``velocity`` at (x_s, s) (the module docstring's change of variables);
    differentiable (and forward-differentiable) in x_s and s."""
    cos, sin = column(torch.cos(s), x_s), column(torch.sin(s), x_s)
    scale = cos + sigma_d * sin
    x_t = x_s / scale
    v = velocity(x_t, flow_time(s, sigma_d))
    return (cos - sin / sigma_d) * x_t + v.to(x_t.dtype) / scale


def trigflow_F_and_tangent(velocity: Velocity, x_s: Tensor, s: Tensor, dx_ds: Tensor,
                           sigma_d: float) -> tuple[Tensor, Tensor]:
    """(F, sin(s) cos(s) dF/ds) of ``velocity`` at (x_s, s): the total derivative along the ODE direction
    ``dx_ds``, by forward-mode AD through the model (attention's forward-mode rule: ``jvp_ring_kv_chunk``; linear
    layers' tangents as one matmul each: ``linear_tangents``), without a gradient. The tangents are pre-scaled by
    sin(s) cos(s) (the paper's rearrangement: bounded near s = pi/2)."""
    scale = torch.sin(s) * torch.cos(s)
    with torch.no_grad(), fwAD.dual_level(), linear_tangents():
        x_dual = fwAD.make_dual(x_s, column(scale, x_s) * dx_ds)
        s_dual = fwAD.make_dual(s, scale.to(s.dtype))
        primal, tangent = fwAD.unpack_dual(trigflow_F(velocity, x_dual, s_dual, sigma_d))
        if tangent is None:  # nothing in F depended on the inputs (cannot happen for F's own x term): a zero tangent
            tangent = torch.zeros_like(primal)
    return primal, tangent


def tangent_weight(step: int, warmup_steps: int) -> float:
    """The warm-up's r at student update ``step``: from 0 to 1 over ``warmup_steps`` updates (1 from the start for
    0)."""
    return 1.0 if warmup_steps <= 0 else min(1.0, step / warmup_steps)


def consistency_direction(F_minus: Tensor, dF: Tensor, F_teacher: Tensor, x_s: Tensor, s: Tensor, r: float,
                          sigma_d: float, c: float) -> Tensor:
    """sCM's normalised direction g (module docstring) per sample; ``dF``: sin(s) cos(s) dF^-/ds."""
    cos, sin = column(torch.cos(s), x_s), column(torch.sin(s), x_s)
    # the warm-up blends the teacher term's weight from cos(s) (r = 0) to cos^2(s) (r = 1), as rCM's code does
    blend = cos * torch.sqrt((1 - r * r * sin * sin).clamp_min(0))
    g = -blend * sigma_d * (F_minus - F_teacher) - r * (sin * cos * x_s + sigma_d * dF)
    norm = g.flatten(1).norm(dim=1)
    return g / column(norm + c, g)


def consistency_loss(F_theta: Tensor, F_minus: Tensor, g: Tensor) -> Tensor:
    """``mean_b ||F_theta - F^- - g||^2`` (F^- and g without gradient): its gradient at theta^- is -2 g dF/dtheta."""
    return (F_theta - F_minus.detach() - g.detach()).flatten(1).square().sum(dim=1).mean()


def per_sample_size(x: Tensor) -> int:
    """Elements per sample (rCM sums its losses over them)."""
    return math.prod(x.shape[1:])
