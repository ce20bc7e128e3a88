"""Samplers: Euler and Heun for flow matching, DDIM and the original DiT's ancestral DDPM sampler for DDPM;
classifier-free guidance in one batched forward.

A model here is any callable ``model(x, t, condition) -> prediction`` with ``x`` shaped like the samples
``(B, C, ...)``; the prediction has C channels, or 2C for a model with a learned variance (the DiT's ``learn_sigma``:
the extra channels are the variance's interpolation values, which only the ``ddpm`` sampler reads). Sampling is
deterministic given the initial noise and, for the ``ddpm`` sampler, the per-sample generators of its fresh noise.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from ringdit.diffusion.gaussian import GaussianPosterior, space_timesteps
from ringdit.diffusion.objectives import DDPM, FlowMatching, shift_time
from ringdit.diffusion.schedulers import SCHEDULERS, is_scheduler_sampler, sample_with_scheduler, scheduler_config

Tensor = torch.Tensor
Condition = Tensor | dict[str, Tensor]
Model = Callable[[Tensor, Tensor, Condition], Tensor]


def is_guided(settings: dict) -> bool:
    """Whether sampling ``settings`` (``cfg_scale``, ``cfg_scale_2``) use classifier-free guidance (two halves per
    step); 1 is none (a distilled student's few steps)."""
    return settings.get("cfg_scale", 1.0) != 1.0 or settings.get("cfg_scale_2") not in (None, 1.0)


def classifier_free_guidance(model: Model, condition: Condition, null: int | Condition | None,
                             scale: float | Callable[[Tensor], float],
                             exchange: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None, half: int = 0,
                             channels: int | None = None):
    """``(x, t) -> uncond + scale * (cond - uncond)``: the conditional and unconditional halves share ONE forward.

    ``scale``: a number, or ``scale(t)`` per evaluation (a two-expert model guides each expert with its own scale).
    ``channels``: guide only the prediction's first ``channels`` channels and take the rest (further latent
    channels, a learned variance) from the conditional half, as the original DiT's ``forward_with_cfg`` does with 3
    of its 4 latent channels; None guides every channel.

    ``condition``: class labels ``(B,)``, or a dict of batch-first tensors (text embeddings ...). ``null``: the null
    class id, or the unconditional condition (same structure as ``condition``; the empty / negative prompt). At
    scale 1 guidance is the conditional prediction, so only that is computed.

    CFG parallel: with ``exchange``, this process computes only ``half`` (0: conditional, 1: unconditional) and
    ``exchange(prediction) -> (conditional, unconditional)`` swaps halves with its partner process.
    """
    if not callable(scale) and scale == 1.0:
        return lambda x, t: model(x, t, condition)
    if null is None:
        raise ValueError("classifier-free guidance needs a model trained with condition dropout (a null class or "
                         "prompt)")
    if isinstance(null, int):
        null = torch.full_like(condition, null)
    scale_at = scale if callable(scale) else lambda t: scale

    def guided(x: Tensor, t: Tensor) -> Tensor:
        strength = scale_at(t)
        if strength == 1.0 and exchange is None:  # (both halves of CFG parallel still exchange: they run in step)
            return model(x, t, condition)
        if exchange is not None:
            cond, uncond = exchange(model(x, t, _half_condition(condition, null) if half else condition))
        else:
            cond, uncond = model(torch.cat([x, x]), torch.cat([t, t]), _cat_conditions(condition, null)).chunk(2)
        if channels is None or channels >= cond.shape[1]:
            return uncond + strength * (cond - uncond)
        guided_part = uncond[:, :channels] + strength * (cond[:, :channels] - uncond[:, :channels])
        return torch.cat([guided_part, cond[:, channels:]], dim=1)

    return guided


def _float32_predictions(model: Model) -> Model:
    """``model`` whose predictions are cast to float32, as a pipeline that casts ``noise_pred.float()`` before its
    guidance sees them."""
    return lambda x, t, condition: model(x, t, condition).float()


def _half_condition(condition: Condition, null: Condition) -> Condition:
    """The unconditional half alone, shaped like ``condition`` (keys the null lacks are shared, see below)."""
    if isinstance(condition, dict):
        return {key: null.get(key, value).to(value).expand_as(value) for key, value in condition.items()}
    return null.to(condition).expand_as(condition)


def _cat_conditions(first: Condition, second: Condition) -> Condition:
    """Stack two conditions along the batch: tensors, or dicts of tensors key by key (a key the second lacks, such as
    a guidance-distilled model's guidance, is shared by both halves)."""
    if isinstance(first, dict):
        return {key: torch.cat([value, second.get(key, value).to(value).expand_as(value)]) for key, value in first.items()}
    return torch.cat([first, second])


def flow_times(steps: int, shift: float = 1.0, shift_terminal: float | None = None) -> Tensor:
    """The ``steps + 1`` times (float64) a flow sampler steps through, 1 to 0: even, then shifted (``shift_time``),
    then, with ``shift_terminal``, stretched so that the last time before 0 is ``shift_terminal``: diffusers'
    ``FlowMatchEulerDiscreteScheduler.stretch_shift_to_terminal`` (LTX-Video's scheduler ends its shifted sigmas at
    0.1, then steps to 0), which scales 1 - t; t = 1 and the final 0 stay."""
    times = shift_time(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64), shift)
    # one step has only t = 1 before 0, which no stretch moves (diffusers divides 0 by 0 there): left as it is
    if shift_terminal is not None and steps > 1:
        remaining = 1 - times[:-1]
        times[:-1] = 1 - remaining * (1 - shift_terminal) / remaining[-1]
    return times


