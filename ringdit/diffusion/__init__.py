"""Diffusion math: training objectives (flow matching, DDPM) and samplers (Euler, Heun, DDIM) with CFG."""

from ringdit.diffusion.objectives import DDPM, FlowMatching, resolution_shift, shift_time
from ringdit.diffusion.samplers import classifier_free_guidance, initial_noise, sample, sample_ddim, sample_flow

__all__ = [
    "DDPM",
    "FlowMatching",
    "classifier_free_guidance",
    "initial_noise",
    "sample",
    "sample_ddim",
    "resolution_shift",
    "sample_flow",
    "shift_time",
]
