"""The step-time model (``ringdit.costs.step_time``): its kernel curve, its terms, the published wall-clock times it is held
against (and docs/benchmarks.md's table of them), and the layouts the planner recommends with it."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from ringdit.parallel.layout import Layout
from ringdit.costs import ModelSize, Setup
from ringdit.costs.step_time import (ATTENTION_FORWARD_TFLOPS, CURVE_TOKENS, DDP_BUCKET_BYTES, FLUX_DEV_1024, H100_SMS,
                               HOST_SECONDS_PER_BLOCK, INTRA_NODE_LATENCY_S, PUBLISHED, TOLERANCE, Machine,
                               attention_tflops, published_table, step_time)

DOCS = Path(__file__).resolve().parents[1] / "docs"
SAMPLING = Setup(training=False, precision="bf16-mixed", ema=False)
TRAINING = Setup(precision="bf16-mixed", ema=False)
GPU_BOUND = Machine(host_seconds_per_block=0.0)  # no launch floor: the GPU terms alone


def test_the_attention_curve_is_the_papers_at_its_points_and_between_them():
    for kernel, curve in ATTENTION_FORWARD_TFLOPS.items():
        for tokens, tflops in zip(CURVE_TOKENS, curve):
            # as the paper ran it: 16 heads, batch x length = 16k tokens (every point fills the 132 SMs)
            assert attention_tflops(kernel, tokens, heads=16 * 16384 // tokens) == tflops
    # halfway between 1k and 2k in log2 of the length: the mean of the two measurements
    assert math.isclose(attention_tflops("fa3", round(1024 * 2**0.5)), (565 + 625) / 2, rel_tol=1e-3)
    assert attention_tflops("fa2", 65536) == attention_tflops("fa2", 16384)  # flat beyond the last measurement


def test_a_chunk_too_small_to_fill_the_gpu_runs_at_the_share_it_fills():
    """A ring hop of 192 tokens over 24 heads is 2 tiles of 128 rows per head: 48 of the 132 SMs busy."""
    assert attention_tflops("fa2", 192, heads=24) == pytest.approx(309 * 48 / H100_SMS, rel=1e-12)


def test_splitting_a_short_sequence_costs_more_per_sample_than_data_parallelism():
    """Flux at 512 px (1,024 + 512 tokens): ring 8 gives each rank 192 tokens -- below the launch floor and the
    kernel's good range -- while dp 8 trains 8 whole samples in the same step."""
    flux_512 = replace(FLUX_DEV_1024, tokens=1024)
    dp = step_time(flux_512, Layout(dp_degree=8), TRAINING)
    ring = step_time(flux_512, Layout(ring_degree=8), TRAINING)
    assert ring.seconds / 1 > 4 * dp.seconds / 8  # per sample: 1 against 8 samples a step


def test_recomputation_adds_one_forward_of_the_checkpointed_blocks():
    layout = Layout(ring_degree=2)
    plain = step_time(FLUX_DEV_1024, layout, TRAINING, GPU_BOUND)
    checkpointed = step_time(FLUX_DEV_1024, layout, replace(TRAINING, activation_checkpointing=True), GPU_BOUND)
    forward = step_time(FLUX_DEV_1024, layout, SAMPLING, GPU_BOUND)  # one forward of every block
    assert checkpointed.seconds - plain.seconds == pytest.approx(forward.seconds, rel=1e-12)


def test_ulysses_all_to_alls_cost_a_latency_and_their_bytes():
    layout = Layout(ulysses_degree=4)
    t = step_time(FLUX_DEV_1024, layout, SAMPLING, GPU_BOUND)
    per_rank = (4096 + 512) // 4
    exchange = 4 * per_rank * 3072 * 2 * 3 / 4  # q, k, v, out of this rank's tokens, 3/4 of them sent, bf16
    assert t.ulysses_s == pytest.approx(57 * (4 * INTRA_NODE_LATENCY_S + exchange / Machine().intra_node),
                                        rel=1e-12)


