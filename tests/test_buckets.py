"""Buckets: a data set of several shapes (aspect ratios, frame counts), every step reading one of them.

The bucket sampler (ringdit.data.steps): seeded, the same on every rank, proportional to the data, exact on resume.
Through train.py: a three-bucket set whose token counts (45, 75; Flux 15, 35) divide neither 2 nor 4, so every
step's split pads its tail differently; the SGD losses and weights under ring, Ulysses and both equal one
process step by step, for Wan and Flux. Bad input: one line, before any rank starts.
"""

from __future__ import annotations

import csv
import re

import numpy as np
import pytest
import torch

from ringdit.data import StepBatches, SyntheticTextLatentsDataModule
from ringdit.data.steps import BLOCK, ValidationBatches
from ringdit.data.text_latents import write_text_latents
from ringdit.common.errors import ConfigError
from ringdit.common.seeding import Stream, generator
from tests.helpers import LazyRuns, assert_refused, assert_same_numbers, fail_fast, logged_losses, model_weights, run

BUCKETS = "data.buckets=[[3,6,10],[3,10,6],[5,6,10]]"  # two aspect ratios, two frame counts: 45, 45, 75 Wan tokens
WAN = ["experiment=wan_tiny", "data.num_samples=60", BUCKETS, "data.bucket_samples=[12,18,30]", "data.batch_size=3",
       "trainer.max_steps=4", "logger=csv", "scheduler=constant", "optimizer=sgd", "optimizer.lr=0.5",
       "callbacks.model_checkpoint.every_n_train_steps=2", "trainer.val_check_interval=4"]
FLUX = ["experiment=flux_tiny", "data.num_samples=48", "data.buckets=[[6,10],[10,6],[10,14]]",  # 15, 15, 35 tokens
        "data.batch_size=3", "trainer.max_steps=4", "logger=csv", "scheduler=constant", "optimizer=sgd",
        "optimizer.lr=0.5", "trainer.val_check_interval=4", "model.config.num_attention_heads=2"]
LAYOUTS = {"ring1": [], "ring2": ["ring_degree=2"], "ulysses2": ["ulysses_degree=2"],
           "ring2_ulysses2": ["ring_degree=2", "ulysses_degree=2"]}
SLOW = pytest.mark.slow  # ring 2 and Ulysses 2 alone: each mechanism is also in ring 2 x Ulysses 2


# ---- the bucket sampler ------------------------------------------------------------------------------------------


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def sampler(buckets, batch_size=2, **kwargs) -> StepBatches:
    size = sum(len(b) for b in buckets)
    return StepBatches(Rows(size), batch_size, buckets=buckets, total_steps=10**6, **kwargs)


BUCKET_ROWS = [list(range(0, 10)), list(range(10, 40)), list(range(40, 100))]  # 10 %, 30 %, 60 % of the data


