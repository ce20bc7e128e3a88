"""diffusion=ddpm's schedule settings against diffusers' own schedulers, in float64: CogVideoXDDIMScheduler (v
prediction, scaled_linear betas, its SNR shift, zero terminal SNR, trailing steps: CogVideoX's scheduler_config.json)
and DDIMScheduler (leading / trailing spacing, epsilon and v) -- alpha_bar, add_noise, get_velocity and DDIM steps --,
and one-line refusals of values that cannot work. The defaults (the original DiT's) are tests/test_ddpm_original.py's
and tests/test_diffusion.py's, unchanged."""

from __future__ import annotations

import pytest
import torch

from ringdit.diffusion import DDPM, sample
from ringdit.diffusion.samplers import ddim_timesteps, sample_ddim
from ringdit.common.errors import ConfigError

# CogVideoX 1.5 / 5B's scheduler (THUDM/CogVideoX1.5-5B scheduler/scheduler_config.json); CogVideoX-2B's shifts 3.0
COGVIDEOX = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "prediction_type":
             "v_prediction", "rescale_betas_zero_snr": True, "snr_shift_scale": 1.0, "timestep_spacing": "trailing",
             "set_alpha_to_one": True, "clip_sample": False, "steps_offset": 0, "num_train_timesteps": 1000}


def ours(config: dict) -> DDPM:
    """ringdit's DDPM for a diffusers scheduler config."""
    return DDPM(num_timesteps=config["num_train_timesteps"], beta_start=config["beta_start"],
                beta_end=config["beta_end"], beta_schedule=config["beta_schedule"],
                prediction={"epsilon": "epsilon", "v_prediction": "v"}[config["prediction_type"]],
                rescale_zero_snr=config.get("rescale_betas_zero_snr", False),
                snr_shift_scale=config.get("snr_shift_scale", 1.0), timestep_spacing=config["timestep_spacing"])


def cogvideox(**changes):
    from diffusers import CogVideoXDDIMScheduler

    config = {**COGVIDEOX, **changes}
    return CogVideoXDDIMScheduler(**config), ours(config)


@pytest.mark.parametrize("shift", [1.0, 3.0], ids=["cogvideox15_5b", "cogvideox_2b"])
def test_cogvideox_alpha_bar_add_noise_and_velocity_are_diffusers(shift):
    """float64 on both sides (CogVideoXDDIMScheduler computes scaled_linear in float64): alpha_bar bit for bit, 0 at
    the last step; add_noise and get_velocity (ringdit's v target) to the last bit or two."""
    scheduler, schedule = cogvideox(snr_shift_scale=shift)
    assert torch.equal(schedule.alphas_cumprod, scheduler.alphas_cumprod)
    assert schedule.alphas_cumprod[-1] == 0
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(4, 3, 2, 5, 5, generator=g, dtype=torch.float64), torch.randn(4, 3, 2, 5, 5, generator=g,
                                                                                          dtype=torch.float64)
    t = torch.tensor([0, 417, 998, 999])
    torch.testing.assert_close(schedule.add_noise(x0, noise, t), scheduler.add_noise(x0, noise, t), rtol=0, atol=1e-15)
    torch.testing.assert_close(schedule.target(x0, noise, t), scheduler.get_velocity(x0, noise, t), rtol=0, atol=1e-15)
    # the noise a v prediction stands for: exactly the noise where v is the truth
    torch.testing.assert_close(schedule.epsilon(schedule.add_noise(x0, noise, t), t, schedule.target(x0, noise, t)),
                               noise, rtol=0, atol=1e-14)


