"""trainer/strategy=fsdp: FSDP2-sharded training equals one process, and its sharded checkpoints resume and export.

SGD steps (a wrongly scaled gradient shows at once; momentum gives the optimizer a state to save and resume) on the
same global batch: one process with DDP (the reference; tests/test_training.py proves DDP at every layout equals
it) against FSDP at ring 2, Ulysses 2, ring 2 x Ulysses 2 and dp 2 x ring 2 (HSDP: sharded within each ring, replicated across the two). Checkpoints are torch.distributed.checkpoint folders; the test reads them
back whole with ``ringdit.checkpoints.weights.read_weights`` (on one process, no process group).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ringdit.checkpoints.location import is_sharded_checkpoint
from ringdit.checkpoints.weights import read_weights
from tests.families import FLUX2, family_runs
from tests.helpers import SGD, TINY, WAN, LazyRuns, assert_same_numbers, logged_losses, run

pytestmark = pytest.mark.timeout(1200)  # a fixture run takes about 15 s on an idle 2-core machine

FSDP = ["trainer/strategy=fsdp"]
MOMENTUM = [*SGD, "optimizer.momentum=0.9"]
LAYOUTS = {
    "ring2": ["ring_degree=2"],
    "ulysses2": ["ulysses_degree=2"],
    "ring2_ulysses2": ["ring_degree=2", "ulysses_degree=2"],
    # HSDP, the natural layout for it: shard within each sequence-parallel group, replicate across the 2 replicas;
    # the same 16-sample global batch
    "dp2_ring2_hsdp": ["dp_degree=2", "ring_degree=2", "data.batch_size=8", "trainer.strategy.replicate_degree=2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process under DDP (the reference) and each FSDP layout, trained when first read."""
    layouts = {"reference": [], **{name: [*FSDP, *overrides] for name, overrides in LAYOUTS.items()}}
    return LazyRuns(tmp_path_factory.mktemp("fsdp"), layouts, *TINY, *MOMENTUM)


def weights(checkpoint: Path, prefer: str) -> dict[str, torch.Tensor]:
    return read_weights(checkpoint, prefer=prefer)[0]


def assert_same_run(run_dir: Path, reference: Path, steps=(0, 1, 2)) -> None:
    """fp32: a layout reorders sums only, as in tests/test_training.py's test_sgd_steps_equal_one_device (its
    tolerances' reasoning); with momentum, measured: weights and EMA within 9e-8 (max ~1), losses within 1.3e-7 of
    themselves (ring 2 x Ulysses 2 and HSDP), >= 19x inside the bounds at every element."""
    losses, ref_losses = logged_losses(run_dir), logged_losses(reference)
    assert sorted(losses) == list(steps)
    for step in steps:
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-5), f"step {step}"
    for prefer in ("model", "ema"):  # the EMA is sharded and updated shard by shard
        ref = weights(reference / "checkpoints" / "last.ckpt", prefer)
        got = weights(run_dir / "checkpoints" / "last.ckpt", prefer)
        assert_same_numbers(got, ref, rtol=1e-5, atol=1e-6, where=prefer)


# ring x Ulysses and HSDP run by default; the single-kind layouts are slow duplicates of what they combine.
@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow) if name in ("ring2", "ulysses2") else name
                                    for name in LAYOUTS])
def test_fsdp_sgd_steps_equal_one_device(runs, layout):
    ref_losses = logged_losses(runs.trained("reference"))
    assert ref_losses[2] != pytest.approx(ref_losses[0], rel=1e-3)  # the steps did change the model
    assert_same_run(runs.trained(layout), runs.trained("reference"))