def test_one_bucket_reads_what_earlier_versions_read():
    """One bucket: step s, rank r takes positions (s * dp + r) * B ... of the per-epoch permutations (DATA_ORDER,
    keyed by the epoch alone), so runs started before buckets existed resume on the same batches."""
    batches = StepBatches(Rows(10), 4, total_steps=20, dp_rank=1, dp_size=2, seed=5)
    for step in range(6):
        first = (step * 2 + 1) * 4
        expected = [int(torch.randperm(10, generator=generator(Stream.DATA_ORDER, 5, pos // 10))[pos % 10])
                    for pos in range(first, first + 4)]
        assert batches.indices(step) == expected


def test_every_rank_reads_the_same_bucket_and_its_own_samples():
    ranks = [sampler(BUCKET_ROWS, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
    for step in range(300):
        buckets = {r.bucket_of(step) for r in ranks}
        assert len(buckets) == 1
        rows = [r.indices(step) for r in ranks]
        b = buckets.pop()
        assert all(i in BUCKET_ROWS[b] for i in rows[0] + rows[1])
        first, n = ranks[0].draws_before(step, b) * 2 * 2, len(BUCKET_ROWS[b])
        if first // n == (first + 3) // n:  # within one epoch, replicas read different samples of the global batch
            assert not set(rows[0]) & set(rows[1])


def test_a_bucket_is_read_epoch_by_epoch():
    """Every sample of a bucket is read once before any is read twice (per-bucket epochs)."""
    batches = sampler(BUCKET_ROWS, batch_size=2, seed=1)
    read = {b: [] for b in range(3)}
    for step in range(400):
        read[batches.bucket_of(step)] += batches.indices(step)
    for b, rows in read.items():
        n = len(BUCKET_ROWS[b])
        for epoch in range(len(rows) // n):
            assert sorted(rows[epoch * n:(epoch + 1) * n]) == BUCKET_ROWS[b]


def test_bucket_proportions_match_the_data():
    """Over 1,000 steps each bucket's share of the steps is its share of the batches (here of the data), within
    4.5 standard deviations of the binomial count (a false alarm once in ~150,000 seeds)."""
    steps = 1000
    for seed in range(3):
        batches = sampler(BUCKET_ROWS, seed=seed)
        counts = np.bincount([batches.bucket_of(s) for s in range(steps)], minlength=3)
        for b, share in enumerate((0.1, 0.3, 0.6)):
            sd = (steps * share * (1 - share)) ** 0.5
            assert abs(counts[b] - steps * share) < 4.5 * sd, (seed, counts)
    # with a token budget a bucket of bigger samples has smaller batches, so more steps: samples stay proportional
    batches = StepBatches(Rows(100), [4, 4, 1], buckets=BUCKET_ROWS, total_steps=10**6)
    counts = np.bincount([batches.bucket_of(s) for s in range(steps)], minlength=3)
    weights = np.array([10 / 4, 30 / 4, 60 / 1])
    assert abs(counts[2] / steps - weights[2] / weights.sum()) < 4.5 * (0.12 * 0.88 / steps) ** 0.5 + 0.01


def test_a_resumed_sampler_reads_the_same_batches():
    """A sampler that starts at step s (a resumed run, past a block boundary) reads what the uninterrupted one did."""
    whole = sampler(BUCKET_ROWS, seed=7, dp_rank=1, dp_size=2)
    expected = [whole.indices(s) for s in range(BLOCK - 5, BLOCK + 40)]
    resumed = sampler(BUCKET_ROWS, seed=7, dp_rank=1, dp_size=2, start_step=BLOCK + 3)
    assert [resumed.indices(s) for s in range(BLOCK + 3, BLOCK + 40)] == expected[8:]
    assert [resumed.indices(s) for s in range(BLOCK - 5, BLOCK + 3)] == expected[:8]  # and backwards, too
    assert [whole.bucket_of(s) for s in range(50)] != [sampler(BUCKET_ROWS, seed=8).bucket_of(s) for s in range(50)]


def test_gradient_accumulation_reads_one_bucket_per_optimizer_step():
    """The micro-batches of one optimizer step share its bucket; one bucket without accumulation reads the same
    samples in the same order."""
    batches = sampler(BUCKET_ROWS, seed=2, batches_per_step=3)
    plain = sampler(BUCKET_ROWS, seed=2)
    for step in range(40):
        micro = [batches.indices(step * 3 + m) for m in range(3)]
        bucket = BUCKET_ROWS[plain.bucket_of(step)]
        assert all(i in bucket for rows in micro for i in rows)
    one = StepBatches(Rows(10), 2, total_steps=100, batches_per_step=4, seed=1)
    assert [one.indices(i) for i in range(12)] == [StepBatches(Rows(10), 2, total_steps=100, seed=1).indices(i)
                                                   for i in range(12)]


def test_validation_batches_are_one_bucket_each_and_the_same_count_on_every_rank():
    ranks = [ValidationBatches(Rows(100), [3, 3, 2], BUCKET_ROWS, max_batches=4, dp_rank=r, dp_size=2)
             for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 2 + 4 + 4  # bucket 0: 10 samples in global batches of 6
    for a, b in zip(ranks[0].batches, ranks[1].batches):
        bucket = next(i for i, rows in enumerate(BUCKET_ROWS) if a[0] in rows)
        assert all(i in BUCKET_ROWS[bucket] for i in a + b) and len(a) == len(b)


# ---- the data module ---------------------------------------------------------------------------------------------


def test_a_folder_of_mixed_shards_describes_its_buckets(tmp_path):
    data = SyntheticTextLatentsDataModule(str(tmp_path), num_samples=60, buckets=[[3, 6, 10], [3, 10, 6], [5, 6, 10]],
                                          bucket_samples=[12, 18, 30])
    info = data.describe()
    assert info["buckets"] == [{"shape": [5, 6, 10], "samples": 30}, {"shape": [3, 10, 6], "samples": 18},
                               {"shape": [3, 6, 10], "samples": 12}]
    assert info["image_size"] == [5, 6, 10]  # the most frequent: previews and the model's default grid
    data.setup()
    for i in range(0, 60, 7):  # every sample has its bucket's shape
        assert tuple(data.train_set[i][0].shape[1:]) == data.bucket_shapes[data.sample_buckets[data.train_set.indices[i]]]


def test_tokens_per_batch_sizes_each_bucket(tmp_path):
    data = SyntheticTextLatentsDataModule(str(tmp_path), num_samples=20, buckets=[[3, 6, 10], [5, 6, 10]],
                                          tokens_per_batch=160)
    data.set_patch_shape((1, 2, 2))  # 45 and 75 tokens
    assert data.batch_sizes() == [3, 2]
    with pytest.raises(ConfigError, match=r"data.tokens_per_batch=50 is smaller than one sample of the largest "
                                          r"bucket \[5, 6, 10\] \(75 tokens\)"):
        SyntheticTextLatentsDataModule(str(tmp_path), num_samples=20, buckets=[[3, 6, 10], [5, 6, 10]],
                                       tokens_per_batch=50).set_patch_shape((1, 2, 2))


def _shard(path, channels=4, shape=(3, 6, 10), text=(8, 16)):
    write_text_latents(path, torch.zeros(2, channels, *shape), torch.zeros(2, *text))


@pytest.mark.parametrize("case, other, message", [
    ("channels", {"channels": 5}, r"b.safetensors has latent channels 5 but a.safetensors has 4"),
    ("image and video", {"shape": (6, 10)}, r"latent dims .* 2 but .* 3.*store images as 1-frame videos"),
    ("text", {"text": (9, 16)}, r"has text \(L, D\) \(9, 16\) but a.safetensors has \(8, 16\)"),
])
def test_shards_that_cannot_be_mixed_are_refused(tmp_path, case, other, message):
    from ringdit.data import TextLatentsDataModule

    _shard(tmp_path / "a.safetensors")
    _shard(tmp_path / "b.safetensors", **other)
    with pytest.raises(ConfigError, match=f"data.path={re.escape(str(tmp_path))}: .*{message}"):
        TextLatentsDataModule(str(tmp_path))


def test_clips_larger_than_the_run_was_planned_for_are_refused_and_the_advice_works(tmp_path):
    """A preset plans its layout and memory for its clips' size (data.size / data.frames); a prepared bucket of more
    pixels (prepare's bucket metadata) is refused, naming the shard and the settings; following the advice loads it,
    and a bucket within the size loads as it is."""
    import json

    from ringdit.data import TextLatentsDataModule

    for name, (height, width, frames) in {"a": (32, 48, 9), "b": (48, 64, 13)}.items():
        write_text_latents(tmp_path / f"{name}.safetensors", torch.zeros(2, 4, (frames - 1) // 4 + 1, height // 8,
                                                                         width // 8), torch.zeros(2, 8, 16),
                           metadata={"bucket": json.dumps({"height": height, "width": width, "frames": frames})})
    with pytest.raises(ConfigError, match=r"b.safetensors holds 48x64 x 13 frame clips, more pixels than "
                                          r"data.size=\[32, 48\] x data.frames=9 the run was planned for; prepare at "
                                          r"that size, or set data.size=\[48,64\] data.frames=13 and plan again"):
        TextLatentsDataModule(str(tmp_path), size=[32, 48], frames=9)
    assert len(TextLatentsDataModule(str(tmp_path), size=[48, 64], frames=13).shards) == 2  # the advice
    assert len(TextLatentsDataModule(str(tmp_path)).shards) == 2  # null: any size
    with pytest.raises(ConfigError, match=r"data.size='big': H, W in pixels"):
        TextLatentsDataModule(str(tmp_path), size="big")


BAD = {
    "bucket smaller than the patch": (["data.buckets=[[3,6,10],[3,1,6]]", "data.bucket_samples=[10,6]"],
                                      r"the bucket \[3, 1, 6\] \(\d+ samples\) is smaller than the model's patch "
                                      r"\[1, 2, 2\]"),
    "bucket not divisible": (["data.buckets=[[3,6,10],[3,7,6]]", "data.bucket_samples=[10,6]"],
                             r"the bucket \[3, 7, 6\] .* is not divisible by the model's patch \[1, 2, 2\].*\[3, 6, 6\]"),
    "token budget too small": (["data.buckets=[[3,6,10],[5,6,10]]", "data.tokens_per_batch=60"],
                               r"data.tokens_per_batch=60 is smaller than one sample of the largest bucket"),
    "token budget not a count": (["data.tokens_per_batch=-3"], r"data.tokens_per_batch must be a positive integer"),
    "buckets not shapes": (["data.buckets=[[3,6],[5,6,10]]"], r"data.buckets=.*give a list of latent shapes"),
    "preview size the model cannot sample": (["callbacks.sample_grid.size=[5,8]"],
                                             r"callbacks.sample_grid.size=\[5, 8\]: the height 5 is not a multiple"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_bucket_input_is_refused_before_spawning(case, tmp_path):
    overrides, message = BAD[case]
    proc, seconds = fail_fast("train.py", "experiment=wan_tiny", f"data.cache_dir={tmp_path}", "data.num_samples=16",
                              f"hydra.run.dir={tmp_path / 'run'}", "ring_degree=2", *overrides)
    assert_refused(proc, message, seconds=seconds, run_dir=tmp_path / "run")


# ---- through train.py --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wan_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_buckets")
    return LazyRuns(root, LAYOUTS, *WAN, f"data.cache_dir={root / 'data'}", env={"HF_HUB_OFFLINE": "1"})


def logged(run_dir, key: str) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(f) if row.get(key)}


def assert_same_run(parallel, reference) -> None:
    """fp32: a layout reorders sums only (tests/test_training.py's test_sgd_steps_equal_one_device reasons the
    tolerances), the same bounds as the one-bucket Wan runs (tests/test_diffusers_training.py)."""
    losses, expected = logged_losses(parallel), logged_losses(reference)
    assert sorted(losses) == sorted(expected) == [0, 1, 2, 3]
    for step in expected:
        assert losses[step] == pytest.approx(expected[step], rel=1e-5), f"step {step}"
    assert logged(parallel, "val/loss") == pytest.approx(logged(reference, "val/loss"), rel=1e-5)
    for key, value in model_weights(reference).items():
        assert_same_numbers(model_weights(parallel)[key], value, rtol=1e-5, atol=1e-6, where=key)


@pytest.mark.parametrize("layout", [pytest.param("ring2", marks=SLOW), pytest.param("ulysses2", marks=SLOW),
                                    "ring2_ulysses2"])
def test_wan_sgd_steps_on_buckets_equal_one_process(wan_runs, layout):
    reference = wan_runs.trained("ring1")
    tokens = logged(reference, "train/sample_tokens")
    assert set(tokens.values()) == {45.0, 75.0}, tokens  # the steps did change shape
    assert logged(wan_runs.trained(layout), "train/sample_tokens") == tokens  # the same bucket sequence
    assert_same_run(wan_runs.trained(layout), reference)


def test_wan_resume_on_buckets_reproduces_the_bucket_sequence_and_the_loss_curve(wan_runs, tmp_path):
    reference = wan_runs.trained("ring1")
    step2 = reference / "checkpoints" / "step_0000002.ckpt"
    run("train.py", tmp_path, *WAN, f"data.cache_dir={wan_runs.root / 'data'}", f"ckpt_path={step2}",
        "ring_degree=2", env={"HF_HUB_OFFLINE": "1"})
    resumed, tokens = logged_losses(tmp_path), logged(reference, "train/sample_tokens")
    assert sorted(resumed) == [2, 3]
    assert logged(tmp_path, "train/sample_tokens") == {s: tokens[s] for s in (2, 3)}
    for step in (2, 3):
        assert resumed[step] == pytest.approx(logged_losses(reference)[step], rel=1e-5)
    for key, value in model_weights(reference).items():
        assert_same_numbers(model_weights(tmp_path)[key], value, rtol=1e-5, atol=1e-6, where=key)


@pytest.fixture(scope="module")
def flux_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux_buckets")
    return LazyRuns(root, LAYOUTS, *FLUX, f"data.cache_dir={root / 'data'}", env={"HF_HUB_OFFLINE": "1"})


@pytest.mark.parametrize("layout", [pytest.param("ring2", marks=SLOW), pytest.param("ulysses2", marks=SLOW),
                                    "ring2_ulysses2"])
def test_flux_sgd_steps_on_buckets_equal_one_process(flux_runs, layout):
    """Joint attention: the replicated text prefix plus an image sequence whose length changes every step."""
    reference = flux_runs.trained("ring1")
    assert set(logged(reference, "train/sample_tokens").values()) == {15.0, 35.0}
    assert_same_run(flux_runs.trained(layout), reference)
