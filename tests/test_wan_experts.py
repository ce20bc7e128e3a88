"""Wan 2.2 A14B's two experts (issue 24): the high-noise expert (``transformer``) denoises model times at and above
``boundary_ratio`` x 1000, the low-noise one (``transformer_2``) those below, as WanPipeline switches them. Each expert
matches the unmodified diffusers model under every layout; a training step trains one expert on times drawn from its
own range (the objective's distribution restricted, so ``expert=both`` trains on the unrestricted distribution); SGD
steps are the same on one process, a ring of 2 and FSDP; both experts load from and stay apart in their own folders and
checkpoint keys; and what a user can get wrong is refused in one line before anything starts."""

from __future__ import annotations

import csv
import os
from functools import partial

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ringdit.diffusion import FlowMatching
from ringdit.diffusion.experts import step_expert, time_range
from ringdit.common.errors import ConfigError
from ringdit.models import parallelize
from ringdit.parallel import init_sequence_parallel
from tests.diffusers_helpers import LAYOUTS, assert_matches_diffusers, forward_backward
from tests.distributed import run_ranks
from tests.families import assert_refused_before_spawning, assert_sgd_steps_equal_one_process_and_ring2
from tests.helpers import WAN, architecture, logged_losses, run

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = (3, 6, 6)  # latents (T, H, W): 27 tokens of 1x2x2 patches, tail-padded on every layout
BOUNDARY = 0.875  # Wan2.2-T2V-A14B's
TIMES = {"high": torch.tensor([875.0, 990.0]), "low": torch.tensor([12.0, 874.5])}  # model times either side


def experts_case(seed: int = 0, dims=None):
    """Two unmodified diffusers experts, a two-expert ringdit model holding their weights, inputs and dout."""
    import diffusers

    from ringdit.models.diffusers import DiffusersTransformer

    config = architecture("wan22_a14b_tiny")
    torch.manual_seed(seed)
    references = {"high": diffusers.WanTransformer3DModel.from_config(config),
                  "low": diffusers.WanTransformer3DModel.from_config(config)}
    model = DiffusersTransformer("wan", config=config, input_size=SHAPE, in_channels=4, text_len=7, text_dim=16,
                                 boundary_ratio=BOUNDARY)
    model.transformer.load_state_dict(references["high"].state_dict())
    model.transformer_2.load_state_dict(references["low"].state_dict())
    parallelize(model, dims=dims)
    g = torch.Generator().manual_seed(seed + 1)
    x, text, dout = torch.randn(2, 4, *SHAPE, generator=g), torch.randn(2, 7, 16, generator=g), \
        torch.randn(2, 4, *SHAPE, generator=g)
    return references, model, x, text, dout


def diffusers_prediction(transformer, x, t, text):
    return transformer(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]


def check_each_expert(model, references, x, text, dout, world: int = 1, where: str = ""):
    """For each expert's times: the output and every gradient of the expert that ran match its unmodified twin; the
    other expert got no gradient (it did not run)."""
    for expert, t in TIMES.items():
        reference = references[expert]
        ref_out, ref_grads = forward_backward(partial(diffusers_prediction, reference, x, t, text), reference, dout)
        out, grads = forward_backward(partial(model, x, t, {"text": text}), model, dout)
        ran = "transformer." if expert == "high" else "transformer_2."
        for grad in (g for g in grads.values() if g is not None):  # DDP's average over the dp x sp ranks
            if world > 1:
                dist.all_reduce(grad)
                grad /= world
        assert all(grads[name] is None for name in grads if not name.startswith(ran)), f"{where} {expert}"
        ours = {name[len(ran):]: grad for name, grad in grads.items() if name.startswith(ran)}
        assert_matches_diffusers(out, ours, ref_out, ref_grads, f"{expert} expert{where}")


def check_expert_layouts(rank, world):
    for ring, ulysses in LAYOUTS:
        references, model, x, text, dout = experts_case(dims=init_sequence_parallel(ring, ulysses))
        check_each_expert(model, references, x, text, dout, world, f", ring {ring} x ulysses {ulysses}")


def test_each_expert_matches_unmodified_diffusers_under_every_layout():
    """fp32 tolerances of tests/test_diffusers_models.py (the same reasoning), 27 tokens padded on every layout."""
    run_ranks(check_expert_layouts, 4)


