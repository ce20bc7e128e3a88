"""Dataset lists (data.datasets: folders with repeats or weights) and an evaluation set by path (data.eval).

Every sample's latents hold its own id (folder k's samples: 1000 k + row), so the batches a loader yields say which
folder and sample each came from: counts per folder over an epoch equal the repeats exactly; one process reads the
samples that two data-parallel ranks read together, in the same order; weights set the folders' shares. Bad input:
one line naming the setting (train.py: exit code 2 before any rank starts), and its advice, followed, works.
"""

from __future__ import annotations

import csv
import logging
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from ringdit.data import TextLatentsDataModule
from ringdit.data.datasets import data_source
from ringdit.data.text_latents import write_text_latents
from ringdit.common.errors import ConfigError
from tests.helpers import assert_refused, fail_fast, run


def folder(path, folder_id: int, shapes: dict[tuple[int, ...], int], channels: int = 4, text=(8, 16)) -> str:
    """A prepared folder: one shard per latent shape ``(T, H, W)`` (``(H, W)``: images) with that many samples, each sample's latents
    filled with its id ``1000 * folder_id + row`` (rows numbered across the folder's shards)."""
    path.mkdir(parents=True, exist_ok=True)
    row = 0
    for index, (shape, count) in enumerate(shapes.items()):
        ids = torch.arange(row, row + count, dtype=torch.float64) + 1000 * folder_id
        write_text_latents(path / f"shard-{index:05d}.safetensors", ids.reshape(-1, *[1] * (len(shape) + 1)).expand(
            count, channels, *shape).clone(), torch.randn(count, *text, dtype=torch.float64))
        row += count
    return str(path)


def sample_ids(data: TextLatentsDataModule, steps: int, dp_rank: int = 0, dp_size: int = 1) -> list[list[int]]:
    """The sample ids of each of ``steps`` training batches of one data-parallel rank, as train.py's loader reads."""
    data.trainer = SimpleNamespace(accumulate_grad_batches=1, max_steps=steps, global_step=0, strategy=SimpleNamespace(
        distributed_sampler_kwargs={"rank": dp_rank, "num_replicas": dp_size} if dp_size > 1 else None))
    data.setup()
    return [x.flatten(1)[:, 0].long().tolist() for x, _ in data.train_dataloader()]


SHAPE, OTHER = (3, 4, 4), (1, 4, 6)  # a clip bucket and an image bucket (a 1-frame video)