def velocity_model(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A deterministic stand-in for a v-predicting model, depending on x and the step."""
    return torch.tanh(x) * (t.double().reshape(-1, *[1] * (x.dim() - 1)) / 1000) - 0.3 * x.roll(1, dims=-1)


@pytest.mark.parametrize("steps", [1, 3, 7, 50])
def test_cogvideox_ddim_sampling_is_diffusers(steps):
    """The ddim sampler over CogVideoX's schedule equals CogVideoXDDIMScheduler's set_timesteps + step loop (as
    CogVideoXPipeline with that scheduler, eta 0), float64: the same steps (trailing, diffusers' previous step
    ``t - 1000 // steps`` where steps do not divide 1000), the same samples within 1e-13."""
    scheduler, schedule = cogvideox()
    scheduler.set_timesteps(steps)
    assert [step for step, _ in ddim_timesteps(1000, steps, "trailing")] == scheduler.timesteps.tolist()
    noise = torch.randn(2, 3, 2, 4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x = noise
    for t in scheduler.timesteps:
        x = scheduler.step(velocity_model(x, t.expand(2).double()), t, x, return_dict=False)[0]
    ringdit = sample_ddim(velocity_model, noise, steps, schedule)
    torch.testing.assert_close(ringdit, x, rtol=0, atol=1e-13)
    # sample(): the objective's default sampler is ddim
    guided = sample(lambda x, t, condition: velocity_model(x, t), schedule, noise, None, steps=steps)
    torch.testing.assert_close(guided, x, rtol=0, atol=1e-13)


@pytest.mark.parametrize("spacing", ["leading", "trailing"])
@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_ddim_scheduler_steps_are_diffusers(spacing, prediction):
    """DDIMScheduler (linear and scaled_linear betas, float32 there): alpha_bar within float32's rounding; given
    ringdit's float64 alpha_bar, its steps (leading / trailing, epsilon / v) are ringdit's within 1e-12 (epsilon's
    x0 divides by sqrt(alpha_bar): 1.4e-13 measured)."""
    from diffusers import DDIMScheduler

    for betas in ({"beta_start": 1e-4, "beta_end": 0.02, "beta_schedule": "linear"},
                  {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}):
        config = {"num_train_timesteps": 1000, "prediction_type": prediction, "timestep_spacing": spacing,
                  "set_alpha_to_one": True, "clip_sample": False, **betas}
        scheduler, schedule = DDIMScheduler(**config), ours(config)
        torch.testing.assert_close(schedule.alphas_cumprod, scheduler.alphas_cumprod.double(), rtol=2e-6, atol=0)
        scheduler.alphas_cumprod = schedule.alphas_cumprod.clone()  # the step's formulas, on one schedule
        scheduler.set_timesteps(20)
        assert [step for step, _ in ddim_timesteps(1000, 20, spacing)] == scheduler.timesteps.tolist()
        noise = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        x = noise
        for t in scheduler.timesteps:
            x = scheduler.step(velocity_model(x, t.expand(2).double()), t, x).prev_sample
        torch.testing.assert_close(sample_ddim(velocity_model, noise, 20, schedule), x, rtol=0, atol=1e-12)


def test_zero_terminal_snr_rescale_is_ddim_schedulers_on_betas():
    """DDIMScheduler rescales the betas, CogVideoX alpha_bar: the same schedule (within float32's rounding)."""
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              rescale_betas_zero_snr=True)
    schedule = DDPM(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", rescale_zero_snr=True,
                    prediction="v")
    torch.testing.assert_close(schedule.alphas_cumprod, scheduler.alphas_cumprod.double(), rtol=1e-5, atol=1e-7)


def test_v_training_target_and_the_ddpm_sampler_read_v():
    """The loss's target under prediction=v is v; the ancestral ddpm sampler, handed the true v, takes the same steps
    as when handed the true epsilon (without zero terminal SNR, which it refuses)."""
    from ringdit.diffusion import noise_generators

    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(2, 3, 4, 4, generator=g, dtype=torch.float64)
    eps_schedule, v_schedule = DDPM(), DDPM(prediction="v")
    generators = lambda: noise_generators([5, 6])  # noqa: E731
    noise = torch.randn(2, 3, 4, 4, generator=g, dtype=torch.float64)

    def truth(schedule):
        def model(x, t, condition):  # the exact prediction for data x0
            step = t.long()
            eps = (x - schedule.alphas_cumprod[step].sqrt().reshape(-1, 1, 1, 1) * x0) \
                / (1 - schedule.alphas_cumprod[step]).sqrt().reshape(-1, 1, 1, 1)
            return schedule.target(x0, eps, step)
        return model

    by_eps = sample(truth(eps_schedule), eps_schedule, noise, None, steps=10, sampler="ddpm", generators=generators())
    by_v = sample(truth(v_schedule), v_schedule, noise, None, steps=10, sampler="ddpm", generators=generators())
    torch.testing.assert_close(by_v, by_eps, rtol=0, atol=1e-10)


BAD = {
    "prediction": ("x0", r"diffusion.objective.prediction='x0' is not one of epsilon, v"),
    "beta_schedule": ("cosine", r"diffusion.objective.beta_schedule='cosine' is not one of linear, scaled_linear"),
    "timestep_spacing": ("even", r"diffusion.objective.timestep_spacing='even' is not one of linspace, leading, "
                                 r"trailing"),
    "snr_shift_scale": (0, r"diffusion.objective.snr_shift_scale=0 is not a number > 0; give 1.0"),
    "rescale_zero_snr": ("yes", r"diffusion.objective.rescale_zero_snr='yes' is not true or false"),
    "beta_end": (1.5, r"diffusion.objective.beta_end=1.5 is not a beta in \(0, 1\)"),
    "num_timesteps": (1, r"diffusion.objective.num_timesteps=1 is not a number of steps"),
}


@pytest.mark.parametrize("key", list(BAD))
def test_a_bad_ddpm_setting_is_one_line_naming_it(key):
    value, message = BAD[key]
    with pytest.raises(ConfigError, match=message) as raised:
        DDPM(**{key: value})
    assert "\n" not in str(raised.value)


def test_train_refuses_bad_ddpm_settings_before_spawning(tmp_path):
    """train.py's checks: a value, an unknown key, epsilon with a zero-SNR end, the ancestral sampler at alpha_bar
    0 -- each one line, before any rank."""
    from tests.helpers import prepare_train

    base = ["diffusion=ddpm", "model.hidden_size=32", "model.depth=1", "model.num_heads=2"]
    cases = [
        (["diffusion.objective.prediction=x0"], r"diffusion.objective.prediction='x0' is not one of epsilon, v"),
        (["+diffusion.objective.predicton=v"], r"diffusion.objective.predicton='v' is not a DDPM setting; use one "
                                                r"of .*prediction"),
        (["diffusion.objective.rescale_zero_snr=true"], r"rescale_zero_snr=True with prediction=epsilon: .*set "
                                                        r"diffusion.objective.prediction=v"),
        (["diffusion.objective.rescale_zero_snr=true", "diffusion.objective.prediction=v",
          "diffusion.sampling.sampler=ddpm"], r"diffusion.sampling.sampler=ddpm .*rescale_zero_snr=true: .*use "
                                              r"diffusion.sampling.sampler=ddim"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message) as raised:
            prepare_train([*base, *overrides], tmp_path / "run")
        assert "\n" not in str(raised.value)
    assert not (tmp_path / "run" / "checkpoints").exists()
