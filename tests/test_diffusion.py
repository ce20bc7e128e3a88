"""Objectives and samplers against closed-form answers; CFG; determinism; a tiny DiT overfits a fixed batch."""

from __future__ import annotations

import pytest
import torch

from ringdit.diffusion import (
    DDPM,
    FlowMatching,
    classifier_free_guidance,
    initial_noise,
    sample,
    sample_ddim,
    shift_time,
)
from tests.helpers import scheduler_sigmas, tiny_dit


def test_flow_matching_formulas():
    flow = FlowMatching(time_sampling="uniform")
    x0, noise, t = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4), torch.tensor([0.0, 0.25, 1.0])
    x_t = flow.add_noise(x0, noise, t)
    torch.testing.assert_close(x_t[0], x0[0])
    torch.testing.assert_close(x_t[1], 0.75 * x0[1] + 0.25 * noise[1])
    torch.testing.assert_close(x_t[2], noise[2])
    torch.testing.assert_close(flow.target(x0, noise, t), noise - x0)
    torch.testing.assert_close(flow.model_time(t), t * 1000)
    assert shift_time(torch.tensor(0.5), 3.0).item() == pytest.approx(0.75)  # s t / (1 + (s - 1) t)
    g = torch.Generator().manual_seed(0)
    logit = FlowMatching("logit_normal").sample_time(10_000, g)
    assert 0 < logit.min() and logit.max() < 1 and abs(logit.median().item() - 0.5) < 0.02


def test_ddpm_uses_the_original_linear_schedule():
    ddpm = DDPM()
    betas = 1 - ddpm.alphas_cumprod / torch.cat([torch.ones(1, dtype=torch.float64), ddpm.alphas_cumprod[:-1]])
    torch.testing.assert_close(betas, torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64))
    x0, noise = torch.randn(2, 3), torch.randn(2, 3)
    t = torch.tensor([0, 999])
    x_t = ddpm.add_noise(x0, noise, t)
    alpha = ddpm.alphas_cumprod[t].float()[:, None]
    torch.testing.assert_close(x_t, alpha.sqrt() * x0 + (1 - alpha).sqrt() * noise)
    torch.testing.assert_close(ddpm.target(x0, noise, t), noise)


@pytest.mark.parametrize("method", ["euler", "heun"])
def test_flow_samplers_follow_the_exact_velocity_to_the_data(method):
    """With one data point x*, the exact velocity at (x_t, t) is (x_t - x*) / t: both samplers land on x*."""
    target = torch.randn(2, 1, 4, 4)

    def velocity(x, model_time):
        t = (model_time / 1000).reshape(-1, 1, 1, 1)
        return (x - target) / t

    out = sample(lambda x, t, y: velocity(x, t), FlowMatching(), torch.randn(2, 1, 4, 4), torch.zeros(2).long(),
                 steps=7, sampler=method)
    torch.testing.assert_close(out, target, rtol=1e-5, atol=1e-5)


def test_ddim_with_the_exact_noise_recovers_the_data():
    ddpm, x0 = DDPM(), torch.randn(2, 3, 4, 4)

    def epsilon(x, step):  # the exact epsilon of the single data point x0
        alpha = ddpm.alphas_cumprod[step.long()].float().reshape(-1, 1, 1, 1)
        return (x - alpha.sqrt() * x0) / (1 - alpha).sqrt()

    out = sample(lambda x, t, y: epsilon(x, t), ddpm, torch.randn(2, 3, 4, 4), torch.zeros(2).long(), steps=10)
    torch.testing.assert_close(out, x0, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("objective", "sampler", "eta"), [(FlowMatching(), "euler", 0.0), (FlowMatching(), "heun", 0.0),
                                                            (DDPM(), "ddim", 0.0), (DDPM(), "ddim", 1.0)])
def test_sampling_is_deterministic_given_the_seeds(objective, sampler, eta):
    model = tiny_dit()
    labels = torch.tensor([1, 2])

    def draw(seeds, generator_seed=0):
        noise = initial_noise((3, 8, 8), seeds)
        if eta > 0:  # DDIM's stochastic variant: its fresh noise comes from the generator
            guided = classifier_free_guidance(lambda x, t, y: model(x, t, y)[:, :3], labels, model.null_label, 1.5)
            return sample_ddim(guided, noise, 3, objective, eta=eta,
                               generator=torch.Generator().manual_seed(generator_seed))
        return sample(lambda x, t, y: model(x, t, y)[:, :3], objective, noise, labels, steps=3, cfg_scale=1.5,
                      null=model.null_label, sampler=sampler)

    torch.testing.assert_close(draw([5, 6]), draw([5, 6]), rtol=0, atol=0)
    assert not torch.allclose(draw([5, 6]), draw([7, 6]))
    if eta == 0:  # deterministic samplers: sample i depends on seeds[i] only, not on the rest of the batch
        torch.testing.assert_close(draw([5, 6])[1], draw([9, 6])[1], rtol=1e-5, atol=1e-6)