def test_each_expert_on_one_process_and_the_boundary_is_wanpipelines():
    references, model, x, text, dout = experts_case()
    check_each_expert(model, references, x, text, dout)
    assert model.expert_at(torch.tensor([875.0])) == "high"  # WanPipeline: t >= boundary_ratio * 1000 is high noise
    assert model.expert_at(torch.tensor([874.99])) == "low"
    with pytest.raises(ValueError, match="straddle the experts' boundary 875"):
        model(x, torch.tensor([10.0, 900.0]), {"text": text})


def check_only_the_running_expert_is_gathered(rank, world):
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from ringdit.models.build import build_model
    from ringdit.parallel import build_shard_mesh
    from ringdit.training.fsdp import shard_model

    mesh = build_shard_mesh(world)
    config = {"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "wan",
              "config": architecture("wan22_a14b_tiny"), "boundary_ratio": BOUNDARY, "input_size": list(SHAPE),
              "in_channels": 4, "text_len": 7, "text_dim": 16}
    model, _ = build_model(config, dims=init_sequence_parallel(world, 1), shard=lambda m: shard_model(m, mesh))
    gathered, unshard = [], FSDPParamGroup.unshard

    def recording(group, *args, **kwargs):
        gathered.extend(group.modules)
        return unshard(group, *args, **kwargs)

    FSDPParamGroup.unshard = recording
    try:
        x, text = torch.randn(2, 4, *SHAPE), torch.randn(2, 7, 16)
        for expert, t in TIMES.items():
            gathered.clear()
            model(x, t, {"text": text}).square().sum().backward()
            idle = model.transformer_2 if expert == "high" else model.transformer
            running = model.transformer if expert == "high" else model.transformer_2
            idle_modules = set(idle.modules())
            assert gathered and not any(module in idle_modules for module in gathered), expert
            assert running in gathered and all(block in gathered for block in running.blocks), expert
            assert all(p.grad is None for p in idle.parameters()), expert
            assert all(p.grad is not None for p in running.parameters() if p.requires_grad), expert
            model.zero_grad(set_to_none=True)
    finally:
        FSDPParamGroup.unshard = unshard


def test_fsdp_gathers_only_the_expert_that_runs():
    """Each expert is its own FSDP unit (its blocks units within it): a step's forward and backward unshard the
    running expert's units and never the idle one's, whose parameters get no gradient."""
    run_ranks(check_only_the_running_expert_is_gathered, 2)


# ---- the times a step trains on ------------------------------------------------------------------------------------

OBJECTIVES = {"uniform, shift 3": FlowMatching("uniform", shift=3.0),
              "logit-normal, shift 5": FlowMatching("logit_normal", logit_mean=0.2, logit_std=1.3, shift=5.0)}


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_an_experts_times_are_the_objectives_restricted_to_its_range(name):
    """Drawn by the inverse CDF: every time in range; the draws' CDF is the restricted distribution's, i.e. the
    objective's CDF rescaled (Kolmogorov-Smirnov distance of 4000 fixed draws under 0.03, where a draw from the
    unrestricted or another distribution is off by > 0.1); the quantile map inverts the CDF to fp64 rounding."""
    objective = OBJECTIVES[name]
    for expert in ("high", "low"):
        low, high = time_range(expert, BOUNDARY)
        g = torch.Generator().manual_seed(7)
        t = torch.cat([objective.sample_time(1, g, within=(low, high)) for _ in range(4000)]).double()
        assert low <= float(t.min()) and float(t.max()) <= high
        below, above = objective.cumulative(low), objective.cumulative(high)
        restricted = torch.tensor([(objective.cumulative(v) - below) / (above - below) for v in t.tolist()])
        empirical = torch.arange(1, len(t) + 1, dtype=torch.float64) / len(t)
        assert float((restricted.sort().values - empirical).abs().max()) < 0.03, expert
    quantiles = torch.linspace(0.001, 0.999, 101, dtype=torch.float64)
    back = torch.tensor([objective.cumulative(v) for v in objective._time_at(quantiles, None).tolist()],
                        dtype=torch.float64)
    torch.testing.assert_close(back, quantiles, rtol=0, atol=1e-12)


