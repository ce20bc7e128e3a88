"""Training objectives: what a noised sample looks like at time t and what the model should predict.

Both are plain classes of formulas (no nn.Module, no randomness of their own: the caller passes a generator, so
every rank of a sequence-parallel group draws the same t and noise).

- ``FlowMatching`` (rectified flow, the default): ``x_t = (1 - t) x0 + t noise``, target velocity
  ``noise - x0``, t uniform or logit-normal in (0, 1), optionally shifted towards noise for large resolutions
  (SD3's ``t' = s t / (1 + (s - 1) t)``, or Flux's / Qwen-Image's dynamic shift of each sample's token count),
  optionally restricted to ``[min_time, max_time]``, its loss optionally weighted by time (DiffSynth-Studio's
  weighting). The model sees ``1000 t``.
- ``DDPM``: epsilon prediction on the original DiT's linear beta schedule (1e-4 .. 0.02, 1000 steps), so original
  DiT checkpoints can be fine-tuned. The model sees the integer step. A model with a learned variance (the DiT's
  ``learn_sigma``) also learns it with the original's variational-bound term (``vb_bits``, ``learn_variance``).
  Its settings also give the discrete-time schedules of other models, as diffusers' ``DDIMScheduler`` /
  ``CogVideoXDDIMScheduler`` configure them: ``prediction`` (``epsilon`` or ``v``: ``sqrt(a) noise - sqrt(1 - a) x0``),
  ``beta_schedule`` (``linear``, or ``scaled_linear``: betas linear in their square root, latent diffusion's),
  ``snr_shift_scale`` (CogVideoX's SD3-like shift of the signal-to-noise ratio, ``a / (s + (1 - s) a)``),
  ``rescale_zero_snr`` (the terminal step pure noise, Lin et al. 2023) and the DDIM sampler's ``timestep_spacing``.
"""

from __future__ import annotations

import functools
import math

import torch

from ringdit.diffusion.gaussian import GaussianPosterior
from ringdit.common.errors import ConfigError

Tensor = torch.Tensor


def _broadcast(values: Tensor, like: Tensor) -> Tensor:
    """(B,) -> (B, 1, 1, ...) matching ``like``'s rank."""
    return values.reshape(-1, *([1] * (like.dim() - 1))).to(like.dtype)


def shift_time(t: Tensor, shift: float) -> Tensor:
    """Move t in [0, 1] towards 1 (more noise) for shift > 1: ``s t / (1 + (s - 1) t)``."""
    return t if shift == 1.0 else shift * t / (1 + (shift - 1) * t)


def resolution_mu(tokens: int, base_tokens: int = 256, max_tokens: int = 4096, base_shift: float = 0.5,
                  max_shift: float = 1.15, empirical_mu_steps: int | None = None, steps: int | None = None,
                  time_shift_type: str = "exponential") -> float:
    """The dynamic shift's ``mu`` for ``tokens`` image tokens: FluxPipeline's / QwenImagePipeline's
    ``calculate_shift(tokens, base_tokens, max_tokens, base_shift, max_shift)`` in its own arithmetic (so that it is
    the pipelines' number to the last bit), with their scheduler config's ``base_image_seq_len``,
    ``max_image_seq_len``, ``base_shift``, ``max_shift``.

    ``empirical_mu_steps``: Flux.2's rule instead (the other constants unused): Flux2Pipeline's
    ``compute_empirical_mu(tokens, steps)``, imported from diffusers, whose mu depends on the sampler's ``steps``
    too; training, which has no steps, takes it at ``empirical_mu_steps``. (``time_shift_type``: how the scheduler
    applies mu, ``dynamic_shift_time``; unused here.)"""
    if empirical_mu_steps is not None:
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        return compute_empirical_mu(image_seq_len=tokens, num_steps=steps or empirical_mu_steps)
    slope = (max_shift - base_shift) / (max_tokens - base_tokens)
    return tokens * slope + (base_shift - slope * base_tokens)


