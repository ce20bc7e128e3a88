"""Step caching (``ringdit.caching``): off is exact, on skips blocks, and the reuse decisions -- one all-reduce of the
sharded metric -- are the same on every rank and every layout, so caching never changes which collectives run."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from ringdit.caching import CacheSettings, StepCache, teacache_coefficients
from ringdit.caching.calibrate import fit_coefficients
from ringdit.diffusion import FlowMatching, initial_noise, sample
from ringdit.common.errors import ConfigError
from ringdit.models import parallelize
from ringdit.parallel import exchange_guidance_halves, init_sequence_parallel
from tests.distributed import run_ranks
from tests.helpers import architecture, assert_refused, fail_fast, tiny_dit

os.environ.setdefault("HF_HUB_OFFLINE", "1")

IDENTITY = (1.0, 0.0)  # a TeaCache polynomial that takes the input change as the output change
STEPS = 8
GRID = (6, 10)  # 3 x 5 = 15 tokens: tail padding under 2 ranks
# Thresholds at which the test model reuses some evaluations and not others (its random weights change a lot per
# step: fbcache's change since the last full evaluation is 0.44-0.65, teacache's per-step input change 0.05-0.08)
MIDDLE = {"fbcache": 0.5, "teacache": 0.15}


def dit(dims=None, dtype=torch.float64, depth=4):
    """A DiT with every weight non-zero (adaLN-Zero's zeros would make every residual 0), parallelized on ``dims``."""
    model = tiny_dit(depth=depth, in_channels=1, learn_sigma=False, input_size=GRID).to(dtype)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    return parallelize(model, dims=dims).eval()


def draw(model, cache: StepCache | None, dims=None, *, cfg_scale=2.0, labels=(3, 5, 7), seeds=(0, 1, 2),
         dtype=torch.float64):
    """Euler samples of ``labels`` from ``seeds``; CFG in one batch, or CFG parallel when ``dims`` has a cfg_group."""
    labels = torch.tensor(labels)
    noise = initial_noise((1, *GRID), list(seeds), dtype=dtype)
    split = dims is not None and dims.cfg_group is not None
    guided = dict(exchange=lambda p: exchange_guidance_halves(p, dims), half=dims.cfg_rank) if split else {}
    attached = cache.attached(model, dims, pairs=cfg_scale != 1 and not split) if cache else _nothing()
    with torch.no_grad(), attached:
        return sample(model, FlowMatching(), noise, labels, steps=STEPS, cfg_scale=cfg_scale, null=model.null_label,
                      sampler="euler", **guided)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def count_block_runs(model) -> list[int]:
    """Per block, how often its MLP ran (a skipped block returns its input without running anything)."""
    counts = [0] * len(model.blocks)
    for i, block in enumerate(model.blocks):
        block.mlp.register_forward_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


# ---- one process ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fbcache", "teacache"])
def test_threshold_zero_is_bit_identical_to_no_cache(kind):
    model = dit(dtype=torch.float32)
    reference = draw(model, None, dtype=torch.float32)
    for cfg_scale in (1.0, 2.0):
        cached = StepCache(CacheSettings(kind, 0.0), IDENTITY)
        off = draw(model, None, cfg_scale=cfg_scale, dtype=torch.float32)
        assert torch.equal(draw(model, cached, cfg_scale=cfg_scale, dtype=torch.float32), off)
        assert cached.counts.full == cached.counts.evaluations == STEPS
    assert torch.equal(draw(model, StepCache(CacheSettings()), dtype=torch.float32), reference)  # cache=none
    assert not any("forward" in block.__dict__ for block in model.blocks)  # the blocks are restored


def test_module_generate_with_threshold_zero_equals_cache_off(tiny_checkpoint):
    """Through a checkpoint's Sampler (infer.py's path): cache off and threshold 0 give the same bits."""
    from ringdit.caching.calibrate import load_for_sampling

    sampler = load_for_sampling(str(tiny_checkpoint))
    labels, seeds = torch.tensor([1, 2, 3]), [4, 5, 6]
    off = sampler.generate(labels, seeds, steps=4, cfg_scale=2.0)
    cache = StepCache(CacheSettings("fbcache", 0.0))
    with sampler.using(step_cache=cache) as cached:
        assert torch.equal(cached.generate(labels, seeds, steps=4, cfg_scale=2.0), off)
    assert cache.counts.full == cache.counts.evaluations == 7  # heun: 3 x 2 + 1


@pytest.mark.parametrize("kind, first_block_runs", [("fbcache", STEPS), ("teacache", 1)])
def test_a_large_threshold_skips_the_blocks(kind, first_block_runs):
    model = dit()
    counts = count_block_runs(model)
    cache = StepCache(CacheSettings(kind, 1e9), IDENTITY)
    samples = draw(model, cache)
    # warmup (1 evaluation) runs every block; then fbcache runs only its first block, teacache none
    assert counts == [first_block_runs] + [1] * (len(counts) - 1)
    assert (cache.counts.evaluations, cache.counts.full) == (STEPS, 1)
    assert torch.isfinite(samples).all()
    # a middle threshold reuses some steps and not others; each run starts afresh (the state never crosses runs)
    middle = StepCache(CacheSettings(kind, MIDDLE[kind]), IDENTITY)
    first, second = draw(model, middle), draw(model, middle)
    assert torch.equal(first, second) and 2 < middle.counts.full < 2 * STEPS


def test_decisions_are_per_sample_so_a_sample_does_not_depend_on_its_batch():
    """Sample i reuses only its own cached residual: alone or beside others, it comes out the same."""
    model = dit()
    settings = CacheSettings("fbcache", MIDDLE["fbcache"])
    together = draw(model, StepCache(settings), labels=(3, 5, 7))
    alone = draw(model, StepCache(settings), labels=(5,), seeds=(1,))
    # fp64; only the GEMM batch shape differs (~1e-16 relative): far from any decision boundary here
    torch.testing.assert_close(alone[0], together[1], rtol=1e-10, atol=1e-10)


# ---- bad settings --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache, message", [
    ({"kind": "fbcache", "threshold": -0.1}, r"cache.threshold=-0.1 must be a finite number >= 0.*e.g. cache.thresh"),
    ({"kind": "fbcache", "threshold": float("nan")}, r"cache.threshold=nan must be a finite number >= 0"),
    ({"kind": "fbcache", "threshold": "big"}, r"cache.threshold='big' must be a finite number >= 0"),
    ({"kind": "fbcache", "threshold": 0.1, "warmup": 0}, r"cache.warmup=0 must be an integer >= 1"),
    ({"kind": "teacache", "threshold": 0.1, "coefficients": ["a"]}, r"cache.coefficients=.* must be a non-empty list"),
    ({"kind": "lru", "threshold": 0.1}, r"cache.kind='lru' is not a step cache; use cache=none, cache=fbcache"),
])
def test_bad_cache_settings_are_one_line_errors(cache, message):
    with pytest.raises(ConfigError, match=message):
        CacheSettings.from_config(cache)