def test_ddp_hides_its_all_reduce_behind_backward_but_the_last_bucket():
    small = ModelSize(parameters=10**9, trainable_parameters=10**9, largest_parameter=0, root_parameters=0,
                      block_parameters=0, hidden_size=1024, depth=24, num_heads=16, mlp_hidden=4096, tokens=65536)
    t = step_time(small, Layout(dp_degree=8), TRAINING, GPU_BOUND)
    traffic = 2 * 7 / 8 * 10**9 * 4 / Machine().intra_node
    buckets = math.ceil(10**9 * 4 / DDP_BUCKET_BYTES)
    assert t.sync_s == pytest.approx((traffic + buckets * INTRA_NODE_LATENCY_S) / buckets, rel=1e-12)
    # the same gradients after a backward too short to hide them: the rest is exposed
    short = step_time(replace(small, tokens=16), Layout(dp_degree=8), TRAINING, GPU_BOUND)
    assert short.sync_s > 0.9 * traffic


def test_a_ring_across_nodes_costs_more_than_within_one():
    model = replace(FLUX_DEV_1024, tokens=65536)
    within = step_time(model, Layout(ring_degree=8), TRAINING, Machine(gpus_per_node=8))
    across = step_time(model, Layout(ring_degree=8), TRAINING, Machine(gpus_per_node=4))
    assert across.seconds > within.seconds


def test_the_launch_floor_bounds_a_blocks_time():
    tiny = replace(FLUX_DEV_1024, tokens=16, text_tokens=0)
    t = step_time(tiny, Layout(), SAMPLING)
    assert t.seconds == pytest.approx(57 * HOST_SECONDS_PER_BLOCK, rel=1e-12)


# ---- the published cases -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", PUBLISHED, ids=lambda c: f"{c.name} on {c.gpus}")
def test_each_published_case_is_where_the_docs_say(case):
    """A case the model holds is within 25 % of its published number; one it does not hold stays outside (and says
    why): a change to the model that moves either must change the case and docs/benchmarks.md with it."""
    assert case.source and (abs(case.error()) <= TOLERANCE) == case.held, (case.name, case.gpus, case.error())
    assert case.held or case.note


def test_the_model_holds_at_least_six_independent_published_cases():
    held = [c for c in PUBLISHED if c.held and not c.fitted]
    assert len(held) >= 6 and len({c.name for c in held}) >= 3  # three models, each several layouts


def test_docs_benchmarks_holds_the_models_table():
    page = (DOCS / "benchmarks.md").read_text()
    assert published_table() in page, "docs/benchmarks.md's published cases are out of date: paste " \
                                      "ringdit.costs.step_time.published_table()"


# ---- the planner's recommendations ---------------------------------------------------------------------------------


def plan(capsys, *argv: str) -> str:
    from ringdit.plan import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_the_planner_recommends_data_parallelism_when_a_sample_fits(capsys):
    out = plan(capsys, "model=flux_dev", "data.size=512", "gpus=8", "lora.rank=4", "show=1")
    assert re.search(r"^Recommended: dp=8 ring=1 ulysses=1 ", out, flags=re.M), out
    why = re.search(r"^Why: .*no sequence parallelism: every rank trains whole samples \(dp=8\); the best layout with "
                    r"splitting the sequence, (dp=\d+ ring=\d+ ulysses=\d+) \w+, takes (\d+\.\d+)x the time per "
                    r"sample", out, flags=re.M)
    assert why and float(why.group(2)) > 1.2, out


def test_the_planner_splits_the_sequence_when_it_must(capsys):
    """Wan 14B at 720p x 81 (75,600 tokens), full fine-tune on 8 GPUs: whole samples per rank fit only with every
    block recomputed and offloaded; the split layouts are faster."""
    out = plan(capsys, "model=wan_14b", "data.frames=81", "data.size=[720,1280]", "gpus=8", "show=1")
    recommended = re.search(r"^Recommended: dp=1 ring=(\d+) ulysses=(\d+) fsdp", out, flags=re.M)
    assert recommended and int(recommended.group(1)) * int(recommended.group(2)) == 8, out
    why = re.search(r"^Why: .*the sequence split over 8 ranks: .*; the best layout with whole samples per rank, "
                    r"dp=8 ring=1 ulysses=1 \w+.*?, takes (\d+\.\d+)x the time per sample", out, flags=re.M)
    assert why and float(why.group(1)) > 1.0, out