def test_both_experts_together_train_on_the_unrestricted_times():
    """expert=both: each step's expert is drawn with its range's share, then the step's times from that range; over
    many steps the times are the unrestricted objective's (KS distance to its CDF under 0.03 on 4000 steps), and the
    high expert's share is the objective's mass above the boundary."""
    objective = OBJECTIVES["logit-normal, shift 5"]
    times, highs = [], 0
    for step in range(4000):
        expert = step_expert("both", BOUNDARY, objective, None, torch.Generator().manual_seed(10_000 + step))
        highs += expert == "high"
        times.append(float(objective.sample_time(1, torch.Generator().manual_seed(step),
                                                 within=time_range(expert, BOUNDARY))))
    cdf = torch.tensor([objective.cumulative(v) for v in sorted(times)])
    empirical = torch.arange(1, len(times) + 1, dtype=torch.float64) / len(times)
    assert float((cdf - empirical).abs().max()) < 0.03
    assert highs / 4000 == pytest.approx(1 - objective.cumulative(BOUNDARY), abs=0.03)
    assert step_expert("low", BOUNDARY, objective, None, torch.Generator()) == "low"


# ---- through train.py and infer.py ----------------------------------------------------------------------------------

A14B = [*WAN, "model=wan22_a14b_tiny", "trainer.max_steps=4", "callbacks.model_checkpoint.every_n_train_steps=4",
        "trainer.val_check_interval=4"]


def logged_expert_steps(run_dir) -> dict[str, list[int]]:
    """The steps each expert trained, from metrics.csv's train/loss_high / train/loss_low."""
    steps = {"high": [], "low": []}
    with open(next(run_dir.rglob("metrics.csv"))) as file:
        for row in csv.DictReader(file):
            for expert, trained in steps.items():
                if row.get(f"train/loss_{expert}"):
                    trained.append(int(row["step"]))
    return steps


def test_both_experts_sgd_steps_equal_on_one_process_ring2_and_fsdp_and_sample(tmp_path):
    """expert=both: 4 SGD steps, each training one expert (both occur), equal on one process, a ring of 2 (DDP finds
    the unused expert each step) and FSDP over a ring of 2 (each expert its own unit); the checkpoint keeps the experts
    apart; infer.py samples across the boundary with a guidance scale for each expert."""
    assert_sgd_steps_equal_one_process_and_ring2(tmp_path, A14B, steps=4)
    experts = logged_expert_steps(tmp_path / "ring1")
    assert experts["high"] and experts["low"], experts
    assert logged_expert_steps(tmp_path / "ring2") == experts
    run("train.py", tmp_path / "fsdp", *A14B, f"data.cache_dir={tmp_path / 'data'}", "trainer/strategy=fsdp",
        "ring_degree=2", env={"HF_HUB_OFFLINE": "1"})
    reference, sharded = logged_losses(tmp_path / "ring1"), logged_losses(tmp_path / "fsdp")
    for step in reference:
        assert sharded[step] == pytest.approx(reference[step], rel=1e-5), f"step {step}"

    ckpt = tmp_path / "ring1" / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)["state_dict"]
    high = {k[len("model.transformer."):] for k in state if k.startswith("model.transformer.")}
    low = {k[len("model.transformer_2."):] for k in state if k.startswith("model.transformer_2.")}
    assert high == low and high  # two whole experts, apart
    assert_exports_keep_the_experts_apart(ckpt, tmp_path / "export")
    for samples in (tmp_path / "guided", tmp_path / "guided_2"):
        scale_2 = f"diffusion.sampling.cfg_scale_2={1 if samples.name == 'guided_2' else 4}"
        run("infer.py", samples, f"ckpt_path={ckpt}", "num_samples=2", "diffusion.sampling.steps=4",
            "diffusion.sampling.cfg_scale=4", scale_2)
    first, second = (np.load(d / "samples.npz")["latents"] for d in (tmp_path / "guided", tmp_path / "guided_2"))
    assert first.shape == (2, 4, 3, 8, 8)
    assert not np.array_equal(first, second)  # the low-noise expert's steps are guided differently