def test_teacache_without_coefficients_says_how_to_fit_them(tmp_path):
    model = tiny_dit()
    with pytest.raises(ConfigError, match=r"cache=teacache: no TeaCache coefficients for this model \(dit, width 64, "
                                          r"depth 2; ckpt_path=.*\); fit them with `python -m ringdit.caching "
                                          r"calibrate"):
        teacache_coefficients(CacheSettings("teacache", 0.1), model, str(tmp_path / "last.ckpt"))
    (tmp_path / "teacache.json").write_text('{"coefficients": [2.0, 0.5]}')  # calibrate's file, beside the ckpt
    assert teacache_coefficients(CacheSettings("teacache", 0.1), model, str(tmp_path / "last.ckpt")) == (2.0, 0.5)


@pytest.mark.parametrize("preset, family, size", [("wan_14b", "wan", (5120, 40)), ("wan_1_3b", "wan", (1536, 30)),
                                                   ("flux_dev", "flux", (3072, 19))])
def test_the_published_coefficients_are_the_model_kinds(preset, family, size):
    """TeaCache's published polynomials belong to their family (Family.teacache_coefficients), at its published
    sizes; the model built from the preset (on the meta device) finds its own."""
    from ringdit.commands.cli import model_preset
    from ringdit.models.diffusers.families import get_family
    from ringdit.spec.model import build_on_meta, model_config

    shape = [8, 8] if family == "flux" else [3, 8, 8]
    config = model_config(model_preset(preset), {"conditioning": "text", "channels": 16, "image_size": shape,
                                                 "text_len": 8, "text_dim": 4096, "pooled_dim": 768})
    model = build_on_meta(config)
    assert teacache_coefficients(CacheSettings("teacache", 0.1), model, None) == \
        get_family(family).teacache_coefficients[size]