def test_fsdp_checkpoints_are_sharded_folders(runs):
    """Each rank wrote its own shard file; no file holds the whole model; no temporary folder is left."""
    checkpoints = runs.trained("ring2_ulysses2") / "checkpoints"
    last = checkpoints / "last.ckpt"
    assert is_sharded_checkpoint(last)
    assert sorted(p.name for p in last.glob("*.distcp")) == [f"__{rank}_0.distcp" for rank in range(4)]
    assert is_sharded_checkpoint(checkpoints / "step_0000002.ckpt")
    assert not list(checkpoints.glob(".*"))


def test_fsdp_resumes_exactly_into_another_layout(runs, tmp_path):
    """Saved at step 2 on 4 ranks (ring 2 x Ulysses 2), resumed on 2 (ring 2): the last step and the final weights
    are the uninterrupted run's."""
    checkpoint = runs.trained("ring2_ulysses2") / "checkpoints" / "step_0000002.ckpt"
    run("train.py", tmp_path, *TINY, *MOMENTUM, *FSDP, "ring_degree=2", f"ckpt_path={checkpoint}")
    assert_same_run(tmp_path, runs.trained("reference"), steps=(2,))


def test_fsdp_starting_from_weights_trains_like_one_process(runs, tmp_path):
    """init_from a sharded checkpoint (saved on 4 ranks): one process reads it whole, FSDP on 2 and on 4 ranks read
    only their slices of it (``ringdit.checkpoints.sources``), and the SGD steps that follow are the same."""
    weights_from = f"init_from={runs.trained('ring2_ulysses2') / 'checkpoints' / 'last.ckpt'}"
    run("train.py", tmp_path / "one", *TINY, *MOMENTUM, weights_from)
    for name, layout in (("two", ["ring_degree=2"]), ("four", LAYOUTS["ring2_ulysses2"])):
        run("train.py", tmp_path / name, *TINY, *MOMENTUM, *FSDP, *layout, weights_from)
        assert_same_run(tmp_path / name, tmp_path / "one")


def test_resume_across_strategies(runs, tmp_path):
    """A DDP checkpoint (one file) resumes under FSDP, and an FSDP one (a folder) under DDP, momentum included."""
    ddp_checkpoint = runs.trained("reference") / "checkpoints" / "step_0000002.ckpt"
    run("train.py", tmp_path / "to_fsdp", *TINY, *MOMENTUM, *FSDP, "ring_degree=2", f"ckpt_path={ddp_checkpoint}")
    assert_same_run(tmp_path / "to_fsdp", runs.trained("reference"), steps=(2,))
    fsdp_checkpoint = runs.trained("ring2_ulysses2") / "checkpoints" / "step_0000002.ckpt"
    run("train.py", tmp_path / "to_ddp", *TINY, *MOMENTUM, f"ckpt_path={fsdp_checkpoint}")
    assert_same_run(tmp_path / "to_ddp", runs.trained("reference"), steps=(2,))


def test_export_consolidates_a_sharded_checkpoint(runs, tmp_path):
    from ringdit.export import main

    out = tmp_path / "weights.safetensors"
    sharded = runs.trained("ring2_ulysses2") / "checkpoints" / "last.ckpt"
    assert main([f"ckpt_path={sharded}", f"out={out}"]) == 0
    exported, info = read_weights(out)
    assert info["model"]["hidden_size"] == 32
    reference = weights(runs.trained("reference") / "checkpoints" / "last.ckpt", "ema")
    assert_same_numbers(exported, reference, rtol=1e-5, atol=1e-6, where="export")
    # infer.py samples from the sharded folder itself, as from its export
    for name, ckpt in (("sharded", sharded), ("export", out)):
        run("infer.py", tmp_path / name, f"ckpt_path={ckpt}", "num_samples=2", "diffusion.sampling.steps=2")
    samples = [np.load(tmp_path / name / "samples.npz")["images"] for name in ("sharded", "export")]
    np.testing.assert_array_equal(samples[0], samples[1])


