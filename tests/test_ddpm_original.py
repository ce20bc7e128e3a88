"""Fidelity to the original DiT (facebookresearch/DiT, whose Gaussian diffusion is OpenAI's guided-diffusion): its
sampler (ancestral DDPM with the learned variance over 250 respaced steps, guidance of 3 of 4 latent channels) and its
hybrid loss (MSE + the variational bound), against a transcription of the original formulas written out below --
numpy float64 tables indexed per step, as the original computes them -- not against ringdit's code."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ringdit.diffusion import DDPM, draw_noise, noise_generators, sample, space_timesteps
from ringdit.models import parallelize
from ringdit.training import DiffusionModule
from tests.helpers import tiny_dit

# ---- the transcription ---------------------------------------------------------------------------------------------


def original_space_timesteps(num_timesteps: int, section_counts: str) -> set[int]:
    """respace.py's space_timesteps for a comma-separated string of section counts."""
    section_counts = [int(x) for x in section_counts.split(",")]
    size_per = num_timesteps // len(section_counts)
    extra = num_timesteps % len(section_counts)
    start_idx, all_steps = 0, []
    for i, section_count in enumerate(section_counts):
        size = size_per + (1 if i < extra else 0)
        frac_stride = 1 if section_count <= 1 else (size - 1) / (section_count - 1)
        cur_idx, taken_steps = 0.0, []
        for _ in range(section_count):
            taken_steps.append(start_idx + round(cur_idx))
            cur_idx += frac_stride
        all_steps += taken_steps
        start_idx += size
    return set(all_steps)


class OriginalDiffusion:
    """gaussian_diffusion.py's GaussianDiffusion (LEARNED_RANGE variance, eps prediction), respaced as respace.py's
    SpacedDiffusion does; ``dtype``: the original extracts its coefficients as float32, float64 for tight checks."""

    def __init__(self, use_timesteps: set[int], dtype=torch.float32):
        base_betas = np.linspace(0.0001, 0.02, 1000, dtype=np.float64)  # get_named_beta_schedule("linear", 1000)
        base_alphas_cumprod = np.cumprod(1.0 - base_betas, axis=0)
        last_alpha_cumprod, new_betas, self.timestep_map = 1.0, [], []
        for i, alpha_cumprod in enumerate(base_alphas_cumprod):
            if i in use_timesteps:
                new_betas.append(1 - alpha_cumprod / last_alpha_cumprod)
                last_alpha_cumprod = alpha_cumprod
                self.timestep_map.append(i)
        betas = np.array(new_betas, dtype=np.float64)
        self.dtype, self.betas, self.num_timesteps = dtype, betas, len(betas)
        alphas = 1.0 - betas
        self.alphas_cumprod = np.cumprod(alphas, axis=0)
        self.alphas_cumprod_prev = np.append(1.0, self.alphas_cumprod[:-1])
        self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod)
        self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod - 1)
        self.posterior_variance = betas * (1.0 - self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.posterior_log_variance_clipped = np.log(np.append(self.posterior_variance[1], self.posterior_variance[1:]))
        self.posterior_mean_coef1 = betas * np.sqrt(self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.posterior_mean_coef2 = (1.0 - self.alphas_cumprod_prev) * np.sqrt(alphas) / (1.0 - self.alphas_cumprod)

    def extract(self, arr, timesteps, broadcast_shape):
        res = torch.from_numpy(arr)[timesteps].to(self.dtype)
        while len(res.shape) < len(broadcast_shape):
            res = res[..., None]
        return res + torch.zeros(broadcast_shape, dtype=self.dtype)

    def q_posterior_mean_variance(self, x_start, x_t, t):
        mean = (self.extract(self.posterior_mean_coef1, t, x_t.shape) * x_start
                + self.extract(self.posterior_mean_coef2, t, x_t.shape) * x_t)
        return mean, self.extract(self.posterior_log_variance_clipped, t, x_t.shape)

    def predict_xstart_from_eps(self, x_t, t, eps):
        return (self.extract(self.sqrt_recip_alphas_cumprod, t, x_t.shape) * x_t
                - self.extract(self.sqrt_recipm1_alphas_cumprod, t, x_t.shape) * eps)

    def p_mean_variance(self, model_output, x, t):
        """clip_denoised=False (DiT's sample.py and training loss)."""
        model_output, model_var_values = torch.split(model_output, x.shape[1], dim=1)
        min_log = self.extract(self.posterior_log_variance_clipped, t, x.shape)
        max_log = self.extract(np.log(self.betas), t, x.shape)
        frac = (model_var_values + 1) / 2
        model_log_variance = frac * max_log + (1 - frac) * min_log
        pred_xstart = self.predict_xstart_from_eps(x, t, model_output)
        model_mean, _ = self.q_posterior_mean_variance(pred_xstart, x, t)
        return model_mean, model_log_variance

    def p_sample_loop(self, model, z, step_noise):
        """``model(x, original_t)``; ``step_noise(i)`` is th.randn_like(x) of respaced step i."""
        x = z
        for i in list(range(self.num_timesteps))[::-1]:
            t = torch.tensor([i] * x.shape[0])
            mean, log_variance = self.p_mean_variance(model(x, torch.tensor(self.timestep_map)[t]), x, t)
            nonzero_mask = (t != 0).to(x.dtype).view(-1, *([1] * (len(x.shape) - 1)))
            x = mean + nonzero_mask * torch.exp(0.5 * log_variance) * step_noise(i)
        return x

    def vb_terms_bpd(self, model_output, x_start, x_t, t):
        true_mean, true_log_variance_clipped = self.q_posterior_mean_variance(x_start, x_t, t)
        mean, log_variance = self.p_mean_variance(model_output, x_t, t)
        kl = normal_kl(true_mean, true_log_variance_clipped, mean, log_variance)
        kl = kl.mean(dim=list(range(1, kl.dim()))) / np.log(2.0)
        decoder_nll = -discretized_gaussian_log_likelihood(x_start, means=mean, log_scales=0.5 * log_variance)
        decoder_nll = decoder_nll.mean(dim=list(range(1, decoder_nll.dim()))) / np.log(2.0)
        return torch.where(t == 0, decoder_nll, kl)

    def training_losses(self, model_output, x_start, t, noise):
        """LossType.MSE with a learned variance: mse + vb, the vb seeing the mean's output detached ("frozen")."""
        x_t = (self.extract(np.sqrt(self.alphas_cumprod), t, x_start.shape) * x_start
               + self.extract(np.sqrt(1.0 - self.alphas_cumprod), t, x_start.shape) * noise)
        C = x_t.shape[1]
        eps, model_var_values = torch.split(model_output, C, dim=1)
        frozen_out = torch.cat([eps.detach(), model_var_values], dim=1)
        vb = self.vb_terms_bpd(frozen_out, x_start, x_t, t)
        mse = (noise - eps).square().mean(dim=list(range(1, eps.dim())))
        return mse + vb


def normal_kl(mean1, logvar1, mean2, logvar2):
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2)
                  + ((mean1 - mean2) ** 2) * torch.exp(-logvar2))