def test_calibration_fits_a_polynomial():
    model = dit()
    recorder = StepCache(CacheSettings("teacache", 0.0), calibrate=True)
    draw(model, recorder)
    assert len(recorder.records) == 3 * (STEPS - 1)  # per sample, every evaluation after the first
    assert len(fit_coefficients(recorder.records)) == 5


@pytest.mark.parametrize("setting, message", [
    ("cache=unknown", r"cache=unknown: no such option.*\(options: fbcache, none, teacache\)"),
    ("cache.threshold=-1", None),
    ("cache=teacache", r"cache=teacache: no TeaCache coefficients for this model .*calibrate"),
])
def test_infer_refuses_bad_cache_settings_before_spawning(setting, message, tiny_checkpoint, tmp_path):
    overrides = ["cache=fbcache", setting] if setting.startswith("cache.") else [setting]
    proc, seconds = fail_fast("infer.py", f"ckpt_path={tiny_checkpoint}", *overrides, f"hydra.run.dir={tmp_path}")
    assert_refused(proc, message or r"cache.threshold=-1 must be a finite number >= 0", seconds=seconds)


# ---- several ranks -------------------------------------------------------------------------------------------------


def check_layouts(rank, world):
    """1 process vs ring 2 vs Ulysses 2 (15 tokens: tail padding), CFG in one batch and CFG parallel (dp 2)."""
    for kind, scope in (("fbcache", "sample"), ("teacache", "sample"), ("fbcache", "batch")):
        settings = CacheSettings(kind, MIDDLE[kind], scope=scope)
        reference_cache = StepCache(settings, IDENTITY)
        reference = draw(dit(), reference_cache)
        layouts = [(2, 1, False), (1, 2, False), (1, 1, True)] if world == 2 else [(2, 1, True), (1, 2, True)]
        for ring, ulysses, cfg_parallel in layouts:
            dims = init_sequence_parallel(ring, ulysses, cfg_parallel=cfg_parallel)
            if cfg_parallel and ring * ulysses > 1:  # the one all-reduce spans both replicas' SP groups
                assert dist.get_process_group_ranks(dims.cfg_sp_group) == [0, 1, 2, 3]
            cache = StepCache(settings, IDENTITY)
            samples = draw(dit(dims), cache, dims)
            where = f"{kind} per {scope}, ring {ring} x ulysses {ulysses}, cfg_parallel {cfg_parallel}"
            # the same decisions (a fraction reused, so the test means something) ...
            assert cache.counts.full == reference_cache.counts.full, where
            assert 1 < reference_cache.counts.full < STEPS, where
            # ... and so the same numbers: fp64, where a layout reorders sums (~1e-16 relative); the metric's own
            # rounding is ~1e-16 too, far from the threshold at these steps. A wrong residual or a decision taken on a
            # rank's shard alone would differ by O(0.1).
            torch.testing.assert_close(samples, reference, rtol=1e-10, atol=1e-10 * reference.abs().max().item(),
                                       msg=where)


def test_samples_are_equal_across_layouts_with_caching_on():
    run_ranks(check_layouts, 2)


def test_samples_are_equal_across_cfg_parallel_and_sequence_parallel_layouts():
    run_ranks(check_layouts, 4)


def check_disagreeing_ranks(rank, world):
    """Rank 1's local change is made huge: locally it would always compute, rank 0 would reuse. The decision comes
    from the all-reduced sums, so both ranks take the same one at every evaluation and nothing hangs."""
    dims = init_sequence_parallel(world, 1)
    cache = StepCache(CacheSettings("fbcache", 0.5))
    calls = []
    original = cache._local_sum

    def skewed(x, sharded):
        calls.append(1)
        value = original(x, sharded)
        return value + 1e6 if rank == 1 and len(calls) % 2 == 1 else value  # the change, not the previous

    cache._local_sum = skewed
    decisions = []
    first = cache._first

    def recording(*args):
        out = first(*args)
        decisions.append(cache._run.reuse_all)
        return out

    cache._first = recording
    draw(dit(dims), cache, dims)
    mine = torch.tensor(decisions)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    assert torch.equal(everyone[0], everyone[1]) and not everyone[0][1:].any()  # rank 1's huge change wins