def resolution_shift(tokens: int, steps: int | None = None, time_shift_type: str = "exponential",
                     **constants) -> float:
    """Flux's resolution-dependent shift for ``tokens`` image tokens as an SD3 shift (``shift_time``'s): ``exp(mu)``
    of ``resolution_mu`` -- FlowMatchEulerDiscreteScheduler's exponential time shift with ``use_dynamic_shifting``
    is ``shift_time`` with that shift --, or mu itself for a scheduler whose ``time_shift_type`` is ``linear``."""
    mu = resolution_mu(tokens, steps=steps, **constants)
    return math.exp(mu) if time_shift_type == "exponential" else mu


def dynamic_shift_time(t: Tensor, mu: float, time_shift_type: str = "exponential") -> Tensor:
    """t in [0, 1] shifted by ``mu`` as FlowMatchEulerDiscreteScheduler shifts its sigmas with
    ``use_dynamic_shifting`` (its ``time_shift`` at sigma 1, in its arithmetic): ``e^mu / (e^mu + 1 / t - 1)``, or
    ``mu / (mu + 1 / t - 1)`` for ``time_shift_type=linear``. (t = 0 stays 0: 1 / 0 is inf.)"""
    scale = math.exp(mu) if time_shift_type == "exponential" else mu
    return scale / (scale + (1 / t - 1))


# resolution_shift's constants: the linear rule's (with how the scheduler applies mu), or Flux.2's step count
RESOLUTION_SHIFT_KEYS = ("base_tokens", "max_tokens", "base_shift", "max_shift", "time_shift_type",
                         "empirical_mu_steps")
TIME_SHIFT_TYPES = ("exponential", "linear")  # FlowMatchEulerDiscreteScheduler's time_shift_type
TIME_SAMPLINGS = ("uniform", "logit_normal")
# diffusion.objective.loss_weighting: none, or DiffSynth-Studio's FlowMatchScheduler.training_weight
LOSS_WEIGHTINGS = ("none", "diffsynth")
# the settings FlowMatching takes (diffusion.objective.<key>)
FLOW_SETTINGS = ("time_sampling", "logit_mean", "logit_std", "shift", "resolution", "min_time", "max_time",
                 "loss_weighting")


def check_flow(settings: dict, setting: str = "diffusion.objective") -> None:
    """A ConfigError naming the first FlowMatching setting of ``settings`` that cannot work, its value and what to
    give (``shift`` and ``resolution``: ``ringdit.spec.diffusion``'s checks, which know the model)."""
    def refuse(key: str, why: str) -> None:
        raise ConfigError(f"{setting}.{key}={settings.get(key)!r} {why}")

    def number(key: str) -> bool:
        value = settings.get(key)
        return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)

    for key in sorted(set(settings) - set(FLOW_SETTINGS) - {"_target_"}):
        refuse(key, f"is not a flow-matching setting; use one of {', '.join(FLOW_SETTINGS)}")
    if "time_sampling" in settings and settings["time_sampling"] not in TIME_SAMPLINGS:
        refuse("time_sampling", f"is not one of {', '.join(TIME_SAMPLINGS)}")
    if "logit_mean" in settings and not number("logit_mean"):
        refuse("logit_mean", "is not a finite number; give the logit-normal's mean (0.0: centred at t = 0.5)")
    if "logit_std" in settings and not (number("logit_std") and settings["logit_std"] > 0):
        refuse("logit_std", "is not a number > 0; give the logit-normal's spread (1.0: SD3's)")
    for key in ("min_time", "max_time"):
        if key in settings and not (number(key) and 0 <= settings[key] <= 1):
            refuse(key, "is not a time in [0, 1] (t = 1 is pure noise; musubi-tuner's min_timestep / max_timestep "
                        "are 1000 t); give e.g. 0.0 .. 1.0 for no restriction")
    low, high = settings.get("min_time", 0.0), settings.get("max_time", 1.0)
    if low >= high:
        refuse("min_time", f"is not below max_time={high!r}: the training times are drawn in [min_time, max_time]; "
                           f"give min_time < max_time (swap them, or 0.0 .. 1.0 for all times)")
    if "loss_weighting" in settings and settings["loss_weighting"] not in LOSS_WEIGHTINGS:
        refuse("loss_weighting", f"is not one of {', '.join(LOSS_WEIGHTINGS)} (diffsynth: DiffSynth-Studio's "
                                 f"bell-shaped weight of the time)")