def approx_standard_normal_cdf(x):
    return 0.5 * (1.0 + torch.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * torch.pow(x, 3))))


def discretized_gaussian_log_likelihood(x, *, means, log_scales):
    centered_x = x - means
    inv_stdv = torch.exp(-log_scales)
    cdf_plus = approx_standard_normal_cdf(inv_stdv * (centered_x + 1.0 / 255.0))
    cdf_min = approx_standard_normal_cdf(inv_stdv * (centered_x - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    cdf_delta = cdf_plus - cdf_min
    return torch.where(x < -0.999, log_cdf_plus,
                       torch.where(x > 0.999, log_one_minus_cdf_min, torch.log(cdf_delta.clamp(min=1e-12))))


def forward_with_cfg(model, x, t, y, cfg_scale):
    """models.py's DiT.forward_with_cfg: guidance of the first 3 channels only, on purpose."""
    half = x[: len(x) // 2]
    combined = torch.cat([half, half], dim=0)
    model_out = model(combined, t, y)
    eps, rest = model_out[:, :3], model_out[:, 3:]
    cond_eps, uncond_eps = torch.split(eps, len(eps) // 2, dim=0)
    half_eps = uncond_eps + cfg_scale * (cond_eps - uncond_eps)
    eps = torch.cat([half_eps, half_eps], dim=0)
    return torch.cat([eps, rest], dim=1)


def original_sample_py(model, labels, seeds, steps, cfg_scale, dtype):
    """sample.py with ``--num-sampling-steps steps``: the noise of sample i (the initial latent, then each step's
    ``randn_like`` row i) replayed from the generator seeded by seeds[i]; the null-class half's rows are other noise."""
    diffusion = OriginalDiffusion(original_space_timesteps(1000, str(steps)), dtype)
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    others = torch.Generator().manual_seed(12345)
    shape = (model.in_channels, *model.input_size)

    def rows():
        return torch.stack([torch.randn(shape, generator=g) for g in generators]).to(dtype)

    z = rows()
    z = torch.cat([z, z], 0)
    y = torch.cat([labels, torch.full_like(labels, model.null_label)], 0)
    step_noise = lambda i: torch.cat([rows(), torch.randn(z[len(labels):].shape, generator=others).to(dtype)])
    samples = diffusion.p_sample_loop(lambda x, t: forward_with_cfg(model, x, t, y, cfg_scale), z, step_noise)
    samples, _ = samples.chunk(2, dim=0)  # remove the null-class samples
    return samples


# ---- the tests -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 2, 7, 50, 250, 999, 1000])
def test_respacing_keeps_the_original_steps(steps):
    assert space_timesteps(1000, steps) == sorted(original_space_timesteps(1000, str(steps)))


def original_format_dit(dtype, dims=None):
    """A tiny original-format DiT: 4 latent channels, learned sigma (8 output channels), random weights; the math
    backend, over the mesh ``dims`` (default: one process)."""
    return parallelize(tiny_dit(in_channels=4, learn_sigma=True), dims=dims, backend="math").to(dtype).eval()


@pytest.mark.parametrize(("dtype", "steps", "tolerance"), [(torch.float64, 25, 1e-12), (torch.float32, 250, 2e-5)])
def test_ddpm_sampler_reproduces_the_original_sample_py(dtype, steps, tolerance):
    """sampler=ddpm steps=250 cfg_scale=4 guidance_channels=3 is the original sample.py for the same noise (fp64:
    25 steps, which respace the same way, to keep the test short)."""
    model, labels, seeds = original_format_dit(dtype), torch.tensor([3, 7, 0]), [11, 12, 13]
    expected = original_sample_py(model, labels, seeds, steps=steps, cfg_scale=4.0, dtype=dtype)
    generators = noise_generators(seeds)
    noise = draw_noise((4, 8, 8), generators, dtype=dtype)
    with torch.no_grad():
        ours = sample(model, DDPM(), noise, labels, steps=steps, cfg_scale=4.0, null=model.null_label,
                      sampler="ddpm", guidance_channels=3, generators=generators)
    error = (ours - expected).abs().max().item()
    print(f"{dtype}: max |ringdit - original| = {error:.3g} (samples' max |x| {expected.abs().max().item():.3g})")
    assert error < tolerance * expected.abs().max().item()
    if dtype == torch.float32:
        return
    # the 4th channel is what guiding all channels would change: the setting is not a no-op
    with torch.no_grad():
        all_guided = sample(model, DDPM(), noise, labels, steps=steps, cfg_scale=4.0, null=model.null_label,
                            sampler="ddpm", generators=noise_generators(seeds))
    assert (all_guided - expected).abs().max() > 1e-3


def test_the_sample_of_a_seed_is_the_same_in_any_batch():
    """The fresh noise of each step is drawn per sample: sample i does not depend on the rest of the batch (its size,
    the other samples, its position), checked in fp64."""
    model = original_format_dit(torch.float64)

    def draw(labels, seeds):
        generators = noise_generators(seeds)
        with torch.no_grad():
            return sample(model, DDPM(), draw_noise((4, 8, 8), generators, dtype=torch.float64), torch.tensor(labels),
                          steps=10, cfg_scale=2.0, null=model.null_label, sampler="ddpm", generators=generators)

    alone = draw([6], [2])[0]
    # Not in fp32: which GEMM kernel (so which order of the sums) runs depends on the batch size and the CPU, and
    # fp32's rounding (u = 6e-8) grows through 10 steps at CFG 2 to ~2e-7 of max|x| (~500 here; 5.5e-5 seen on one
    # element on a Xeon). In fp64 the same reordering costs u = 1.1e-16 times the same growth: ~1e-15 of max|x|
    # measured (the timestep features stay fp32, as in the original, but are elementwise: the same bits in any
    # batch). 1e-10 of max|x| leaves 10^5 of headroom, and is 10^3 below even fp32's rounding; a sample that saw
    # another sample's noise, or the batch's, would differ by O(1).
    tolerance = dict(rtol=1e-10, atol=1e-10 * alone.abs().max().item())
    torch.testing.assert_close(draw([5, 6], [1, 2])[1], alone, **tolerance)  # a batch of two, second
    torch.testing.assert_close(draw([6, 4, 5], [2, 0, 1])[0], alone, **tolerance)  # of three, first


def test_vb_term_matches_the_original_formulas():
    """KL(q || p) in bits for t > 0 and the discretized Gaussian decoder's NLL at t = 0, per sample."""
    g = torch.Generator().manual_seed(0)
    t = torch.tensor([0, 0, 1, 500, 999])
    x0 = torch.rand(5, 4, 8, 8, generator=g, dtype=torch.float64) * 2 - 1
    x0[:, 0, 0] = torch.tensor([-1.0, 1.0]).repeat(4)[:8]  # the end bins of the decoder
    x0[1] = (x0[1] * 127.5).round() / 127.5  # pixels on the 256 levels
    eps, values = torch.randn(5, 4, 8, 8, generator=g, dtype=torch.float64), torch.rand(5, 4, 8, 8, generator=g,
                                                                                           dtype=torch.float64) * 2 - 1
    ddpm, original = DDPM(), OriginalDiffusion(set(range(1000)), torch.float64)
    x_t = ddpm.add_noise(x0, torch.randn(5, 4, 8, 8, generator=g, dtype=torch.float64), t)
    ours = ddpm.vb_bits(x0, x_t, t, eps, values).mean(dim=(1, 2, 3))
    expected = original.vb_terms_bpd(torch.cat([eps, values], dim=1), x0, x_t, t)
    print("vb bits", expected.tolist(), "max error", (ours - expected).abs().max().item())
    torch.testing.assert_close(ours, expected, rtol=1e-11, atol=1e-12)


def hybrid_loss_module(learn_variance: bool = True) -> DiffusionModule:
    return DiffusionModule(model={}, objective={"_target_": "ringdit.diffusion.DDPM", "learn_variance": learn_variance},
                     data={})


def generators_for(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_hybrid_loss_is_the_original_mse_plus_vb_and_trains_the_sigma_head():
    """diffusion_loss (fp32, as training computes it) against the original's loss in fp64 on the same model output."""
    model, module = original_format_dit(torch.float32).train(), hybrid_loss_module()
    model.class_dropout_prob = 0.0  # no label drop: the transcription gets the labels as they are
    x0 = torch.rand(4, 4, 8, 8, generator=torch.Generator().manual_seed(1)) * 2 - 1
    labels, seeds = torch.tensor([1, 2, 3, 4]), [21, 22, 23, 24]
    loss = module.diffusion_loss(model, x0, labels, generators_for(seeds))
    # the draws diffusion_loss makes per sample: its step, then its noise
    generators = generators_for(seeds)
    t = torch.cat([torch.randint(0, 1000, (1,), generator=g) for g in generators])
    noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in generators])
    x_t = DDPM().add_noise(x0, noise, t)  # (checked against the original's q_sample in test_diffusion.py)
    with torch.no_grad():
        model_output = model(x_t, t.float(), labels).double()
    original = OriginalDiffusion(set(range(1000)), torch.float64)
    expected = original.training_losses(model_output, x0.double(), t, noise.double()).mean()
    error = abs(loss.item() - expected.item())
    print(f"loss {loss.item():.6f} (original, fp64: {expected.item():.6f}), |difference| = {error:.3g}")
    assert error < 1e-6 * expected.item()

    loss.backward()
    weight = model.final_layer.linear.weight.grad.unflatten(0, (-1, model.out_channels))  # (P, 2C, D)
    assert weight[:, 4:].abs().sum() > 0  # the sigma head learns
    model.zero_grad()
    hybrid_loss_module(learn_variance=False).diffusion_loss(model, x0, labels, generators_for(seeds)).backward()
    mse_only = model.final_layer.linear.weight.grad.unflatten(0, (-1, model.out_channels))
    assert mse_only[:, 4:].abs().sum() == 0  # without it, no loss reaches the sigma head
    # the bound sees the mean detached: the epsilon rows' gradients are the MSE's alone
    torch.testing.assert_close(weight[:, :4], mse_only[:, :4], rtol=1e-6, atol=1e-9)


def check_ddpm_under_layouts(rank, world):
    """The ddpm sampler (guidance_channels=3) and the hybrid loss under ring and Ulysses equal one process, with the
    model in fp64 (see test_the_sample_of_a_seed_is_the_same_in_any_batch: in fp32 a layout's other GEMM shapes
    reorder the sums, and 10 steps at CFG 4 grow that rounding to ~5e-7 of max|x| ~ 500)."""
    from ringdit.parallel import ParallelDims, init_sequence_parallel

    labels, seeds = torch.tensor([3, 5]), [7, 8]
    x0 = torch.rand(2, 4, 8, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 2 - 1
    results = {}
    for ring, ulysses in [(1, 1), (2, 1), (1, 2)]:
        dims = init_sequence_parallel(ring, ulysses) if ring * ulysses > 1 else ParallelDims()
        model = original_format_dit(torch.float64, dims)
        generators = noise_generators(seeds)
        with torch.no_grad():
            samples = sample(model, DDPM(), draw_noise((4, 8, 8), generators, dtype=torch.float64), labels, steps=10,
                             cfg_scale=4.0, null=model.null_label, sampler="ddpm", guidance_channels=3,
                             generators=generators)
        module = hybrid_loss_module()
        loss = module.diffusion_loss(model, x0, labels, generators_for([31, 32]))
        losses = [torch.zeros(()) for _ in range(world)]
        torch.distributed.all_gather(losses, loss.detach())
        # every rank holds the whole sample's loss (the prediction is gathered): the ranks' average is the loss
        results[(ring, ulysses)] = samples, torch.stack(losses).mean()
    reference, reference_loss = results[(1, 1)]
    for layout, (samples, loss) in results.items():
        # fp64 rounding (1.1e-16) grown as in fp32: ~6e-16 of max|x| measured; 1e-10 leaves 10^5 of headroom, and
        # a token lost or counted twice by the ring, or other noise, would differ by O(1)
        torch.testing.assert_close(samples, reference, rtol=1e-10, atol=1e-10 * reference.abs().max().item(),
                                   msg=str(layout))
        # the loss is fp32 whatever the model (diffusion_loss casts the prediction): a sum of 2 x 256 non-negative
        # terms, split over other ranks under a layout; pairwise summation rounds it by ~log2(512) u = 9 x 6e-8 =
        # 5e-7 of itself (1e-7 measured): 1e-5 is 20x that
        torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=0, msg=str(layout))


def test_ddpm_sampler_and_hybrid_loss_do_not_depend_on_the_layout():
    from tests.distributed import run_ranks

    run_ranks(check_ddpm_under_layouts, 2)


def test_guidance_channels_are_checked_at_config_time():
    from ringdit.common.errors import ConfigError
    from ringdit.spec import check_sampling

    model = {"_target_": "ringdit.models.DiT", "in_channels": 4, "class_dropout_prob": 0.1}
    objective = {"_target_": "ringdit.diffusion.DDPM"}
    check_sampling(model, objective, {"sampler": "ddpm", "steps": 250, "guidance_channels": 3})
    for bad in (0, 5, 2.5, True, "3"):
        with pytest.raises(ConfigError) as error:
            check_sampling(model, objective, {"guidance_channels": bad}, prefix="diffusion.sampling.")
        assert str(error.value) == (
            f"diffusion.sampling.guidance_channels={bad!r} is not a number of the model's 4 latent channels; use "
            f"null to guide all of them, or 1..4 (3: the original DiT's)")
    with pytest.raises(ConfigError, match=r"^steps=1001 is more than the DDPM schedule's 1000 steps; use at most 1000$"):
        check_sampling(model, objective, {"sampler": "ddpm", "steps": 1001})


def test_a_sampler_without_learned_variance_uses_the_original_fixed_large_variance():
    """learn_sigma=False: the original's FIXED_LARGE log variance, log(append(posterior_variance[1], betas[1:]))."""
    ddpm = DDPM()
    original = OriginalDiffusion(set(range(1000)), torch.float64)
    expected = np.log(np.append(original.posterior_variance[1], original.betas[1:]))
    t = torch.arange(1000)
    x = torch.zeros(1000, 1, dtype=torch.float64)
    _, log_variance = ddpm.posterior.p_mean_variance(x, t, x, None)
    np.testing.assert_allclose(log_variance[:, 0].numpy(), expected, rtol=1e-13)
    assert math.isfinite(log_variance.sum().item())