@torch.no_grad()
def sample_flow(denoiser, noise: Tensor, steps: int, method: str = "euler", shift: float = 1.0,
                shift_terminal: float | None = None) -> Tensor:
    """Integrate dx/dt = v from t = 1 (noise) to t = 0 (data) over ``flow_times``. ``denoiser(x, model_time) ->
    velocity``."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if method not in ("euler", "heun"):
        raise ValueError(f"flow sampler must be 'euler' or 'heun', got {method!r}")
    times = flow_times(steps, shift, shift_terminal)
    x = noise
    batch = noise.shape[0]
    for t, t_next in zip(times[:-1].tolist(), times[1:].tolist()):
        velocity = denoiser(x, torch.full((batch,), t * 1000.0, device=x.device))
        x_next = x + (t_next - t) * velocity
        if method == "heun" and t_next > 0:  # Heun's correction; the last step to t = 0 stays Euler (as in EDM)
            velocity_next = denoiser(x_next, torch.full((batch,), t_next * 1000.0, device=x.device))
            x_next = x + (t_next - t) * 0.5 * (velocity + velocity_next)
        x = x_next
    return x


def ddim_timesteps(num_timesteps: int, steps: int, spacing: str = "linspace") -> list[tuple[int, int]]:
    """The (step, previous step) pairs the ddim sampler visits, from the noisiest; a previous step of -1 is the end
    (alpha_bar 1). ``linspace``: ringdit's (the original DiT's) ``linspace(T - 1, 0, steps)`` rounded, each step to
    the next one listed; ``leading`` / ``trailing``: diffusers' DDIMScheduler's ``set_timesteps`` (steps_offset 0),
    each step to the one ``T // steps`` before it, as its ``step`` goes (the next one listed where steps divide T)."""
    if spacing == "linspace":
        listed = torch.linspace(num_timesteps - 1, 0, steps, dtype=torch.float64).round().long().tolist()
        return list(zip(listed, [*listed[1:], -1]))
    if spacing == "leading":
        listed = (np.arange(0, steps) * (num_timesteps // steps)).round()[::-1].astype(np.int64)
    elif spacing == "trailing":
        listed = np.round(np.arange(num_timesteps, 0, -num_timesteps / steps)).astype(np.int64) - 1
    else:
        raise ValueError(f"timestep_spacing must be one of linspace, leading, trailing, got {spacing!r}")
    return [(int(step), int(step) - num_timesteps // steps) for step in listed]


@torch.no_grad()
def sample_ddim(denoiser, noise: Tensor, steps: int, schedule: DDPM, eta: float = 0.0,
                generator: torch.Generator | None = None, clip_denoised: bool = False) -> Tensor:
    """DDIM (Song et al., 2021) over ``steps`` steps spaced as ``schedule.timestep_spacing`` says
    (``ddim_timesteps``). ``denoiser(x, step) -> epsilon`` (or v, for a ``prediction=v`` schedule).

    ``eta`` > 0 adds fresh noise each step, drawn from ``generator``: under sequence parallelism the generator must
    give every rank of a group the same draws.
    """
    if not 1 <= steps <= schedule.num_timesteps:
        raise ValueError(f"steps must be in [1, {schedule.num_timesteps}], got {steps}")
    alphas = schedule.alphas_cumprod
    x = noise
    batch = noise.shape[0]
    for step, previous in ddim_timesteps(schedule.num_timesteps, steps, getattr(schedule, "timestep_spacing",
                                                                               "linspace")):
        alpha = alphas[step].item()
        alpha_prev = alphas[previous].item() if previous >= 0 else 1.0
        prediction = denoiser(x, torch.full((batch,), float(step), device=x.device))
        if getattr(schedule, "prediction", "epsilon") == "v":  # x0 and eps from v (alpha may be 0: zero terminal SNR)
            x0 = alpha**0.5 * x - (1 - alpha) ** 0.5 * prediction
            eps = alpha**0.5 * prediction + (1 - alpha) ** 0.5 * x
        else:
            eps = prediction
            x0 = (x - (1 - alpha) ** 0.5 * eps) / alpha**0.5
        if clip_denoised:
            x0 = x0.clamp(-1, 1)
            eps = (x - alpha**0.5 * x0) / (1 - alpha) ** 0.5
        sigma = eta * ((1 - alpha_prev) / (1 - alpha) * (1 - alpha / alpha_prev)) ** 0.5
        x = alpha_prev**0.5 * x0 + (1 - alpha_prev - sigma**2) ** 0.5 * eps
        if sigma > 0:
            x = x + sigma * torch.randn(x.shape, generator=generator, dtype=torch.float32).to(x)
    return x


@torch.no_grad()
def sample_ddpm(denoiser, noise: Tensor, steps: int, schedule: DDPM, generators: list[torch.Generator],
                clip_denoised: bool = False) -> Tensor:
    """The original DiT's sampler: ancestral sampling from p(x_{t-1} | x_t) with the learned variance, over the
    schedule respaced to ``steps`` (``space_timesteps(1000, "250")`` for its default 250). ``denoiser(x, step) ->
    (B, 2C, ...)`` epsilon and variance values, or ``(B, C, ...)`` epsilon alone (then the fixed large variance, the
    original's choice without learn_sigma); under ``prediction=v``, v in place of epsilon.

    Each step but the last adds fresh noise, sample i's from ``generators[i]``: every rank of a sequence-parallel
    group, and every split of the batch, draws the same noise for sample i.
    """
    kept = space_timesteps(schedule.num_timesteps, steps)  # ascending; the model sees these original steps
    posterior = GaussianPosterior.respaced(schedule.alphas_cumprod, kept)  # indexed by the respaced step i
    x = noise
    batch, channels = noise.shape[:2]
    for i in reversed(range(len(kept))):
        prediction = denoiser(x, torch.full((batch,), float(kept[i]), device=x.device))  # (B, C or 2C, ...)
        eps = schedule.epsilon(x, torch.full((batch,), kept[i], dtype=torch.long), prediction[:, :channels])
        variance_values = prediction[:, channels:] if prediction.shape[1] > channels else None
        step = torch.full((batch,), i, dtype=torch.long)
        mean, log_variance = posterior.p_mean_variance(x, step, eps, variance_values, clip_denoised)
        if i == 0:  # the last step returns the mean, as the original (which draws noise and masks it out)
            return mean
        x = mean + torch.exp(0.5 * log_variance) * draw_noise(x.shape[1:], generators, x.device, x.dtype)


# rCM's few-step grid (NVlabs/rcm's inference): TrigFlow times s = arctan(80) (sigma_max 80: where a consistency
# student starts, below s = pi/2, where sCM's consistency gradient vanishes), then 1.3, 1.0, 0.6 for 2 to 4 steps
CONSISTENCY_START_S = math.atan(80.0)
CONSISTENCY_MID_S = (1.3, 1.0, 0.6)


def consistency_times(steps: int) -> list[float]:
    """A consistency (sCM / rCM) student's flow times, rCM's TrigFlow grid through ``t = sin(s) / (cos(s) + sin(s))``
    (sigma_d = 1): 1 step 0.9877; 2: 0.9877, 0.7827; 4: 0.9877, 0.7827, 0.6090, 0.4062. More than 4 steps: s even
    from arctan(80) down."""
    if steps <= 1 + len(CONSISTENCY_MID_S):
        grid = [CONSISTENCY_START_S, *CONSISTENCY_MID_S[:steps - 1]]
    else:
        grid = [CONSISTENCY_START_S * (1 - i / steps) for i in range(steps)]
    return [math.sin(s) / (math.cos(s) + math.sin(s)) for s in grid]


def student_times(steps: int, times: list[float] | None = None) -> list[float]:
    """A few-step student's input times, 1 first: ``times`` when it holds ``steps`` of them (the grid a distilled
    student was trained on, recorded in its checkpoint); else, for a consistency student's grid (``times`` starting at
    ``consistency_times``' first), ``consistency_times(steps)``; else ``steps`` even ones, 1, 1 - 1/steps, ...
    (DMD2's 4-step 999, 749, 499, 249)."""
    if times is not None and len(times) == steps:
        return [float(t) for t in times]
    if times and math.isclose(times[0], consistency_times(1)[0], rel_tol=0, abs_tol=1e-12):
        return consistency_times(steps)
    return [1.0 - i / steps for i in range(steps)]


def fewstep_start(noise: Tensor, t: float) -> Tensor:
    """A few-step student's first input at time ``t`` (1: pure noise): the noise at the flow's scale there for data of
    unit scale, ``sqrt((1 - t)^2 + t^2) noise`` (TrigFlow's ``x_s = noise`` at the same point of the straight path,
    where rCM starts; exactly the noise at t = 1)."""
    return noise * math.sqrt((1 - t) ** 2 + t * t)


def fewstep_step(x: Tensor, t: Tensor | float, velocity: Tensor) -> Tensor:
    """The clean sample a flow model's ``velocity`` at ``(x, t)`` points to: ``x0 = x - t v``."""
    return x - (_as_column(t, x) * velocity)


def _as_column(t: Tensor | float, like: Tensor) -> Tensor | float:
    return t.reshape(-1, *([1] * (like.dim() - 1))).to(like.dtype) if torch.is_tensor(t) else t


@torch.no_grad()
def sample_fewstep(denoiser, noise: Tensor, times: list[float], generators: list[torch.Generator]) -> Tensor:
    """A distilled few-step student's sampler (DMD2's): from ``fewstep_start`` (the noise itself at t = 1), at each
    time of ``times`` the model's clean sample ``x - t v``; before the next time it is noised again with fresh noise,
    sample i's from ``generators[i]``: ``(1 - t') x0 + t' noise``. The last step's clean sample is the result.
    ``denoiser(x, model_time) -> velocity``."""
    x, batch = fewstep_start(noise, times[0]), noise.shape[0]
    for i, t in enumerate(times):
        x0 = fewstep_step(x, t, denoiser(x, torch.full((batch,), t * 1000.0, device=x.device)))
        if i + 1 == len(times):
            return x0
        t_next = times[i + 1]
        x = (1 - t_next) * x0 + t_next * draw_noise(x.shape[1:], generators, x.device, x.dtype)
    return x


def noise_generators(seeds: list[int]) -> list[torch.Generator]:
    """Sample i's generator, seeded by seeds[i]: its initial noise first, then the ddpm sampler's fresh noise."""
    return [torch.Generator().manual_seed(s) for s in seeds]


def draw_noise(shape: tuple[int, ...], generators: list[torch.Generator], device=None, dtype=torch.float32) -> Tensor:
    """(N, *shape): one N(0, 1) draw per generator, on the CPU (the same numbers on any device), then moved. Drawn in
    float32 whatever the default dtype (Lightning's ``trainer.precision=64-true`` makes it float64), then cast: a seed
    is the same noise in every precision."""
    return torch.stack([torch.randn(shape, generator=g, dtype=torch.float32) for g in generators]
                       ).to(device=device, dtype=dtype)


def initial_noise(shape: tuple[int, ...], seeds: list[int], device=None, dtype=torch.float32) -> Tensor:
    """One N(0, 1) sample per seed: sample i depends only on seeds[i], not on batch size or rank layout."""
    return draw_noise(shape, noise_generators(seeds), device, dtype)


def sample(model: Model, objective, noise: Tensor, condition: Condition, *, steps: int,
           cfg_scale: float | Callable[[Tensor], float] = 1.0,
           null: int | Condition | None = None, sampler: str | None = None, shift: float = 1.0,
           clip_denoised: bool = False, exchange=None, half: int = 0, guidance_channels: int | None = None,
           generators: list[torch.Generator] | None = None, shift_terminal: float | None = None,
           scheduler: dict | None = None, times: list[float] | None = None) -> Tensor:
    """Draw samples for ``condition`` (labels, or a dict of text tensors) starting from ``noise`` with the sampler that
    fits the objective; ``null`` is what classifier-free guidance guides away from (see ``classifier_free_guidance``),
    in the first ``guidance_channels`` channels (None: all of the samples' channels). Flow matching steps through
    ``flow_times(steps, shift, shift_terminal)``.

    ``sampler`` may also name one of diffusers' flow schedulers (``flow_euler``, ``unipc``, ``dpmpp``:
    ``ringdit.diffusion.schedulers``); ``scheduler`` then holds ``sample_with_scheduler``'s keywords (``config``,
    ``pipeline``, ``tokens``, ``resolution``, ``model_dtype``), default a config of ``shift`` and ``shift_terminal``.

    ``sampler="fewstep"`` (a distilled student's: ``sample_fewstep``) steps through ``times`` when it holds ``steps``
    times (the student's recorded grid), else through ``student_times(steps)``; it draws fresh noise from
    ``generators``.

    Deterministic given the noise and, for the ``ddpm`` and ``fewstep`` samplers, ``generators`` (sample i's fresh
    noise comes from generators[i], see ``noise_generators``): every rank of a sequence-parallel group computes the
    same samples and sample i depends only on its own noise.
    """
    sampler = sampler or objective.samplers[0]
    flow = isinstance(objective, FlowMatching)
    if sampler not in objective.samplers and not (flow and is_scheduler_sampler(sampler)):
        schedulers = f" or one of diffusers' flow schedulers {tuple(SCHEDULERS)}" if flow else ""
        raise ValueError(f"sampler={sampler!r} does not fit the {type(objective).__name__} objective; use one of "
                         f"{objective.samplers}{schedulers}")
    channels = noise.shape[1]
    if is_scheduler_sampler(sampler) and getattr((scheduler or {}).get("pipeline"), "float32_prediction", False):
        model = _float32_predictions(model)  # LTXPipeline rounds each half to float32 before guidance combines them
    guided = classifier_free_guidance(model, condition, null, cfg_scale, exchange, half,
                                      channels=guidance_channels or channels)
    if sampler == "ddpm":
        if generators is None:
            raise ValueError("the ddpm sampler draws fresh noise each step: pass generators, one per sample "
                             "(noise_generators(seeds))")
        return sample_ddpm(guided, noise, steps, objective, generators, clip_denoised=clip_denoised)
    denoiser = lambda x, t: guided(x, t)[:, :channels]  # the other samplers ignore a learned variance
    if sampler == "fewstep":
        if generators is None:
            raise ValueError("the fewstep sampler noises each step's sample again: pass generators, one per sample "
                             "(noise_generators(seeds))")
        return sample_fewstep(denoiser, noise, student_times(steps, times), generators)
    if is_scheduler_sampler(sampler):
        settings = scheduler or {"config": scheduler_config(sampler, shift=shift, shift_terminal=shift_terminal)}
        return sample_with_scheduler(denoiser, noise, steps, sampler, **settings)
    if isinstance(objective, FlowMatching):
        return sample_flow(denoiser, noise, steps, method=sampler, shift=shift, shift_terminal=shift_terminal)
    if isinstance(objective, DDPM):
        return sample_ddim(denoiser, noise, steps, objective, clip_denoised=clip_denoised)
    raise TypeError(f"unknown objective {type(objective).__name__}")