def test_repeats_count_exactly_over_an_epoch(tmp_path):
    a = folder(tmp_path / "a", 1, {SHAPE: 6})
    b = folder(tmp_path / "b", 2, {SHAPE: 4})
    data = TextLatentsDataModule(datasets=[{"path": a, "repeats": 3}, {"path": b}], batch_size=2)
    epoch = 6 * 3 + 4
    counts = Counter(i for batch in sample_ids(data, 2 * epoch // 2) for i in batch)  # two epochs
    assert counts == {**{1000 + r: 6 for r in range(6)}, **{2000 + r: 2 for r in range(4)}}


def test_every_bucket_reads_each_sample_its_repeats_times_per_epoch(tmp_path):
    """Several shapes: each step reads one bucket (its draw is seeded); within every bucket's epoch each sample
    appears its folder's repeats times, across folders of that shape."""
    a = folder(tmp_path / "a", 1, {SHAPE: 4, OTHER: 6})
    b = folder(tmp_path / "b", 2, {SHAPE: 2})
    data = TextLatentsDataModule(datasets=[{"path": a, "repeats": 2}, {"path": b, "repeats": 3}], batch_size=2)
    batches = sample_ids(data, 60)
    per_bucket = {SHAPE: [], OTHER: []}
    for batch in batches:
        per_bucket[SHAPE if batch[0] % 1000 < 4 or batch[0] >= 2000 else OTHER] += batch
    clips, images = per_bucket[SHAPE], per_bucket[OTHER]
    clip_epoch, image_epoch = 4 * 2 + 2 * 3, 6 * 2
    assert len(clips) >= clip_epoch and len(images) >= image_epoch
    assert Counter(clips[:clip_epoch]) == {**{1000 + r: 2 for r in range(4)}, **{2000 + r: 3 for r in range(2)}}
    assert Counter(images[:image_epoch]) == {1004 + r: 2 for r in range(6)}


def test_one_process_reads_what_two_data_parallel_ranks_read(tmp_path):
    """The global batch of a step is the same under any rank layout: ranks of a ring / Ulysses group share a dp rank
    (so they read what it reads), and dp ranks read consecutive slices of the one-process batch."""
    a = folder(tmp_path / "a", 1, {SHAPE: 5, OTHER: 7})
    b = folder(tmp_path / "b", 2, {SHAPE: 3, OTHER: 2})
    listed = [{"path": a, "repeats": 2}, {"path": b, "repeats": 3}]
    one = sample_ids(TextLatentsDataModule(datasets=listed, batch_size=4), 30)
    ranks = [sample_ids(TextLatentsDataModule(datasets=listed, batch_size=2), 30, r, 2) for r in range(2)]
    assert [r0 + r1 for r0, r1 in zip(*ranks)] == one
    weighted = [{"path": a, "weight": 1.0}, {"path": b, "weight": 3.0}]
    one = sample_ids(TextLatentsDataModule(datasets=weighted, batch_size=4), 30)
    ranks = [sample_ids(TextLatentsDataModule(datasets=weighted, batch_size=2), 30, r, 2) for r in range(2)]
    assert [r0 + r1 for r0, r1 in zip(*ranks)] == one


def test_a_one_folder_list_reads_what_data_path_reads(tmp_path):
    a = folder(tmp_path / "a", 1, {SHAPE: 9, OTHER: 5})
    assert sample_ids(TextLatentsDataModule(datasets=[{"path": a}], batch_size=2, val_fraction=0.2), 20) == \
        sample_ids(TextLatentsDataModule(a, batch_size=2, val_fraction=0.2), 20)


def test_weights_set_each_folders_share_of_the_samples_read(tmp_path):
    """Each step's bucket is one folder's samples of one shape, drawn with chance weight share x the bucket's share
    of the folder's batches (exact in fp64); over 4000 steps the shares read are within 5 standard deviations of a
    binomial count (0.035 at p = 0.25) of the weights', whatever the folders' sizes (60 and 4 samples)."""
    a = folder(tmp_path / "a", 1, {SHAPE: 20, OTHER: 40})
    b = folder(tmp_path / "b", 2, {SHAPE: 4})
    data = TextLatentsDataModule(datasets=[{"path": a, "weight": 3}, {"path": b, "weight": 1}], batch_size=2,
                                 val_fraction=0)
    data.setup()
    groups, sizes, chances = data._training_buckets()
    assert [len(g) for g in groups] == [20, 40, 4] and sizes == [2, 2, 2]
    assert chances == [0.75 * 10 / 30, 0.75 * 20 / 30, 0.25]
    assert {i // 1000 for batch in sample_ids(data, 40) for i in batch} == {1, 2}
    steps = data.train_dataloader().dataset  # the StepBatches train.py reads: which bucket each step draws
    share_b = sum(steps.bucket_of(step) == 2 for step in range(4000)) / 4000
    assert share_b == pytest.approx(0.25, abs=5 * (0.25 * 0.75 / 4000) ** 0.5)


def test_an_evaluation_set_validates_instead_of_held_out_clips(tmp_path):
    a = folder(tmp_path / "a", 1, {SHAPE: 10})
    e = folder(tmp_path / "e", 3, {SHAPE: 3, OTHER: 2})
    data = TextLatentsDataModule(a, eval=e, batch_size=2)
    assert data.val_fraction == 0
    data.setup()
    ids = lambda subset: sorted(int(subset[i][0].flatten()[0]) for i in range(len(subset)))  # noqa: E731
    assert ids(data.train_set) == [1000 + r for r in range(10)]
    assert ids(data.val_set) == [3000 + r for r in range(5)]
    assert data.describe()["buckets"] == [{"shape": list(SHAPE), "samples": 10}]  # the eval-only shape: not trained
    given = TextLatentsDataModule(a, eval=[e], batch_size=2, val_fraction=0.2)  # a fraction given: held out too
    given.setup()
    assert len(given.train_set) == 8 and len(given.val_set) == 2 + 5
    # infer.py's held-out prompts: the checkpoint's source opens the same folders again
    again = TextLatentsDataModule(**data_source(data.describe()["source"]), check_values=False)
    assert again.held_out(3)[0]["text"].equal(data.held_out(3)[0]["text"])


def test_the_start_up_lines_say_what_an_epoch_holds(tmp_path, caplog):
    a = folder(tmp_path / "a", 1, {SHAPE: 6, OTHER: 2})
    b = folder(tmp_path / "b", 2, {SHAPE: 4})
    with caplog.at_level(logging.INFO, logger="ringdit.data.text_latents"):
        TextLatentsDataModule(datasets=[{"path": a, "repeats": 2}, {"path": b}], eval=b)
    assert caplog.messages == [
        f"data.datasets[0] {a}: 8 samples, x 2 repeats = 16 of an epoch's 20 samples (80.0 %); buckets 3x4x4: 6, "
        f"1x4x6: 2",
        f"data.datasets[1] {b}: 4 samples, x 1 repeats = 4 of an epoch's 20 samples (20.0 %); buckets 3x4x4: 4",
        f"data.eval {b}: 4 samples, their loss logged as val/loss; data.val_fraction=0: no training sample held out; "
        f"buckets 3x4x4: 4"]


BAD = {  # entry -> (the refusal, the entry following its advice)
    "missing path": ({"path": "{root}/nowhere"}, r"data.datasets\[1\].path=.*/nowhere does not exist; give a folder",
                     {"path": "{root}/b"}),
    "no path": ({"repeats": 2}, r"data.datasets\[1\] has no path; give \{path: <a prepared folder>\}",
                {"path": "{root}/b", "repeats": 2}),
    "repeats 0": ({"path": "{root}/b", "repeats": 0}, r"data.datasets\[1\].repeats=0: give how many times each sample "
                  r"appears per epoch, an integer >= 1 \(e.g. repeats: 2\)", {"path": "{root}/b", "repeats": 2}),
    "repeats negative": ({"path": "{root}/b", "repeats": -1}, r"data.datasets\[1\].repeats=-1: .*integer >= 1",
                         {"path": "{root}/b", "repeats": 2}),
    "repeats not an integer": ({"path": "{root}/b", "repeats": 1.5}, r"data.datasets\[1\].repeats=1.5: .*integer",
                               {"path": "{root}/b", "repeats": 2}),
    "unknown key": ({"path": "{root}/b", "repeat": 2}, r"data.datasets\[1\] has an unknown key 'repeat'; did you mean "
                    r"repeats\? an entry takes path, repeats, weight", {"path": "{root}/b", "repeats": 2}),
    "different channels": ({"path": "{root}/c8"}, r"data.datasets\[1\]=.*/c8 has latent channels 8 but "
                           r"data.datasets\[0\]=.*/a has 4; the folders of one run must agree: prepare every folder "
                           r"with the same VAE", {"path": "{root}/b"}),
    "image and video latents": ({"path": "{root}/img"}, r"data.datasets\[1\]=.*/img has latent dims \(image vs "
                                r"video\) 2 but data.datasets\[0\]=.*/a has 3; .*store images as 1-frame videos",
                                {"path": "{root}/b"}),
    "different text widths": ({"path": "{root}/t32"}, r"data.datasets\[1\]=.*/t32 has text, pooled and glyph widths "
                              r".*\(8, 32\).* but data.datasets\[0\]=.*/a has .*\(8, 16\)", {"path": "{root}/b"}),
}
WEIGHTED_BAD = {
    "weight nan": ({"path": "{root}/b", "weight": float("nan")}, r"data.datasets\[1\].weight=nan: give a positive "
                   r"finite number", {"path": "{root}/b", "weight": 0.5}),
    "weight negative": ({"path": "{root}/b", "weight": -1.0}, r"data.datasets\[1\].weight=-1.0: give a positive",
                        {"path": "{root}/b", "weight": 0.5}),
    "repeats and weight": ({"path": "{root}/b", "weight": 2.0, "repeats": 2}, r"data.datasets\[1\] sets both "
                           r"repeats=2 and weight=2.0; .*keep one of them", {"path": "{root}/b", "weight": 2.0}),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("datasets")
    folder(root / "a", 1, {SHAPE: 4})
    folder(root / "b", 2, {SHAPE: 4})
    folder(root / "c8", 3, {SHAPE: 4}, channels=8)
    folder(root / "t32", 4, {SHAPE: 4}, text=(8, 32))
    folder(root / "img", 5, {SHAPE[1:]: 4})  # (N, C, H, W): images for an image model
    return root


def _filled(entry: dict, root) -> dict:
    return {k: v.format(root=root) if isinstance(v, str) else v for k, v in entry.items()}


@pytest.mark.parametrize("case", [*BAD, *WEIGHTED_BAD])
def test_bad_dataset_entries_are_one_line_and_the_advice_works(case, root):
    bad, message, fixed = {**BAD, **WEIGHTED_BAD}[case]
    first = {"path": str(root / "a"), **({"weight": 1.0} if case in WEIGHTED_BAD else {})}
    with pytest.raises(ConfigError, match=message) as refused:
        TextLatentsDataModule(datasets=[first, _filled(bad, root)])
    assert "\n" not in str(refused.value)
    assert len(TextLatentsDataModule(datasets=[first, _filled(fixed, root)]).shards) == 2


def test_list_wide_refusals_and_their_advice(root):
    a, b = str(root / "a"), str(root / "b")
    with pytest.raises(ConfigError, match=r"data.datasets\[1\] has no weight but data.datasets\[0\] has weight 2.0: "
                                          r"give every dataset a weight"):
        TextLatentsDataModule(datasets=[{"path": a, "weight": 2}, {"path": b}])
    TextLatentsDataModule(datasets=[{"path": a, "weight": 2}, {"path": b, "weight": 1}])
    with pytest.raises(ConfigError, match=r"data.path=.*/a and data.datasets are both set; list the folder in "
                                          r"data.datasets .* and set data.path=null"):
        TextLatentsDataModule(a, datasets=[{"path": b}])
    TextLatentsDataModule(None, datasets=[{"path": a}, {"path": b}])
    with pytest.raises(ConfigError, match=r"data.eval=.*/nowhere does not exist"):
        TextLatentsDataModule(a, eval=str(root / "nowhere"))
    with pytest.raises(ConfigError, match=r"data.eval=.*/c8 has latent channels 8 but data.path=.*/a has 4"):
        TextLatentsDataModule(a, eval=str(root / "c8"))


TRAIN = ["experiment=wan_tiny", "data=datasets", "data.batch_size=2", "trainer.max_steps=2", "logger=csv",
         "trainer.val_check_interval=2", "~callbacks.model_checkpoint", "~callbacks.sample_grid"]


def test_train_py_refuses_a_bad_list_before_any_rank_starts(root, tmp_path):
    proc, seconds = fail_fast("train.py", *TRAIN, "ring_degree=2", f"hydra.run.dir={tmp_path / 'run'}",
                              f"data.datasets=[{{path: {root / 'a'}}}, {{path: {root / 'b'}, repeats: 0}}]")
    assert_refused(proc, r"data.datasets\[1\].repeats=0: give how many times", seconds=seconds,
                   run_dir=tmp_path / "run")


def test_train_py_trains_on_a_list_and_logs_the_evaluation_loss(root, tmp_path):
    """From the command line as a user writes it: two folders with repeats, an evaluation set, the start-up lines."""
    proc = run("train.py", tmp_path, *TRAIN, f"data.datasets=[{{path: {root / 'a'}, repeats: 2}}, "
                                              f"{{path: {root / 'b'}}}]", f"data.eval={root / 'b'}",
               env={"HF_HUB_OFFLINE": "1"})
    output = proc.stdout + proc.stderr
    assert f"data.datasets[0] {root / 'a'}: 4 samples, x 2 repeats = 8 of an epoch's 12 samples (66.7 %)" in output
    assert f"data.datasets[1] {root / 'b'}: 4 samples, x 1 repeats = 4 of an epoch's 12 samples (33.3 %)" in output
    with open(tmp_path / "csv" / "metrics.csv") as f:
        assert [float(row["val/loss"]) for row in csv.DictReader(f) if row.get("val/loss")]  # the eval set's loss


@pytest.mark.slow  # the data-level test above shows the same samples per rank; this trains them under ring 2
def test_train_py_on_a_list_under_ring_2_equals_one_process(tmp_path):
    """Two folders of two shapes with repeats: the same bucket (token count) every step, the same losses, under
    ring 2 as in one process (fp32: a layout reorders sums only, the bounds of tests/test_buckets.py)."""
    a = folder(tmp_path / "a", 1, {(3, 6, 10): 6, (5, 6, 10): 4})  # 45 and 75 tokens
    b = folder(tmp_path / "b", 2, {(3, 6, 10): 4})
    common = [*TRAIN, "trainer.max_steps=4", "trainer.val_check_interval=4", "optimizer=sgd", "optimizer.lr=0.5",
              "scheduler=constant", f"data.datasets=[{{path: {a}, repeats: 2}}, {{path: {b}}}]", f"data.eval={b}"]
    run("train.py", tmp_path / "one", *common, env={"HF_HUB_OFFLINE": "1"})
    run("train.py", tmp_path / "ring2", *common, "ring_degree=2", env={"HF_HUB_OFFLINE": "1"})
    metrics = {}
    for name in ("one", "ring2"):
        with open(tmp_path / name / "csv" / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        metrics[name] = {key: {int(r["step"]): float(r[key]) for r in rows if r.get(key)}
                         for key in ("train/loss", "train/sample_tokens", "val/loss")}
    assert set(metrics["one"]["train/sample_tokens"].values()) == {45.0, 75.0}  # the steps did change bucket
    assert metrics["ring2"]["train/sample_tokens"] == metrics["one"]["train/sample_tokens"]
    for key in ("train/loss", "val/loss"):
        assert sorted(metrics["ring2"][key]) == sorted(metrics["one"][key])
        for step, value in metrics["one"][key].items():
            assert metrics["ring2"][key][step] == pytest.approx(value, rel=1e-5), (key, step)