def test_fsdp_trains_wan_like_one_process(tmp_path):
    """A diffusers model (Wan, sharded per WanTransformerBlock) under FSDP at ring 2: one process's SGD steps."""

    common = [*WAN, f"data.cache_dir={tmp_path / 'data'}"]
    run("train.py", tmp_path / "reference", *common, env={"HF_HUB_OFFLINE": "1"})
    run("train.py", tmp_path / "fsdp", *common, *FSDP, "ring_degree=2", env={"HF_HUB_OFFLINE": "1"})
    assert_same_run(tmp_path / "fsdp", tmp_path / "reference")


def test_fsdp_trains_flux2_like_one_process(tmp_path):
    """Flux.2 (its double- and single-stream blocks each an FSDP unit, the text sharded with the image) under FSDP at
    ring 2: one process's SGD steps, weights and EMA."""
    common = [*FLUX2, f"data.cache_dir={tmp_path / 'data'}"]
    run("train.py", tmp_path / "reference", *common, env={"HF_HUB_OFFLINE": "1"})
    run("train.py", tmp_path / "fsdp", *common, *FSDP, "ring_degree=2", env={"HF_HUB_OFFLINE": "1"})
    assert_same_run(tmp_path / "fsdp", tmp_path / "reference", steps=(0, 1))


def fake_sharded_checkpoint(folder: Path, step: int) -> Path:
    folder.mkdir(parents=True)
    torch.save({"global_step": step}, folder / "meta.pt")
    (folder / ".metadata").write_bytes(b"")
    return folder


def test_a_save_killed_between_its_renames_keeps_the_previous_checkpoint(tmp_path):
    from ringdit.checkpoints.location import recover_checkpoint, replace_folder

    last = fake_sharded_checkpoint(tmp_path / "last.ckpt", step=2)
    replace_folder(fake_sharded_checkpoint(tmp_path / ".last.ckpt.abc.tmp", step=4), last)
    assert torch.load(last / "meta.pt")["global_step"] == 4 and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    # killed after moving the old one aside, before the new one arrived: resuming puts the old one back
    fake_sharded_checkpoint(tmp_path / ".last.ckpt.def.tmp", step=6)  # complete or not, never used
    last.rename(tmp_path / ".last.ckpt.old")
    recover_checkpoint(last)
    assert torch.load(last / "meta.pt")["global_step"] == 4


def test_optimizer_state_keys_convert_both_ways():
    from ringdit.checkpoints.optimizer_state import optimizer_state_by_index, optimizer_state_by_name

    numbered = {"state": {0: {"momentum_buffer": torch.ones(2)}, 2: {"momentum_buffer": torch.zeros(3)}},
                "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.2, "params": [2]}]}
    named = optimizer_state_by_name(numbered, ["a.weight", "a.bias", "b.weight"])
    assert set(named["state"]) == {"a.weight", "b.weight"}
    assert named["param_groups"][1] == {"lr": 0.2, "params": ["b.weight"]}
    assert optimizer_state_by_index(named) == numbered


@pytest.mark.parametrize("family", ["hunyuan_video15", "ltx_video", "ltx2", "skyreels_v2", "minimax_h3"])
def test_fsdp_trains_the_video_families_like_one_process(family, tmp_path):
    """HunyuanVideo 1.5 (text after the video, its token refiner local), LTX-Video, LTX-2 (video and audio streams),
    SkyReels-V2 (per-frame timesteps) and MiniMax-H3 (text, audio and video rows packed in one sequence) under FSDP at
    ring 2, each block a unit: one process's SGD steps, weights and EMA."""
    overrides, steps = family_runs(family)
    common = [*overrides, f"data.cache_dir={tmp_path / 'data'}"]
    run("train.py", tmp_path / "reference", *common, env={"HF_HUB_OFFLINE": "1"})
    run("train.py", tmp_path / "fsdp", *common, *FSDP, "ring_degree=2", env={"HF_HUB_OFFLINE": "1"})
    assert_same_run(tmp_path / "fsdp", tmp_path / "reference", steps=steps)
