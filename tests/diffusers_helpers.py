"""What the diffusers-model test modules share to compare ringdit's model with the unmodified diffusers model: the
(ring, ulysses) layouts on 4 ranks, a forward and backward that collects the output and every parameter gradient, the
comparison with its tolerances, float64 kept through a model's float32 casts, Wan 2.2 TI2V's per-token timesteps, a
recorder of a transformer's calls, and the in-rank check that SGD steps under DDP / FSDP / LoRA equal one process."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from tests.helpers import architecture, assert_same_numbers

LAYOUTS = [(2, 1), (4, 1), (1, 2), (2, 2)]  # (ring, ulysses) on 4 ranks


def forward_backward(call, model, dout):
    model.zero_grad()
    out = call()
    (out * dout).sum().backward()
    # a parameter the model does not use here (QwenImage's last text-stream MLP) has no gradient on either side
    return out.detach(), {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def assert_matches_diffusers(out, grads, ref_out, ref_grads, where=""):
    """The prediction within 1e-5 (fp32, outputs of order 1: the rounding of another GEMM order and the ring's merges,
    ~1e-6 measured), every gradient within 1e-4 of its own largest entry (a sum over tokens, rounded more)."""
    assert_same_numbers(out, ref_out, atol=1e-5, where=f"{where} output")
    assert_same_numbers(grads, ref_grads, of_max=1e-4, where=f"{where} gradient")


def assert_matches_in_float64(got, expected, where=""):
    """(out, grads) against the reference's, float64 on both sides, where what is left is the order of sums (other
    GEMM shapes, the ring's merges): the prediction within 1e-13, every gradient within 1e-12 of the largest."""
    (out, grads), (ref_out, ref_grads) = got, expected
    assert_same_numbers(out, ref_out, atol=1e-13, where=f"{where} output")
    largest = max(grad.abs().max() for grad in ref_grads.values() if grad is not None)
    assert_same_numbers(grads, ref_grads, atol=1e-12 * largest, where=f"{where} gradient")


def ddp_average(grads: dict) -> dict:
    """Each rank's gradients averaged over every rank in place, as DDP does (the sequence-parallel ranks included):
    what must equal the one-device gradients. Collective."""
    import torch.distributed as dist

    for grad in (g for g in grads.values() if g is not None):
        dist.all_reduce(grad)
        grad /= dist.get_world_size()
    return grads


def sgd_steps(module, model, x0, cond, steps: int, lr: float, *, average: bool):
    """(losses, trained weights) of ``steps`` SGD steps of ``model`` on one batch through
    ``DiffusionModule.diffusion_loss`` (t, noise and the condition drop drawn per sample from fixed seeds); with
    ``average`` the gradients are averaged over the ranks as DDP does (FSDP reduces its own); the weights gathered
    whole."""
    import torch.distributed as dist

    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trained, lr=lr)
    losses = []
    for step in range(steps):
        generators = [torch.Generator().manual_seed(100 * step + i) for i in range(len(x0))]
        optimizer.zero_grad()
        loss = module.diffusion_loss(model, x0, cond, generators)
        loss.backward()
        if average:
            for p in trained:
                if p.grad is None:  # a parameter this loss does not reach (QwenImage's last text-stream MLP)
                    continue
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        optimizer.step()
        losses.append(loss.item())
    weights = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
               for name, p in model.named_parameters() if p.requires_grad}
    return losses, weights


def training_module(shape, objective: dict | None = None, sampler: str = "euler"):
    """The ``DiffusionModule`` whose ``diffusion_loss`` the SGD checks step: flow matching unless ``objective`` says
    otherwise, on data of latent ``shape`` ``([T,] H, W)``."""
    from ringdit.training import DiffusionModule

    return DiffusionModule(model={}, objective=objective or {"_target_": "ringdit.diffusion.FlowMatching"},
                           data={"image_size": list(shape), "latent_scale": 1.0},
                           sampling={"sampler": sampler, "steps": 2, "cfg_scale": 1.0, "shift": 1.0})


def video_audio_batch(shape, audio_shape, text_len: int):
    """(module, x0, cond): ``training_module`` and a fixed batch of 2 for a family that denoises sound with the video
    (LTX-2, MiniMax-H3): latents of ``shape``, text states (16 wide) whose first prompt has 5 real tokens, audio
    latents of ``audio_shape``."""
    g = torch.Generator().manual_seed(11)
    x0 = torch.randn(2, 4, *shape, generator=g)
    mask = torch.ones(2, text_len, dtype=torch.bool)
    mask[0, 5:] = False
    cond = {"text": torch.randn(2, text_len, 16, generator=g), "text_mask": mask,
            "audio": torch.randn(2, *audio_shape, generator=g)}
    return training_module(shape), x0, cond