def test_cfg_scale_one_is_the_conditional_prediction_and_guidance_is_one_batched_forward():
    model = tiny_dit().double()  # fp64: guidance's forward of 4 is compared with two of 2 (see below)
    calls = []

    def counted(x, t, y):
        calls.append(x.shape[0])
        return model(x, t, y)

    x, t, labels = torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.tensor([300.0, 700.0]), torch.tensor([3, 4])
    conditional = model(x, t, labels)
    torch.testing.assert_close(classifier_free_guidance(counted, labels, model.null_label, 1.0)(x, t), conditional,
                               rtol=0, atol=0)
    assert calls == [2]
    calls.clear()
    guided = classifier_free_guidance(counted, labels, model.null_label, 4.0)(x, t)
    assert calls == [4]  # conditional and unconditional halves in one forward
    unconditional = model(x, t, torch.full_like(labels, model.null_label))
    # A batch of 4 against two of 2: other GEMM shapes, so other orders of the sums. fp32 rounds that to ~1e-6 of
    # max|out| measured (x 7 for 4 c - 3 u), and other CPUs' kernels may differ more; fp64 to ~2e-15. 1e-10 leaves
    # 10^5 of headroom; a swapped or mislabelled half is off by O(1).
    expected = unconditional + 4.0 * (conditional - unconditional)
    torch.testing.assert_close(guided, expected, rtol=1e-10, atol=1e-10 * expected.abs().max().item())


def test_a_tiny_dit_overfits_a_fixed_batch():
    torch.manual_seed(0)
    model = tiny_dit(learn_sigma=False)
    flow = FlowMatching()
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(4, 3, 8, 8, generator=g).tanh(), torch.randn(4, 3, 8, 8, generator=g)
    t, labels = torch.tensor([0.2, 0.4, 0.6, 0.8]), torch.tensor([0, 1, 2, 3])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(150):
        loss = (model(flow.add_noise(x0, noise, t), flow.model_time(t), labels) - flow.target(x0, noise, t)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 20, f"loss {losses[0]:.3f} -> {losses[-1]:.4f}"


# ---- the flow sampler's time grid: diffusers' scheduler's sigmas, as train.py and infer.py sample ------------------


def test_a_terminal_stretch_is_diffusers_for_any_shift():
    """``flow_times``' stretch against the scheduler with a fixed shift and shift_terminal (not only LTX-Video's
    dynamic shift); one step has only t = 1 before 0, which it leaves (diffusers divides 0 by 0 there)."""
    from ringdit.diffusion import flow_times

    for shift, terminal, steps in ((1.0, 0.1, 10), (3.0, 0.05, 7), (12.0, 0.2, 4)):
        expected = scheduler_sigmas({"shift": shift, "shift_terminal": terminal}, steps)
        torch.testing.assert_close(flow_times(steps, shift, terminal), expected, rtol=0, atol=1e-6)
        assert flow_times(steps, shift, terminal)[-2].item() == pytest.approx(terminal, abs=1e-12)
    torch.testing.assert_close(flow_times(1, 3.0, 0.1), torch.tensor([1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(flow_times(5, 2.0, None), shift_time(torch.linspace(1, 0, 6, dtype=torch.float64), 2.0))


def test_bad_sampling_times_are_refused_in_one_line(tmp_path):
    """diffusion.sampling.shift_terminal / infer.py's shift_terminal outside (0, 1) or on DDPM, and a
    diffusion.objective.resolution that resolution_shift cannot take: ConfigErrors naming setting, value and fix
    (train.py reports them as one line before spawning, like every spec check)."""
    from ringdit.common.errors import ConfigError
    from ringdit.spec.diffusion import check_resolution, check_sampling
    from tests.helpers import assert_refused, fail_fast

    flow, DIT = {"_target_": "ringdit.diffusion.FlowMatching"}, {"_target_": "ringdit.models.DiT"}
    for value in (1, 0, -0.1, float("nan"), "abc", True, [0.1]):
        with pytest.raises(ConfigError, match=r"^diffusion.sampling.shift_terminal=.* is not a time in \(0, 1\): "
                                              r"give the last non-zero sampling time"):
            check_sampling(DIT, flow, {"shift_terminal": value}, prefix="diffusion.sampling.")
    for fine in (None, False, 0.1):
        check_sampling(DIT, flow, {"shift_terminal": fine})
    with pytest.raises(ConfigError, match=r"^shift_terminal=0.1 stretches a flow sampler's times, but this is the "
                                          r"DDPM objective; leave shift_terminal null"):
        check_sampling(DIT, {"_target_": "ringdit.diffusion.DDPM"}, {"shift_terminal": 0.1})
    for resolution, message in (
            ({"empirical_mu_steps": 0}, r"empirical_mu_steps=0 is not a number of steps; give a whole number >= 1"),
            ({"empirical_mu_steps": 200, "base_shift": 1.0}, r"replaces the linear rule, whose constants would"),
            ({"base_seq_len": 1024}, r"is not a map of resolution_shift's constants \(base_tokens, "),
            ("abc", r"='abc' is not a map")):
        with pytest.raises(ConfigError, match=rf"^diffusion.objective.resolution.*{message}"):
            check_resolution(resolution)
    proc, seconds = fail_fast("infer.py", "diffusion.sampling.shift_terminal=2",
                              f"hydra.run.dir={tmp_path}")  # before the checkpoint
    assert_refused(proc, r"^Error: diffusion.sampling.shift_terminal=2 is not a time in \(0, 1\)", seconds=seconds, run_dir=tmp_path)