def assert_exports_keep_the_experts_apart(ckpt, out):
    """format=diffusers: transformer/ and transformer_2/ that diffusers loads, holding each expert's EMA weights; and
    the export is refused for a file in the way, before anything is written."""
    import diffusers

    from ringdit.checkpoints.weights import read_weights
    from ringdit.export import main as export_main

    assert export_main([f"ckpt_path={ckpt}", f"out={out}", "format=diffusers"]) == 0
    ema, _ = read_weights(ckpt, "ema")
    for prefix, subfolder in (("transformer.", "transformer"), ("transformer_2.", "transformer_2")):
        loaded = diffusers.WanTransformer3DModel.from_pretrained(out, subfolder=subfolder).state_dict()
        assert loaded.keys() == {key[len(prefix):] for key in ema if key.startswith(prefix)}
        for name, value in loaded.items():
            torch.testing.assert_close(value, ema[prefix + name], rtol=0, atol=0)
    (out.parent / "a_file").write_text("mine")
    assert export_main([f"ckpt_path={ckpt}", f"out={out.parent / 'a_file'}", "format=diffusers"]) == 2
    assert export_main([f"ckpt_path={ckpt}", f"out={out}", "format=onnx"]) == 2
    assert (out.parent / "a_file").read_text() == "mine"


