"""Flow matching's training times and loss weights: the dynamic (resolution) shift against diffusers' own functions,
min_time / max_time, DiffSynth-Studio's loss weighting, and the refusals of their bad values."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from ringdit.diffusion import FlowMatching
from ringdit.diffusion.objectives import diffsynth_weight
from ringdit.common.errors import ConfigError

# Qwen/Qwen-Image's scheduler/scheduler_config.json (its dynamic-shift keys), which QwenImagePipeline passes to
# calculate_shift
QWEN_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
                  "max_image_seq_len": 8192, "max_shift": 0.9, "shift": 1.0, "shift_terminal": 0.02,
                  "use_dynamic_shifting": True, "time_shift_type": "exponential"}
QWEN_MODEL = {"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "qwenimage"}
TOKENS = (16, 256, 1024, 3600, 4096, 8192, 16384)  # below, at and beyond the base / max token counts


def pipeline_times(config: dict, calculate_shift, tokens: int, t: torch.Tensor) -> torch.Tensor:
    """``t`` shifted as the pipeline shifts its scheduler's sigmas for ``tokens`` image tokens: mu from diffusers'
    ``calculate_shift`` with the scheduler config's constants, then the scheduler's own ``time_shift``."""
    import diffusers

    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(config)
    mu = calculate_shift(tokens, scheduler.config.get("base_image_seq_len", 256),
                         scheduler.config.get("max_image_seq_len", 4096), scheduler.config.get("base_shift", 0.5),
                         scheduler.config.get("max_shift", 1.15))
    return scheduler.time_shift(mu, 1.0, t)


def unshifted_times() -> torch.Tensor:
    return torch.cat([torch.tensor([0.0, 1.0]), torch.rand(64, generator=torch.Generator().manual_seed(0))]).double()


@pytest.mark.parametrize("pipeline", ["flux", "qwenimage"])
def test_the_resolution_shift_is_the_pipelines_to_the_last_bit(pipeline):
    """shift=resolution's times for 16 .. 16384 image tokens equal, in fp64 and bit for bit, what FluxPipeline /
    QwenImagePipeline do to their sigmas: their calculate_shift with their scheduler config's base / max, then
    FlowMatchEulerDiscreteScheduler's exponential time_shift (use_dynamic_shifting). The constants are the ones
    train.py resolves for the model (resolve_shift: Flux's for the DiT, Qwen-Image's for model.family=qwenimage)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift as flux_shift
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift as qwen_shift

    from ringdit.spec import resolve_shift

    model, config, calculate_shift = {
        "flux": ({"_target_": "ringdit.models.DiT"}, {"use_dynamic_shifting": True}, flux_shift),
        "qwenimage": (QWEN_MODEL, QWEN_SCHEDULER, qwen_shift)}[pipeline]
    objective = {"shift": "resolution", "time_sampling": "uniform"}
    resolve_shift(objective, {}, 256, model)
    flow, t = FlowMatching(**objective), unshifted_times()
    for tokens in TOKENS:
        expected = pipeline_times(config, calculate_shift, tokens, t)
        assert torch.equal(flow.shifted(t, tokens), expected), tokens
        # the times training draws: the unshifted float32 draw of the sample's generator, shifted as the pipeline
        drawn = flow.sample_time(4, torch.Generator().manual_seed(tokens), tokens)
        unshifted = torch.rand(4, generator=torch.Generator().manual_seed(tokens), dtype=torch.float32)
        assert torch.equal(drawn, pipeline_times(config, calculate_shift, tokens, unshifted)), tokens


