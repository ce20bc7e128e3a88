"""The original DiT's Gaussian diffusion formulas (OpenAI's guided-diffusion, as in facebookresearch/DiT): the true
posterior q(x_{t-1} | x_t, x_0), the model's p(x_{t-1} | x_t) with a learned variance, the variational-bound term
that trains that variance, and respacing the schedule to fewer sampling steps.

Tables are float64 (as the original's numpy tables); a coefficient is cast to the data's dtype when it is used.
Everything is elementwise given one step per sample, so it works on images ``(B, C, H, W)`` and on the DiT's output
tokens ``(B, N, P, C)`` alike, on a sequence shard as on the whole sample.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def _at(table: Tensor, t: Tensor, like: Tensor) -> Tensor:
    """(B,) steps -> table[t] as (B, 1, 1, ...) in ``like``'s dtype and device."""
    values = table.to(like.device)[t.to(like.device)]
    return values.reshape(-1, *([1] * (like.dim() - 1))).to(like.dtype)


def space_timesteps(num_timesteps: int, steps: int) -> list[int]:
    """The original's ``space_timesteps(num_timesteps, str(steps))``: ``steps`` of the schedule's steps, evenly
    strided from 0 to num_timesteps - 1 (1000 -> 250: 0, 4, 8, ..., 999), ascending. The stride is accumulated
    in floats and rounded as the original does, so the kept steps are exactly its."""
    if not 1 <= steps <= num_timesteps:
        raise ValueError(f"steps must be in [1, {num_timesteps}], got {steps}")
    stride = 1 if steps <= 1 else (num_timesteps - 1) / (steps - 1)
    kept, position = [], 0.0
    for _ in range(steps):
        kept.append(round(position))
        position += stride
    return kept


class GaussianPosterior:
    """q and p of one beta schedule: the full 1000-step one for the loss, a respaced one for sampling.

    ``respaced(alphas_cumprod, kept)``: the schedule that jumps between the ``kept`` steps, with betas
    ``1 - alpha_bar[k] / alpha_bar[previous kept]`` (the original's ``SpacedDiffusion``).
    """

    def __init__(self, betas: Tensor):
        betas = betas.to(torch.float64)
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        previous = torch.cat([torch.ones(1, dtype=torch.float64), alphas_cumprod[:-1]])
        self.betas, self.alphas_cumprod = betas, alphas_cumprod
        self.posterior_variance = betas * (1.0 - previous) / (1.0 - alphas_cumprod)
        # the posterior variance is 0 at t = 0: its log takes t = 1's value there (the original's "clipped")
        self.posterior_log_variance_clipped = torch.log(
            torch.cat([self.posterior_variance[1:2], self.posterior_variance[1:]]))
        self.posterior_mean_coef_x0 = betas * previous.sqrt() / (1.0 - alphas_cumprod)
        self.posterior_mean_coef_xt = (1.0 - previous) * (1.0 - betas).sqrt() / (1.0 - alphas_cumprod)
        # a model without learned variance: the original's FIXED_LARGE (betas, with t = 0's posterior variance)
        self.fixed_log_variance = torch.log(torch.cat([self.posterior_variance[1:2], betas[1:]]))

    @classmethod
    def respaced(cls, alphas_cumprod: Tensor, kept: list[int]) -> GaussianPosterior:
        kept_alphas = alphas_cumprod.to(torch.float64)[kept]
        previous = torch.cat([torch.ones(1, dtype=torch.float64), kept_alphas[:-1]])
        return cls(1.0 - kept_alphas / previous)

    def q_posterior(self, x0: Tensor, x_t: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """Mean and (clipped) log variance of q(x_{t-1} | x_t, x_0)."""
        mean = _at(self.posterior_mean_coef_x0, t, x_t) * x0 + _at(self.posterior_mean_coef_xt, t, x_t) * x_t
        return mean, _at(self.posterior_log_variance_clipped, t, x_t).expand_as(x_t)

    def predict_x0(self, x_t: Tensor, t: Tensor, eps: Tensor) -> Tensor:
        alpha_bar = self.alphas_cumprod
        return _at((1.0 / alpha_bar).sqrt(), t, x_t) * x_t - _at((1.0 / alpha_bar - 1.0).sqrt(), t, x_t) * eps

    def p_mean_variance(self, x_t: Tensor, t: Tensor, eps: Tensor, variance_values: Tensor | None,
                        clip_denoised: bool = False) -> tuple[Tensor, Tensor]:
        """Mean and log variance of the model's p(x_{t-1} | x_t).

        ``variance_values`` in [-1, 1] (a learned-sigma DiT's extra channels) interpolate the log variance between
        the posterior's (-1) and beta's (+1), the original's LEARNED_RANGE; None: the fixed large variance.
        The mean is the posterior's around the predicted x0, which ``clip_denoised`` clamps to [-1, 1] (pixels).
        """
        if variance_values is None:
            log_variance = _at(self.fixed_log_variance, t, x_t).expand_as(x_t)
        else:
            fraction = (variance_values + 1) / 2
            log_variance = (fraction * _at(self.betas.log(), t, x_t)
                            + (1 - fraction) * _at(self.posterior_log_variance_clipped, t, x_t))
        x0 = self.predict_x0(x_t, t, eps)
        if clip_denoised:
            x0 = x0.clamp(-1, 1)
        mean, _ = self.q_posterior(x0, x_t, t)
        return mean, log_variance

    def vb_bits(self, x0: Tensor, x_t: Tensor, t: Tensor, eps: Tensor, variance_values: Tensor) -> Tensor:
        """The variational-bound term per element, in bits: KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t)), and at
        t = 0 the decoder's negative log-likelihood of x0 (a Gaussian discretized to 256 levels in [-1, 1]).
        Its mean over a sample's elements is the original's ``vb`` (``mean_flat(...) / log 2``)."""
        true_mean, true_log_variance = self.q_posterior(x0, x_t, t)
        mean, log_variance = self.p_mean_variance(x_t, t, eps, variance_values)
        kl = normal_kl(true_mean, true_log_variance, mean, log_variance)
        decoder_nll = -discretized_gaussian_log_likelihood(x0, mean, 0.5 * log_variance)
        first_step = (t == 0).to(x_t.device).reshape(-1, *([1] * (x_t.dim() - 1)))
        return torch.where(first_step, decoder_nll, kl) / math.log(2.0)


def normal_kl(mean1: Tensor, log_variance1: Tensor, mean2: Tensor, log_variance2: Tensor) -> Tensor:
    """KL(N(mean1, exp(log_variance1)) || N(mean2, exp(log_variance2))) per element, in nats."""
    return 0.5 * (-1.0 + log_variance2 - log_variance1 + torch.exp(log_variance1 - log_variance2)
                  + (mean1 - mean2).square() * torch.exp(-log_variance2))


def _standard_normal_cdf(x: Tensor) -> Tensor:
    """The original's tanh approximation of the standard normal CDF (kept for identical losses)."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def discretized_gaussian_log_likelihood(x: Tensor, means: Tensor, log_scales: Tensor) -> Tensor:
    """log P(x) per element, x in [-1, 1] on 256 levels (bins of width 2/255; the end bins reach to -inf / +inf)."""
    centered, inverse_std = x - means, torch.exp(-log_scales)
    cdf_plus = _standard_normal_cdf(inverse_std * (centered + 1.0 / 255.0))
    cdf_min = _standard_normal_cdf(inverse_std * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_delta))