def test_ranks_whose_local_metrics_disagree_take_the_same_decision():
    run_ranks(check_disagreeing_ranks, 2)


# ---- diffusers families ---------------------------------------------------------------------------------------------


def family_case(family, dims=None):
    """A tiny diffusers model (the same weights on every rank), its inputs and its condition."""
    from ringdit.models.diffusers import DiffusersTransformer

    torch.manual_seed(0)
    if family == "wan":
        model = DiffusersTransformer("wan", config=architecture("wan_tiny"), input_size=(3, 6, 6), in_channels=4,
                                     text_len=7, text_dim=16)
        shape, cond = (4, 3, 6, 6), {"text": torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1))}
    elif family == "flux":
        model = DiffusersTransformer("flux", config=architecture("flux_tiny"), input_size=(6, 10), in_channels=1,
                                     text_len=5, text_dim=32, pooled_dim=32)
        g = torch.Generator().manual_seed(1)
        cond = {"text": torch.randn(2, 5, 32, generator=g), "pooled": torch.randn(2, 32, generator=g)}
        shape = (1, 6, 10)
    else:
        model = DiffusersTransformer("qwenimage", config=architecture("qwenimage_tiny"), input_size=(6, 10),
                                     in_channels=4, text_len=5, text_dim=16)
        g = torch.Generator().manual_seed(1)
        cond = {"text": torch.randn(2, 5, 16, generator=g), "text_mask": torch.ones(2, 5, dtype=torch.bool)}
        shape = (4, 6, 10)
    with torch.no_grad():  # diffusers zero-initialises some output layers: make every block contribute
        g = torch.Generator().manual_seed(2)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return parallelize(model, dims=dims).eval(), shape, cond


def family_samples(family, dims, threshold):
    model, shape, cond = family_case(family, dims)
    cache = StepCache(CacheSettings("fbcache", threshold))
    noise = initial_noise(shape, [0, 1])
    with torch.no_grad(), cache.attached(model, dims):
        out = sample(model, FlowMatching(), noise, cond, steps=6, sampler="euler")
    return out, cache.counts.full


# thresholds inside the range of the tiny models' changes (wan 0.08-0.14, flux 0.24-0.41, qwenimage 0.44-0.66)
FAMILY_THRESHOLDS = {"wan": 0.12, "flux": 0.35, "qwenimage": 0.55}


def check_families(rank, world):
    for family, threshold in FAMILY_THRESHOLDS.items():
        reference, full = family_samples(family, None, threshold)
        assert 1 < full < 6, (family, full)  # some evaluations reused, some did not
        for ring, ulysses in ((2, 1), (1, 2)):
            samples, layout_full = family_samples(family, init_sequence_parallel(ring, ulysses), threshold)
            where = f"{family}, ring {ring} x ulysses {ulysses}"
            assert layout_full == full, where
            # fp32 as the models run: a layout's other GEMM shapes and ring merges, ~1e-6 on outputs of order 1
            # (tests/test_diffusers_models.py); a wrong residual is off by O(0.1)
            torch.testing.assert_close(samples, reference, rtol=1e-4, atol=1e-4, msg=where)


@pytest.mark.parametrize("family", sorted(FAMILY_THRESHOLDS))
def test_teacache_probes_each_family(family):
    """TeaCache's modulated input is found in every family's first block: threshold 0 changes nothing, a large one
    runs the blocks only at warmup."""
    model, shape, cond = family_case(family)
    noise = initial_noise(shape, [0, 1])
    results = []
    for threshold in (None, 0.0, 1e9):
        cache = StepCache(CacheSettings("teacache", threshold or 0.0), IDENTITY) if threshold is not None else None
        with torch.no_grad(), (cache.attached(model) if cache else _nothing()):
            results.append(sample(model, FlowMatching(), noise, cond, steps=4, sampler="euler"))
        if threshold is not None:
            assert cache.counts.full == (4 if threshold == 0 else 1), (family, threshold)
    assert torch.equal(results[0], results[1])
    assert torch.isfinite(results[2]).all()


def test_diffusers_families_cache_the_same_way_on_every_layout():
    """Wan (one block list), Flux (dual- and single-stream lists, text stream returned), QwenImage (masked text)."""
    run_ranks(check_families, 2)