def joint_loss_draws(model_config: dict, reference_class: str, preset: str, batch, tokens: int):
    """One process, float64, for a family that denoises sound with the video: (loss, reference, x0, cond, t, noise,
    audio_noise, x_t, audio_t) -- the module's loss on ``batch()``'s (module, x0, cond) with seeds 3 and 4 and no
    condition drop, the unmodified diffusers ``reference_class`` of ``conf/model/<preset>`` holding the model's
    weights, and the draws the loss made in its order (each sample's time over ``tokens`` tokens, the video's noise,
    the condition drop's, the audio's noise) with the latents they noise."""
    import diffusers

    from ringdit.diffusion import draw_noise
    from ringdit.models.build import build_model

    model, _ = build_model({**model_config, "condition_dropout_prob": 0.0}, seed=7)
    model.double()
    reference = getattr(diffusers, reference_class).from_config(architecture(preset)).double()
    reference.load_state_dict(model.transformer.state_dict())
    module, x0, cond = batch()
    x0, cond = x0.double(), {k: v.double() if v.is_floating_point() else v for k, v in cond.items()}
    seeds = [3, 4]
    loss = module.diffusion_loss(model, x0, cond, [torch.Generator().manual_seed(s) for s in seeds])

    generators = [torch.Generator().manual_seed(s) for s in seeds]  # the same draws, in the module's order
    t = torch.cat([module.objective.sample_time(1, g, tokens) for g in generators]).double()
    noise = draw_noise(x0.shape[1:], generators, dtype=torch.float64)
    [torch.rand(1, generator=g) for g in generators]  # the condition drop's draws
    audio_noise = draw_noise(cond["audio"].shape[1:], generators, dtype=torch.float64)
    x_t = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * noise  # (B, C, T, H, W)
    audio_t = (1 - t.view(-1, 1, 1, 1)) * cond["audio"] + t.view(-1, 1, 1, 1) * audio_noise
    return loss, reference, x0, cond, t, noise, audio_noise, x_t, audio_t


def sgd_run(model_config: dict, batch, steps: int, lr: float, dims=None, shard=None, lora=None):
    """(losses, weights) of ``steps`` SGD steps of the model ``model_config`` builds (seed 7) on ``batch()``'s
    (module, x0, cond) through ``DiffusionModule.diffusion_loss`` (t, noise and the condition drop drawn per sample),
    gradients averaged over the ranks as DDP does (FSDP reduces its own)."""
    from ringdit.models.build import build_model

    model, _ = build_model(model_config, dims=dims, shard=shard, lora=lora, seed=7)
    module, x0, cond = batch()
    return sgd_steps(module, model, x0, cond, steps, lr, average=shard is None and dims is not None)


def check_sgd_layouts(world: int, model_config: dict, batch, steps: int, lr: float, *,
                      fsdp=((1, 2),), check=None) -> None:
    """In each of ``world`` ranks: ``sgd_run``'s losses and weights at ring 2 under DDP, under FSDP at each (ring,
    ulysses) of ``fsdp`` and with LoRA (rank 4) at ring 2 equal one process's (run in this rank), and LoRA trains only
    the adapters; ``check(name, kind, weights)`` adds a family's own assertions (kind: ``full`` or ``lora``)."""
    from ringdit.parallel import build_shard_mesh, init_sequence_parallel
    from ringdit.training.fsdp import shard_model

    lora = {"rank": 4, "alpha": 8}
    run = functools.partial(sgd_run, model_config, batch, steps, lr)
    references = {"full": run(), "lora": run(lora=lora)}  # one process, in this rank
    runs = {"ddp ring 2": ("full", dict(dims=init_sequence_parallel(2, 1)))}
    for ring, ulysses in fsdp:  # every block a unit (every block of each list)
        name = f"fsdp ring {ring}" if ulysses == 1 else f"fsdp ulysses {ulysses}" if ring == 1 \
            else f"fsdp ring {ring} x ulysses {ulysses}"
        runs[name] = ("full", dict(dims=init_sequence_parallel(ring, ulysses),
                                   shard=functools.partial(shard_model, mesh=build_shard_mesh(world))))
    runs["lora ring 2"] = ("lora", dict(dims=init_sequence_parallel(2, 1), lora=lora))
    for name, (kind, options) in runs.items():
        losses, weights = run(**options)
        ref_losses, ref_weights = references[kind]
        # float32 (as train.py runs): a layout reorders sums only (tests/test_diffusers_training.py's tolerance)
        assert losses == pytest.approx(ref_losses, rel=1e-5), name
        assert_same_numbers(weights, ref_weights, atol=1e-5, where=name)
        if kind == "lora":  # only adapters train
            assert weights and all("lora_" in key for key in weights), sorted(weights)[:3]
        if check is not None:
            check(name, kind, weights)


def per_token_timesteps(shape, t):
    """(B, S) timesteps of the (T, H/2, W/2) tokens of latents ``shape`` (Wan's 1x2x2 patches): 0 on the first
    frame's tokens (the given image), ``t`` elsewhere, as Wan 2.2 TI2V samples."""
    frames, height, width = shape
    first_frame = torch.zeros(frames, height // 2, width // 2, dtype=torch.bool)
    first_frame[0] = True
    return torch.where(first_frame.flatten(), 0.0, t[:, None])  # (B, S)


def recorded_calls(transformer) -> list[dict]:
    """Every call's tensor keyword arguments, recorded as the transformer receives them."""
    calls = []
    transformer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append({k: v.clone() for k, v in kwargs.items()
                                                   if isinstance(v, torch.Tensor)}), with_kwargs=True)
    return calls


@contextlib.contextmanager
def float64_kept():
    """Models compute some of their math in float32 (``.float()``: Wan's FP32LayerNorm, QwenImage's RoPE): in a
    float64 model a gradient is rounded to float32 there, and a sum that a layout reorders by 1e-16 lands on another
    float32 value now and then (3e-8 of the largest gradient, measured at ring 2 for Wan VACE). To compare the plan at
    float64 precision, both sides run with ``.float()`` keeping float64 tensors as they are (the model's code otherwise
    unchanged)."""
    original = torch.Tensor.float

    def keep_float64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    torch.Tensor.float = keep_float64
    try:
        yield
    finally:
        torch.Tensor.float = original