def test_one_expert_trains_and_the_other_stays_as_loaded(tmp_path):
    """expert=low: only transformer_2 changes (the high expert samples with the weights it had), and every step's
    times are the low expert's; resuming it with another expert setting is refused."""
    run("train.py", tmp_path / "low", *A14B, "diffusion.expert=low", "trainer.max_steps=2", "ema_decay=null",
        f"data.cache_dir={tmp_path / 'data'}", env={"HF_HUB_OFFLINE": "1"})
    from ringdit.models.build import build_model

    assert logged_expert_steps(tmp_path / "low") == {"high": [], "low": [0, 1]}
    checkpoint = torch.load(tmp_path / "low" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["hyper_parameters"]["expert"] == "low"
    initial = build_model(checkpoint["hyper_parameters"]["model"], seed=0)[0].state_dict()  # the run's seed
    trained = {name[len("model."):]: value for name, value in checkpoint["state_dict"].items()
               if name.startswith("model.")}
    changed = {name for name, value in initial.items() if not torch.equal(trained[name], value)}
    assert changed and all(name.startswith("transformer_2.") for name in changed), sorted(changed)[:3]
    # resuming it for both experts would load one expert's optimizer state into both's: refused before spawning
    assert_refused_before_spawning(tmp_path, [*A14B, f"ckpt_path={tmp_path / 'low' / 'checkpoints' / 'last.ckpt'}"],
                                   r"trained diffusion.expert=low but this run trains diffusion.expert=both")


def test_two_experts_load_from_a_diffusers_folder(tmp_path):
    """model.pretrained's transformer/ and transformer_2/ fill the experts, each its own weights."""
    import diffusers

    from ringdit.models.build import build_model
    from ringdit.commands.cli import model_preset
    from ringdit.models.diffusers import DiffusersTransformer

    config = architecture("wan22_a14b_tiny")
    saved = {}
    for seed, part in ((1, "transformer"), (2, "transformer_2")):
        torch.manual_seed(seed)
        expert = diffusers.WanTransformer3DModel.from_config(config)
        expert.save_pretrained(tmp_path / "a14b" / part)
        saved[part] = expert.state_dict()
    model_cfg = {**model_preset("wan22_a14b_tiny"), "pretrained": str(tmp_path / "a14b"), "config": None,
                 "input_size": list(SHAPE), "in_channels": 4, "text_len": 7, "text_dim": 16}
    model, _ = build_model(model_cfg)
    for part, state in saved.items():
        ours = getattr(model, part).state_dict()
        for name, value in state.items():
            torch.testing.assert_close(ours[name], value, rtol=0, atol=0)
    # the folder's own boundary (WanPipeline's model_index.json) must be the model's; one expert is not enough
    (tmp_path / "a14b" / "model_index.json").write_text('{"_class_name": "WanPipeline", "boundary_ratio": 0.9}')
    settings = {key: value for key, value in model_cfg.items() if key != "_target_"}
    with pytest.raises(ConfigError, match=r"model.boundary_ratio=0.875 but .* switches its experts at 0.9"):
        DiffusersTransformer(**settings)
    with pytest.raises(ConfigError, match=r"holds two experts \(transformer_2/, boundary_ratio=0.9\): use "):
        DiffusersTransformer(**{**settings, "boundary_ratio": None})


# ---- refused before anything starts ---------------------------------------------------------------------------------

BAD_EXPERTS = {
    "expert on a one-expert model": (["diffusion.expert=high"],
                                     r"diffusion.expert=high picks an expert of a two-expert model .* one transformer"),
    "an unknown expert": (["model=wan22_a14b_tiny", "diffusion.expert=middle"],
                          r"diffusion.expert='middle' is not one of high, low, both"),
    "a boundary of 1": (["model=wan22_a14b_tiny", "model.boundary_ratio=1.0"],
                        r"model.boundary_ratio=1.0 is not in \(0, 1\)"),
    "a boundary of 0": (["model=wan22_a14b_tiny", "model.boundary_ratio=0"], r"model.boundary_ratio=0 is not in"),
    "a boundary that is no number": (["model=wan22_a14b_tiny", "model.boundary_ratio=high"],
                                     r"model.boundary_ratio='high' must be a number or null"),
    "DDPM on two experts": (["model=wan22_a14b_tiny", "diffusion=ddpm", "diffusion.sampling.sampler=ddim"],
                            r"train it with diffusion=flow"),
    "cfg_scale_2 on a one-expert model": (["diffusion.sampling.cfg_scale_2=3"],
                                          r"cfg_scale_2=3 is the low-noise expert's guidance .* one transformer"),
}


@pytest.mark.parametrize("case", list(BAD_EXPERTS))
def test_bad_expert_settings_are_refused_before_spawning(case, tmp_path):
    overrides, message = BAD_EXPERTS[case]
    assert_refused_before_spawning(tmp_path, [*WAN, *overrides], message)


def test_step_caching_is_refused_on_two_experts():
    """infer.py's check (InferSpec calls it with the checkpoint's model built on meta), before any rank starts."""
    from ringdit.caching import CacheSettings
    from ringdit.caching import check_model as check_cache_model
    from ringdit.spec.model import build_on_meta

    meta = build_on_meta({"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "wan",
                          "config": architecture("wan22_a14b_tiny"), "boundary_ratio": BOUNDARY,
                          "input_size": list(SHAPE), "in_channels": 4, "text_len": 7, "text_dim": 16})
    for kind in ("fbcache", "teacache"):
        with pytest.raises(ConfigError, match=f"cache={kind} does not run on a two-expert model"):
            check_cache_model(CacheSettings(kind=kind, threshold=0.1), meta)
    check_cache_model(CacheSettings(), meta)  # cache=none samples as usual


def test_a_lora_export_puts_each_experts_adapter_where_diffusers_loads_it(tmp_path):
    """lora=true on a two-expert model: the high expert's adapter in out/, the low expert's in out/transformer_2/,
    both keyed transformer.* (load_lora_weights(..., load_into_transformer_2=True) reads that); each loads into a
    diffusers Wan transformer with the adapter's own numbers."""
    import diffusers

    from ringdit.models.lora import export_lora

    rank, config = 2, architecture("wan22_a14b_tiny")
    g = torch.Generator().manual_seed(0)
    state = {f"{expert}.blocks.0.attn1.to_q.lora_{part}.default.weight":
             torch.randn((rank, 24) if part == "A" else (24, rank), generator=g)
             for expert in ("transformer", "transformer_2") for part in "AB"}
    export_lora(state, {"rank": rank}, tmp_path / "adapter")
    for expert, folder in (("transformer", tmp_path / "adapter"), ("transformer_2", tmp_path / "adapter" /
                                                                    "transformer_2")):
        model = diffusers.WanTransformer3DModel.from_config(config)
        model.load_lora_adapter(str(folder), prefix="transformer", adapter_name="ours",
                                weight_name="pytorch_lora_weights.safetensors")
        loaded = model.blocks[0].attn1.to_q.lora_B["ours"].weight
        torch.testing.assert_close(loaded, state[f"{expert}.blocks.0.attn1.to_q.lora_B.default.weight"])
