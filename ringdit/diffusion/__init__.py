"""Diffusion math: training objectives (flow matching, DDPM) and samplers (Euler, Heun, DDIM, DDPM) with CFG."""

from ringdit.diffusion.gaussian import GaussianPosterior, space_timesteps
from ringdit.diffusion.objectives import DDPM, FlowMatching, resolution_mu, resolution_shift, shift_time
from ringdit.diffusion.samplers import (
    classifier_free_guidance,
    draw_noise,
    flow_times,
    initial_noise,
    noise_generators,
    sample,
    sample_ddim,
    sample_ddpm,
    sample_flow,
)

__all__ = [
    "DDPM",
    "FlowMatching",
    "GaussianPosterior",
    "classifier_free_guidance",
    "draw_noise",
    "flow_times",
    "initial_noise",
    "noise_generators",
    "resolution_mu",
    "resolution_shift",
    "sample",
    "sample_ddim",
    "sample_ddpm",
    "sample_flow",
    "shift_time",
    "space_timesteps",
]