@functools.lru_cache(maxsize=64)  # one table per shift: the buckets of a run have a few
def _diffsynth_table(shift: float) -> tuple[float, float]:
    """(y_min, sum of y - y_min) over DiffSynth's training table, which ``diffsynth_weight`` normalises by: its 1000
    training times (``set_timesteps(1000, training=True)``: ``linspace(1, 0, 1001)[:-1]``, shifted)."""
    bell = _diffsynth_bell(shift_time(torch.linspace(1, 0, 1001, dtype=torch.float64)[:-1], shift))
    return float(bell.min()), float((bell - bell.min()).sum())


def _diffsynth_bell(t: Tensor) -> Tensor:
    """DiffSynth's ``exp(-2 ((x - 1000 / 2) / 1000)^2)`` of its timestep x = 1000 t."""
    return torch.exp(-2 * ((t * 1000 - 1000 / 2) / 1000) ** 2)


def diffsynth_weight(t: Tensor, shift: float) -> Tensor:
    """DiffSynth-Studio's flow-loss weight of time t (``FlowMatchScheduler.training_weight``, a bell centred on
    t = 0.5): ``(y(t) - y_min) * (1000 / sum_i (y(t_i) - y_min))`` over its 1000 training times t_i (shifted by the
    sample's ``shift``), so that the weights of its training table average 1; y_min is the table's, at t = 1 (the
    time farthest from 0.5), where the weight is 0. DiffSynth looks the weight up at the table's time nearest to its
    (discrete) time; ringdit's times are continuous, so the formula is evaluated at t itself."""
    low, total = _diffsynth_table(float(shift))
    return (_diffsynth_bell(t) - low) * (1000 / total)