def test_the_resolution_shift_takes_the_pipeline_folders_scheduler_config(tmp_path):
    """model.pretrained with a scheduler/scheduler_config.json that shifts dynamically: its constants (and its
    time_shift_type) are the run's, kept in the objective, whatever the family's; a folder whose scheduler shifts by
    a fixed amount leaves the family's; constants the run gives win. The times equal the scheduler's."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    from ringdit.spec import resolve_shift

    folder = tmp_path / "pipeline"
    (folder / "scheduler").mkdir(parents=True)
    custom = {**QWEN_SCHEDULER, "base_image_seq_len": 128, "max_image_seq_len": 2048, "max_shift": 1.3}
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(custom))
    objective = {"shift": "resolution"}
    resolve_shift(objective, {}, 256, {**QWEN_MODEL, "pretrained": str(folder)})
    assert objective["resolution"] == {"base_tokens": 128, "max_tokens": 2048, "base_shift": 0.5, "max_shift": 1.3,
                                       "time_shift_type": "exponential"}
    t = unshifted_times()
    for tokens in TOKENS:
        assert torch.equal(FlowMatching(**objective).shifted(t, tokens),
                           pipeline_times(custom, calculate_shift, tokens, t))
    linear = {**custom, "time_shift_type": "linear"}  # mu itself as the shift
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(linear))
    objective = {"shift": "resolution"}
    resolve_shift(objective, {}, 256, {**QWEN_MODEL, "pretrained": str(folder)})
    for tokens in TOKENS:
        assert torch.equal(FlowMatching(**objective).shifted(t, tokens),
                           pipeline_times(linear, calculate_shift, tokens, t))
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps({**custom, "use_dynamic_shifting": False}))
    objective = {"shift": "resolution"}
    resolve_shift(objective, {}, 256, {**QWEN_MODEL, "pretrained": str(folder)})
    assert objective["resolution"] == {"base_tokens": 256, "max_tokens": 8192, "base_shift": 0.5, "max_shift": 0.9}
    given = {"shift": "resolution", "resolution": {"max_shift": 2.0}}
    resolve_shift(given, {}, 256, {**QWEN_MODEL, "pretrained": str(folder)})
    assert given["resolution"] == {"max_shift": 2.0}


# ---- min_time / max_time ------------------------------------------------------------------------------------------

OBJECTIVES = {"uniform": {"time_sampling": "uniform"},
              "logit-normal, shift 3": {"logit_mean": 0.3, "logit_std": 1.2, "shift": 3.0},
              "logit-normal, resolution": {"shift": "resolution", "resolution": {"max_shift": 0.9}}}


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_min_and_max_time_restrict_the_times_and_keep_their_shape(name):
    """min_time / max_time: every time in the range; each is the unrestricted distribution's time at the quantile
    F(min) + (F(max) - F(min)) u of the sample's own draw u (so the shape inside the range is kept, no draw
    rejected); 0 .. 1 draws exactly the times of no restriction; a range equal to a two-expert model's draws exactly
    its expert's times. Uniform without shift: min + (max - min) u, exactly."""
    settings = OBJECTIVES[name]
    plain, restricted = FlowMatching(**settings), FlowMatching(**settings, min_time=0.2, max_time=0.7)
    for tokens in (64, 1024):
        for seed in range(20):
            def draw(flow, within=None, seed=seed):
                return flow.sample_time(1, torch.Generator().manual_seed(seed), tokens, within)

            t = draw(restricted)
            assert 0.2 <= t.item() <= 0.7
            assert torch.equal(draw(FlowMatching(**settings, min_time=0.0, max_time=1.0)), draw(plain))
            assert torch.equal(t, draw(plain, within=(0.2, 0.7)))  # the expert's path, the same rule
            u = torch.rand(1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
            start, end = plain.cumulative(0.2, tokens), plain.cumulative(0.7, tokens)
            assert torch.equal(t, plain._time_at(start + (end - start) * u, tokens).float().clamp(0.2, 0.7))
            if name == "uniform":
                assert torch.equal(t, (0.2 + (0.7 - 0.2) * u).float())
            # the restricted CDF: F's share of the range, 0 below it and 1 above it
            assert restricted.cumulative(0.1, tokens) == 0.0 and restricted.cumulative(0.8, tokens) == 1.0
            middle = (plain.cumulative(0.45, tokens) - start) / (end - start)
            assert restricted.cumulative(0.45, tokens) == middle
    high_only = FlowMatching(**settings, min_time=0.9)  # with an expert's range: the intersection
    t = high_only.sample_time(1, torch.Generator().manual_seed(3), 64, within=(0.875, 1.0))
    assert torch.equal(t, FlowMatching(**settings).sample_time(1, torch.Generator().manual_seed(3), 64,
                                                               within=(0.9, 1.0)))


def test_the_times_and_weights_of_a_sample_do_not_depend_on_the_rank_layout():
    """The new settings draw from the sample's own generator only (DiffusionModule.batch_generators: keyed by its
    position in the global batch), so a global batch of 8 split over 1, 2, 4 or 8 data-parallel replicas trains each
    sample at the same time with the same weight."""
    from ringdit.parallel import ParallelDims
    from ringdit.common.seeding import Stream
    from ringdit.training.module import DiffusionModule

    flow = FlowMatching(shift="resolution", min_time=0.1, max_time=0.95, loss_weighting="diffsynth")
    layouts = {}
    for replicas in (1, 2, 4, 8):
        times = []
        for rank in range(replicas):
            module = SimpleNamespace(parallel_dims=ParallelDims(dp_degree=replicas, dp_rank=rank),
                                     hparams=SimpleNamespace(seed=5))
            generators = DiffusionModule.batch_generators(module, Stream.TRAIN, (17, 0), 8 // replicas)
            times += [flow.sample_time(1, g, 1024) for g in generators]
        layouts[replicas] = torch.cat(times)
    for replicas, times in layouts.items():
        assert torch.equal(times, layouts[1]), replicas
        assert torch.equal(flow.loss_weight(times, 1024), flow.loss_weight(layouts[1], 1024))


# ---- DiffSynth-Studio's loss weighting ----------------------------------------------------------------------------

def diffsynth_table(shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DiffSynth-Studio's FlowMatchScheduler in training (set_timesteps(1000, training=True), its Wan template) in
    fp64, transcribed: its timesteps and linear_timesteps_weights, which training_weight looks up."""
    sigmas = torch.linspace(1.0, 0.0, 1000 + 1, dtype=torch.float64)[:-1]
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    x = sigmas * 1000
    y = torch.exp(-2 * ((x - 1000 / 2) / 1000) ** 2)
    y_shifted = y - y.min()
    return x, y_shifted * (1000 / y_shifted.sum())


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
def test_diffsynth_weighting_is_its_formula(shift):
    """loss_weighting=diffsynth: at DiffSynth's own training timesteps the weights are its table's (fp64, exactly),
    they average 1 over that table, vanish at pure noise and peak at t = 0.5; between them it is the same formula."""
    timesteps, weights = diffsynth_table(shift)
    flow = FlowMatching(shift=shift, loss_weighting="diffsynth")
    assert torch.equal(flow.loss_weight(timesteps / 1000, 64), weights)
    assert torch.equal(diffsynth_weight(timesteps / 1000, shift), weights)
    assert weights.mean().item() == pytest.approx(1.0, rel=1e-12) and weights[0] == 0
    t = torch.tensor([0.25, 0.5, 0.9], dtype=torch.float64)
    low = (torch.exp(-2 * ((timesteps - 500) / 1000) ** 2)).min()
    total = (torch.exp(-2 * ((timesteps - 500) / 1000) ** 2) - low).sum()
    assert torch.equal(flow.loss_weight(t, 64), (torch.exp(-2 * ((t * 1000 - 500) / 1000) ** 2) - low) * (1000 / total))
    assert FlowMatching(shift=shift).loss_weight(t, 64) is None  # loss_weighting=none


def test_the_weighted_loss_is_each_samples_loss_times_its_weight():
    """DiffusionModule.diffusion_loss with loss_weighting=diffsynth (a tiny DiT, fp64): the mean over samples of
    each sample's mean squared error times its time's weight; none: the plain mean. (diffusion_loss squares the
    error in float32, as training does: 1e-6.)"""
    from ringdit.diffusion import draw_noise
    from ringdit.training.module import DiffusionModule
    from tests.helpers import tiny_dit

    torch.manual_seed(0)
    model = tiny_dit().double()
    model.class_dropout_prob = 0.0
    x0 = torch.randn(3, model.in_channels, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    labels = torch.tensor([0, 1, 2])
    objective = {"_target_": "ringdit.diffusion.FlowMatching", "shift": 3.0, "min_time": 0.05,
                 "loss_weighting": "diffsynth"}
    module = DiffusionModule(model={}, objective=objective, data={})
    module.model = model

    def generators():
        return [torch.Generator().manual_seed(seed) for seed in (11, 12, 13)]

    loss = module.diffusion_loss(model, x0, labels, generators())
    draws = generators()
    tokens = module.sequence_tokens(x0.shape[2:], model)
    t = torch.cat([module.objective.sample_time(1, g, tokens) for g in draws])
    noise = draw_noise(x0.shape[1:], draws, x0.device, x0.dtype)
    with torch.no_grad():
        prediction = model(module.objective.add_noise(x0, noise, t), module.objective.model_time(t), labels)
    per_sample = (prediction[:, :x0.shape[1]] - (noise - x0)).square().mean(dim=(1, 2, 3))
    expected = (per_sample * diffsynth_weight(t.double(), 3.0)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert abs(expected - per_sample.mean()) > 1e-2 * expected  # (the weights matter here)
    module.objective.loss_weighting = "none"
    assert module.diffusion_loss(model, x0, labels, generators()).item() == pytest.approx(per_sample.mean().item(),
                                                                                          rel=1e-6)


# ---- bad values: one line naming the setting, refused before training ----------------------------------------------

BAD = {  # setting -> (bad value, the line's pattern, the value its advice gives)
    "min_time": ("nan", r"diffusion.objective.min_time=nan is not a time in \[0, 1\]", "0.0"),
    "max_time": ("1.5", r"diffusion.objective.max_time=1.5 is not a time in \[0, 1\] .*give e.g. 0.0 .. 1.0", "1.0"),
    "loss_weighting": ("min_snr", r"diffusion.objective.loss_weighting='min_snr' is not one of none, diffsynth",
                       "diffsynth"),
    "logit_std": ("0", r"diffusion.objective.logit_std=0 is not a number > 0", "1.0"),
    "time_sampling": ("sigmoid", r"diffusion.objective.time_sampling='sigmoid' is not one of uniform, logit_normal",
                      "uniform"),
}


@pytest.mark.parametrize("setting", list(BAD))
def test_bad_time_settings_are_refused_in_one_line_before_training(setting, tmp_path):
    """train.py refuses each bad value in one line naming the setting, the value and the fix (exit 2, before any
    rank); the fix it gives passes the same checks."""
    from ringdit.spec.diffusion import training_diffusion
    from tests.helpers import TINY, assert_refused, compose_train, fail_fast

    value, message, fixed = BAD[setting]
    proc, seconds = fail_fast("train.py", *TINY, f"diffusion.objective.{setting}={value}", f"hydra.run.dir={tmp_path}")
    assert_refused(proc, rf"^Error: {message}", seconds=seconds, run_dir=tmp_path)
    cfg = compose_train([*TINY, f"diffusion.objective.{setting}={fixed}"], tmp_path)
    training_diffusion(cfg, {"_target_": "ringdit.models.DiT"}, 64)


def test_a_reversed_range_and_an_expert_without_times_are_refused():
    """min_time >= max_time: refused with the advice to swap them, which works; a two-expert model's expert whose
    range lies outside min_time .. max_time: refused, naming both ways out, which work."""
    from omegaconf import OmegaConf

    from ringdit.diffusion.objectives import check_flow
    from ringdit.spec.diffusion import check_expert_times

    with pytest.raises(ConfigError, match=r"^diffusion.objective.min_time=0.8 is not below max_time=0.3: .* give "
                                          r"min_time < max_time \(swap them"):
        check_flow({"min_time": 0.8, "max_time": 0.3})
    check_flow({"min_time": 0.3, "max_time": 0.8})
    with pytest.raises(ConfigError, match=r"^diffusion.objective.min_time=0.5 is not below max_time=0.5"):
        FlowMatching(min_time=0.5, max_time=0.5)
    objective = OmegaConf.create({"min_time": 0.0, "max_time": 0.5})
    with pytest.raises(ConfigError, match=r"^diffusion.expert=high trains the times 0.875 .. 1.0 .*min_time=0.0 .. "
                                          r"max_time=0.5 leaves it none; widen min_time / max_time into that range, "
                                          r"or train diffusion.expert=low"):
        check_expert_times("high", 0.875, objective)
    check_expert_times("low", 0.875, objective)
    check_expert_times("high", 0.875, OmegaConf.create({"min_time": 0.0, "max_time": 0.9}))
    check_expert_times("both", 0.875, objective)  # both: the low expert trains every step (the high one's chance: 0)
    flow = FlowMatching(max_time=0.5)
    assert flow.cumulative(1.0) - flow.cumulative(0.875) == 0.0


def test_bad_resolution_constants_are_refused():
    """diffusion.objective.resolution with a time_shift_type diffusers does not have, a constant that is not a
    number, or no slope: one line naming the key."""
    from ringdit.spec.diffusion import check_resolution

    for resolution, message in (({"time_shift_type": "cosine"}, r"time_shift_type='cosine' is not one of "
                                                                 r"exponential, linear"),
                                ({"max_shift": float("nan")}, r"max_shift=nan is not a finite number"),
                                ({"base_tokens": 4096}, r"base_tokens and max_tokens are both 4096")):
        with pytest.raises(ConfigError, match=rf"^diffusion.objective.resolution.*{message}"):
            check_resolution(resolution)
    check_resolution({"time_shift_type": "linear", "max_shift": 0.9})
    assert math.isfinite(FlowMatching(shift="resolution", resolution={"time_shift_type": "linear"}).shift_for(64))