class FlowMatching:
    # the samplers that fit this objective; the first is the default; fewstep: a distilled student's (DMD2)
    samplers = ("euler", "heun", "fewstep")

    def __init__(self, time_sampling: str = "logit_normal", logit_mean: float = 0.0, logit_std: float = 1.0,
                 shift: float | str = 1.0, resolution: dict | None = None, min_time: float = 0.0,
                 max_time: float = 1.0, loss_weighting: str = "none"):
        """``shift``: a number, or ``"resolution"`` (Flux's): ``resolution_mu`` of each sample's token count, so
        every bucket of a mixed-resolution set is shifted for its own size. ``resolution``: that shift's constants
        (``resolution_mu``'s keywords) where a model's pipeline has its own (LTX-Video's, Qwen-Image's, a pipeline
        folder's scheduler config, Flux.2's rule); None: Flux's.

        ``min_time`` / ``max_time``: the training times are the distribution's restricted to that range (its
        quantiles there: no draw is rejected, the shape within the range is kept). ``loss_weighting``: ``none``, or
        ``diffsynth`` (``diffsynth_weight`` of each sample's time, ``loss_weight``)."""
        check_flow({"time_sampling": time_sampling, "logit_mean": logit_mean, "logit_std": logit_std,
                    "min_time": min_time, "max_time": max_time, "loss_weighting": loss_weighting})
        if shift != "resolution" and (isinstance(shift, (str, bool)) or not shift > 0):
            raise ValueError(f"shift must be > 0 or 'resolution', got {shift!r}")
        self.resolution = dict(resolution or {})
        unknown = sorted(set(self.resolution) - set(RESOLUTION_SHIFT_KEYS))
        if unknown:
            raise ValueError(f"resolution takes {list(RESOLUTION_SHIFT_KEYS)}, got {unknown}")
        steps = self.resolution.get("empirical_mu_steps")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1
                                  or len(self.resolution) > 1):
            raise ValueError(f"resolution's empirical_mu_steps is a step count >= 1 without the linear rule's "
                             f"constants, got {self.resolution}")
        if self.resolution.get("time_shift_type", "exponential") not in TIME_SHIFT_TYPES:
            raise ValueError(f"resolution's time_shift_type is one of {TIME_SHIFT_TYPES}, got {self.resolution}")
        self.time_sampling, self.logit_mean, self.logit_std, self.shift = time_sampling, logit_mean, logit_std, shift
        self.min_time, self.max_time, self.loss_weighting = float(min_time), float(max_time), loss_weighting

    def shift_for(self, tokens: int | None) -> float:
        """The time shift of a sample of ``tokens`` model tokens (as an SD3 shift, ``shift_time``'s)."""
        if self.shift != "resolution":
            return self.shift
        if tokens is None:
            raise ValueError("shift='resolution' needs the sample's token count")
        return resolution_shift(tokens, **self.resolution)

    def shifted(self, t: Tensor, tokens: int | None) -> Tensor:
        """Unshifted times ``t`` moved by the shift of samples of ``tokens`` tokens: ``shift_time``, or for
        ``shift=resolution`` the scheduler's dynamic shift of ``resolution_mu`` in its own arithmetic
        (``dynamic_shift_time``), so that the times are the pipelines' to the last bit."""
        if self.shift != "resolution":
            return shift_time(t, self.shift)
        if tokens is None:
            raise ValueError("shift='resolution' needs the sample's token count")
        return dynamic_shift_time(t, resolution_mu(tokens, **self.resolution),
                                  self.resolution.get("time_shift_type", "exponential"))

    def time_range(self, within: tuple[float, float] | None = None) -> tuple[float, float]:
        """The range training times are drawn in: ``[min_time, max_time]``, within ``within`` (an expert's)."""
        if within is None:
            return self.min_time, self.max_time
        low, high = max(self.min_time, within[0]), min(self.max_time, within[1])
        if low >= high:
            raise ValueError(f"the times {within} lie outside min_time={self.min_time} .. max_time={self.max_time}")
        return low, high

    def sample_time(self, batch: int, generator: torch.Generator, tokens: int | None = None,
                    within: tuple[float, float] | None = None) -> Tensor:
        """(B,) training times in (0, 1) for samples of ``tokens`` tokens (used by ``shift='resolution'``), from
        ``generator`` alone (a sample's own: the same times whatever the rank layout). Restricted to ``min_time`` ..
        ``max_time`` and to ``within``, ``(low, high)`` (a two-expert model's expert trains on its own range of
        times): the same distribution's times in that range, by inverting its CDF, so no draw is rejected."""
        low, high = self.time_range(within)
        if (low, high) != (0.0, 1.0):
            start, end = (self._cumulative(edge, tokens) for edge in (low, high))
            quantile = start + (end - start) * torch.rand(batch, generator=generator, dtype=torch.float64)
            return self._time_at(quantile, tokens).float().clamp(low, high)
        if self.time_sampling == "uniform":
            t = torch.rand(batch, generator=generator, dtype=torch.float32)  # float32 whatever the default dtype:
        else:  # the same times in every precision (Lightning's 64-true makes float64 the default)
            t = torch.sigmoid(self.logit_mean + self.logit_std * torch.randn(batch, generator=generator,
                                                                             dtype=torch.float32))
        return self.shifted(t, tokens)

    def cumulative(self, t: float, tokens: int | None = None) -> float:
        """P(a training time <= t): the distribution ``sample_time`` draws from (restricted to ``min_time`` ..
        ``max_time``), for samples of ``tokens``."""
        if (self.min_time, self.max_time) == (0.0, 1.0):
            return self._cumulative(t, tokens)
        start, end = (self._cumulative(edge, tokens) for edge in (self.min_time, self.max_time))
        inside = self._cumulative(min(max(t, self.min_time), self.max_time), tokens)
        return (inside - start) / (end - start)

    def _cumulative(self, t: float, tokens: int | None = None) -> float:
        """P(a time <= t) before the restriction to ``min_time`` .. ``max_time``."""
        shift = self.shift_for(tokens)
        unshifted = torch.tensor(t / (shift - (shift - 1) * t), dtype=torch.float64)  # shift_time's inverse
        if self.time_sampling == "uniform":
            return float(unshifted)
        return float(torch.special.ndtr((torch.logit(unshifted) - self.logit_mean) / self.logit_std))

    def _time_at(self, quantile: Tensor, tokens: int | None) -> Tensor:
        """The training time whose ``_cumulative`` is ``quantile`` (float64)."""
        unshifted = quantile if self.time_sampling == "uniform" else \
            torch.sigmoid(self.logit_mean + self.logit_std * torch.special.ndtri(quantile))
        return self.shifted(unshifted, tokens)

    def loss_weight(self, t: Tensor, tokens: int | None = None) -> Tensor | None:
        """(B,) weights of the samples' losses at times ``t`` (``loss_weighting``); None: unweighted."""
        if self.loss_weighting == "none":
            return None
        return diffsynth_weight(t.double(), self.shift_for(tokens)).to(t.dtype)

    def add_noise(self, x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
        t = _broadcast(t, x0)
        return (1 - t) * x0 + t * noise

    def target(self, x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
        return noise - x0

    def model_time(self, t: Tensor) -> Tensor:
        return t * 1000.0


PREDICTIONS = ("epsilon", "v")
BETA_SCHEDULES = ("linear", "scaled_linear")
# which steps the ddim sampler visits: "linspace" (ringdit's, the original DiT's: linspace(T - 1, 0, steps) rounded,
# each step to the next one listed), or diffusers' "leading" / "trailing" (DDIMScheduler's, stepping back
# T // steps from each, as diffusers does)
TIMESTEP_SPACINGS = ("linspace", "leading", "trailing")


def check_ddpm(settings: dict, setting: str = "diffusion.objective") -> None:
    """A ConfigError naming the first DDPM setting of ``settings`` that cannot work, its value and what to give."""
    def refuse(key: str, why: str) -> None:
        raise ConfigError(f"{setting}.{key}={settings.get(key)!r} {why}")

    def number(key: str) -> bool:
        value = settings.get(key)
        return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)

    steps = settings.get("num_timesteps", 1000)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        refuse("num_timesteps", "is not a number of steps; give a whole number >= 2 (1000)")
    for key in ("beta_start", "beta_end"):
        if key in settings and not (number(key) and 0 < settings[key] < 1):
            refuse(key, "is not a beta in (0, 1); give e.g. 1e-4 .. 0.02 (linear) or 0.00085 .. 0.012 (scaled_linear)")
    if settings.get("beta_start", 1e-4) > settings.get("beta_end", 0.02):
        refuse("beta_start", f"is above beta_end={settings.get('beta_end', 0.02)!r}: betas grow with the step")
    choices = {"prediction": PREDICTIONS, "beta_schedule": BETA_SCHEDULES, "timestep_spacing": TIMESTEP_SPACINGS}
    for key, allowed in choices.items():
        if key in settings and settings[key] not in allowed:
            refuse(key, f"is not one of {', '.join(allowed)}")
    if "rescale_zero_snr" in settings and not isinstance(settings["rescale_zero_snr"], bool):
        refuse("rescale_zero_snr", "is not true or false")
    if "snr_shift_scale" in settings and not (number("snr_shift_scale") and settings["snr_shift_scale"] > 0):
        refuse("snr_shift_scale", "is not a number > 0; give 1.0 for no shift (CogVideoX 1.5 / 5B), 3.0 for "
                                  "CogVideoX-2B")
    if settings.get("rescale_zero_snr") and settings.get("prediction", "epsilon") == "epsilon":
        refuse("rescale_zero_snr", "with prediction=epsilon: the last step is pure noise, where noise predicts "
                                   "nothing of the data; set diffusion.objective.prediction=v (as CogVideoX)")


def rescale_zero_terminal_snr(alphas_cumprod: Tensor) -> Tensor:
    """The schedule's sqrt(alpha_bar) shifted to end at 0 and scaled to keep its first value (Lin et al. 2023,
    Algorithm 1), on alpha_bar as ``CogVideoXDDIMScheduler`` applies it."""
    root = alphas_cumprod.sqrt()
    first, last = root[0].clone(), root[-1].clone()
    return ((root - last) * (first / (first - last))).square()


class DDPM:
    samplers = ("ddim", "ddpm")  # the samplers that fit this objective; the first is the default

    def __init__(self, num_timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02,
                 learn_variance: bool = True, prediction: str = "epsilon", beta_schedule: str = "linear",
                 rescale_zero_snr: bool = False, snr_shift_scale: float = 1.0, timestep_spacing: str = "linspace"):
        """``learn_variance``: a model with learned-sigma channels is trained with the original DiT's hybrid loss,
        MSE on epsilon + the variational bound on the variance (``vb_bits``); off, those channels get no loss and
        drift when an original checkpoint is fine-tuned. No effect on models without a learned variance.

        ``prediction``, ``beta_schedule``, ``snr_shift_scale``, ``rescale_zero_snr``: the model's target and
        schedule (the module's docstring); their defaults are the original DiT's. ``timestep_spacing``: the steps the
        ddim sampler visits (``TIMESTEP_SPACINGS``), kept here with the schedule so that a checkpoint samples as it
        was configured."""
        check_ddpm({"num_timesteps": num_timesteps, "beta_start": beta_start, "beta_end": beta_end,
                    "prediction": prediction, "beta_schedule": beta_schedule, "rescale_zero_snr": rescale_zero_snr,
                    "snr_shift_scale": snr_shift_scale, "timestep_spacing": timestep_spacing})
        self.num_timesteps, self.learn_variance = num_timesteps, learn_variance
        self.prediction, self.timestep_spacing = prediction, timestep_spacing
        if beta_schedule == "linear":
            betas = torch.linspace(beta_start, beta_end, num_timesteps, dtype=torch.float64)  # the original's "linear"
        else:  # latent diffusion's, as diffusers' CogVideoXDDIMScheduler computes it (float64)
            betas = torch.linspace(beta_start**0.5, beta_end**0.5, num_timesteps, dtype=torch.float64) ** 2
        if snr_shift_scale == 1.0 and not rescale_zero_snr:
            self.posterior = GaussianPosterior(betas)
            self.alphas_cumprod = self.posterior.alphas_cumprod
            return
        # CogVideoXDDIMScheduler's order: the SNR shift, then the zero-terminal-SNR rescale, both on alpha_bar
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        alphas_cumprod = alphas_cumprod / (snr_shift_scale + (1 - snr_shift_scale) * alphas_cumprod)
        if rescale_zero_snr:
            alphas_cumprod = rescale_zero_terminal_snr(alphas_cumprod)
        self.alphas_cumprod = alphas_cumprod
        self.posterior = GaussianPosterior.respaced(alphas_cumprod, list(range(num_timesteps)))

    def sample_time(self, batch: int, generator: torch.Generator, tokens: int | None = None,
                    within: None = None) -> Tensor:
        """(B,) integer training steps in [0, num_timesteps) (``tokens``: unused, the schedule is the same for all;
        ``within``: a time range is FlowMatching's, for two-expert models, which train with flow matching only)."""
        if within is not None:
            raise ValueError("DDPM draws no time range: a two-expert model trains with diffusion=flow")
        return torch.randint(0, self.num_timesteps, (batch,), generator=generator)

    def add_noise(self, x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
        alpha_bar = self.alphas_cumprod.to(x0.device)[t.to(x0.device)]
        return _broadcast(alpha_bar.sqrt(), x0) * x0 + _broadcast((1 - alpha_bar).sqrt(), x0) * noise

    def target(self, x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
        if self.prediction == "epsilon":
            return noise
        alpha_bar = self.alphas_cumprod.to(x0.device)[t.to(x0.device)]  # v, as diffusers' get_velocity
        return _broadcast(alpha_bar.sqrt(), x0) * noise - _broadcast((1 - alpha_bar).sqrt(), x0) * x0

    def epsilon(self, x_t: Tensor, t: Tensor, prediction: Tensor) -> Tensor:
        """The noise a model's ``prediction`` at ``(x_t, t)`` stands for (t: (B,) steps of the full schedule)."""
        if self.prediction == "epsilon":
            return prediction
        alpha_bar = self.alphas_cumprod.to(x_t.device)[t.to(x_t.device)]
        return _broadcast(alpha_bar.sqrt(), x_t) * prediction + _broadcast((1 - alpha_bar).sqrt(), x_t) * x_t

    def model_time(self, t: Tensor) -> Tensor:
        return t.float()

    def vb_bits(self, x0: Tensor, x_t: Tensor, t: Tensor, eps: Tensor, variance_values: Tensor) -> Tensor:
        """The learned variance's loss per element (bits), added to the squared epsilon error as in the original
        (its loss type MSE: not rescaled by num_timesteps / 1000). ``eps``: the model's prediction (epsilon, or v
        under ``prediction=v``), detached here: the bound trains the variance only and leaves the mean to the MSE
        (the original's "frozen out" model output)."""
        return self.posterior.vb_bits(x0, x_t, t, self.epsilon(x_t, t, eps.detach()), variance_values)
