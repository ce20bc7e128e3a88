"""diffusers models (Wan, Flux) through train.py / infer.py: the same SGD steps and samples under every layout,
exact resume, fine-tuning from a local diffusers folder, and one-line errors for what a user can get wrong."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tests.helpers import (
    WAN,
    LazyRuns,
    assert_same_numbers,
    fail_fast,
    logged_losses,
    model_weights,
    prepare_train,
    run,
    save_tiny_wan,
)

LAYOUTS = {"ring1": [], "ring2": ["ring_degree=2"], "ring2_ulysses2": ["ring_degree=2", "ulysses_degree=2"]}


@pytest.fixture(scope="module")
def wan_runs(tmp_path_factory):
    """The same SGD steps at each layout, trained when first read; all read one synthetic data folder."""
    root = tmp_path_factory.mktemp("wan")
    return LazyRuns(root, LAYOUTS, *WAN, f"data.cache_dir={root / 'data'}", env={"HF_HUB_OFFLINE": "1"})


# slow: tests/test_buckets.py runs the same SGD steps at ring 2 x Ulysses 2 on a three-bucket set, whose steps change
# shape (one bucket is its special case), and tests/test_diffusers_models.py proves every layout's forward and
# backward in-process
@pytest.mark.parametrize("layout", [pytest.param("ring2", marks=pytest.mark.slow),
                                    pytest.param("ring2_ulysses2", marks=pytest.mark.slow)])
def test_wan_sgd_steps_equal_one_process(wan_runs, layout):
    """fp32: a layout reorders sums only (tests/test_training.py's test_sgd_steps_equal_one_device reasons the
    tolerances): measured, weights within 6e-8 and losses within 1.2e-7 of themselves, >= 38x inside the bounds."""
    reference, parallel = logged_losses(wan_runs.trained("ring1")), logged_losses(wan_runs.trained(layout))
    assert sorted(reference) == sorted(parallel) == [0, 1, 2]
    for step in reference:
        assert parallel[step] == pytest.approx(reference[step], rel=1e-5), f"step {step}"
    assert reference[2] != pytest.approx(reference[0], rel=1e-3)  # the steps did change the model
    ref_weights, weights = model_weights(wan_runs.trained("ring1")), model_weights(wan_runs.trained(layout))
    assert any(key.startswith("model.transformer.blocks.") for key in ref_weights)
    for key, value in ref_weights.items():
        assert_same_numbers(weights[key], value, rtol=1e-5, atol=1e-6, where=key)


@pytest.mark.slow  # tests/test_buckets.py resumes a three-bucket run at ring 2: the bucket sequence, losses, weights
def test_wan_resume_continues_the_loss_curve(wan_runs, tmp_path):
    step2 = wan_runs.trained("ring1") / "checkpoints" / "step_0000002.ckpt"
    run("train.py", tmp_path, *WAN, f"data.cache_dir={wan_runs.root / 'data'}", f"ckpt_path={step2}", "ring_degree=2")
    assert logged_losses(tmp_path)[2] == pytest.approx(logged_losses(wan_runs.trained("ring1"))[2], rel=1e-5)
    for key, value in model_weights(wan_runs.trained("ring1")).items():
        assert_same_numbers(model_weights(tmp_path)[key], value, rtol=1e-5, atol=1e-6, where=key)


def test_wan_trains_with_accumulated_gradients(wan_runs, tmp_path):
    """A diffusers model (DDP's static graph: its loss may leave parameters without a gradient) accumulating two
    micro-batches a step: DDP finds its unused parameters each step instead, since the static graph cannot learn under
    no_sync (the run failed at its first step with DDP's "expect_autograd_hooks_" assert)."""
    run("train.py", tmp_path, *WAN, f"data.cache_dir={wan_runs.root / 'data'}", "trainer.max_steps=2",
        "trainer.accumulate_grad_batches=2", "trainer.val_check_interval=2")
    losses = logged_losses(tmp_path)
    assert sorted(losses) == [0, 1] and all(np.isfinite(list(losses.values()))), losses


def test_wan_samples_do_not_depend_on_the_layout(wan_runs, tmp_path):
    ckpt = wan_runs.trained("ring1") / "checkpoints" / "last.ckpt"
    samples = {}
    for name, overrides in (("ring1", []), ("ring2", ["ring_degree=2"])):
        run("infer.py", tmp_path / name, f"ckpt_path={ckpt}", "num_samples=3", "diffusion.sampling.steps=3",
            "diffusion.sampling.cfg_scale=4", *overrides)
        samples[name] = np.load(tmp_path / name / "samples.npz")
    assert samples["ring1"]["latents"].shape == (3, 4, 3, 8, 8)
    assert list(samples["ring1"]["captions"]) == list(samples["ring2"]["captions"])
    # fp32: ring 2 reorders each forward's sums, ~ an ulp of latents of max ~3.5, grown by 3 steps at CFG 4 (4 c - 3 u):
    # 1.1e-6 measured, 1e-4 is 90x that
    np.testing.assert_allclose(samples["ring2"]["latents"], samples["ring1"]["latents"], atol=1e-4)


def test_fine_tune_from_a_diffusers_folder(wan_runs, tmp_path):
    """init_from=<diffusers folder> (and model.pretrained=) start from its weights: step 0's loss is the same."""
    state = save_tiny_wan(tmp_path / "wan")
    data = f"data.cache_dir={wan_runs.root / 'data'}"
    run("train.py", tmp_path / "init", *WAN, data, f"init_from={tmp_path / 'wan'}", "trainer.max_steps=1")
    run("train.py", tmp_path / "pre", *WAN, data, f"model.pretrained={tmp_path / 'wan'}", "trainer.max_steps=1")
    assert logged_losses(tmp_path / "init")[0] == pytest.approx(logged_losses(tmp_path / "pre")[0], rel=1e-6)
    assert logged_losses(tmp_path / "init")[0] != pytest.approx(logged_losses(wan_runs.trained("ring1"))[0], rel=1e-3)
    ckpt = torch.load(tmp_path / "pre" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    key = "blocks.0.attn1.to_q.weight"
    assert not torch.equal(ckpt[f"model.transformer.{key}"], state[key])  # it trained one SGD step from them
    torch.testing.assert_close(ckpt[f"ema.module.transformer.{key}"], state[key], rtol=0.2, atol=0.05)


@pytest.fixture(scope="module")
def bad_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_wan")
    (root / "empty").mkdir()
    (root / "other" / "transformer").mkdir(parents=True)
    (root / "other" / "transformer" / "config.json").write_text('{"_class_name": "FluxTransformer2DModel"}')
    (root / "broken" / "transformer").mkdir(parents=True)
    (root / "broken" / "transformer" / "config.json").write_text("{not json")
    return root


BAD_WAN_INPUTS = {
    "missing pretrained folder": (["model.pretrained=/nonexistent/wan"],
                                  r"model.pretrained=/nonexistent/wan is not a folder"),
    "no transformer/config.json": (["model.pretrained={root}/empty"],
                                   r"model.pretrained=.*/empty has no transformer/config.json: not a diffusers "
                                   r"WanTransformer3DModel folder \(if the folder is the transformer itself, set "
                                   r"model.subfolder=null\)"),
    "another model class": (["model.pretrained={root}/other"],
                            r"holds a FluxTransformer2DModel, not a WanTransformer3DModel"),
    "broken config.json": (["model.pretrained={root}/broken"], r"config.json is not valid JSON"),
    "init_from another architecture": (["init_from={root}/other"], r"init_from=.* holds a FluxTransformer2DModel"),
    "class labels for a text model": (["data=digits"], r"model.family=wan is conditioned on text, but the data gives "
                                                       r"class labels; use data=text_latents"),
    "text data for the DiT": (["model=dit_digits"], r"the data is text-conditioned .* but the model is the "
                                                    r"class-conditional DiT"),
    "more Ulysses ranks than heads": (["ulysses_degree=4"], r"ulysses_degree=4 is more than the model's num_heads=2"),
    "no data path": (["data=text_latents"], r"data.path is not set"),
}


@pytest.mark.parametrize("case", list(BAD_WAN_INPUTS))
def test_wan_bad_input_is_refused_before_spawning(case, bad_folders, tmp_path):
    overrides, message = BAD_WAN_INPUTS[case]
    overrides = [o.format(root=bad_folders) for o in overrides]
    own_data = any(o.startswith("data=") for o in overrides)
    synthetic = [] if own_data else [f"data.cache_dir={tmp_path}", "data.num_samples=16"]
    from hydra.errors import InstantiationException

    with pytest.raises((ValueError, InstantiationException)) as raised:  # what user_errors shows as one line
        prepare_train(["experiment=wan_tiny", *synthetic, *overrides], tmp_path / "run")
    assert re.search(message, f"{raised.value} {raised.value.__cause__}"), raised.value
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("case", ["missing pretrained folder", "class labels for a text model"])
def test_wan_bad_input_fails_in_one_line_with_exit_code_2(case, bad_folders, tmp_path):
    overrides, message = BAD_WAN_INPUTS[case]
    own_data = any(o.startswith("data=") for o in overrides)
    synthetic = [] if own_data else [f"data.cache_dir={tmp_path}", "data.num_samples=16"]
    proc, _ = fail_fast("train.py", "experiment=wan_tiny", *synthetic, f"hydra.run.dir={tmp_path / 'run'}", *overrides)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and re.search(message, lines[0]), proc.stderr[-3000:]


FLUX = ["experiment=flux_tiny", "data.num_samples=32", "data.batch_size=4", "trainer.max_steps=2", "logger=csv",
        "scheduler=constant", "optimizer=sgd", "optimizer.lr=0.5", "trainer.val_check_interval=2"]


def test_flux_trains_and_samples_the_same_unsplit_and_cfg_parallel_over_a_ring(tmp_path):
    """Joint attention end to end: guided samples equal with the guidance halves split over two data-parallel
    replicas (cfg_parallel), each sharded over a ring of 2, and unsplit. (The SGD steps under ring 2 x Ulysses 2
    against one process: tests/test_buckets.py, on a set whose steps change shape.)"""
    data = f"data.cache_dir={tmp_path / 'data'}"
    run("train.py", tmp_path / "ring1", *FLUX, data, env={"HF_HUB_OFFLINE": "1"})
    ckpt = tmp_path / "ring1" / "checkpoints" / "last.ckpt"
    samples = {}
    # CFG parallel: the guidance halves on two data-parallel replicas, each sharded over a ring of 2
    for name, overrides in (("ring1", []), ("cfg_parallel", ["dp_degree=2", "cfg_parallel=true", "ring_degree=2"])):
        run("infer.py", tmp_path / f"infer_{name}", f"ckpt_path={ckpt}", "num_samples=3",
            "diffusion.sampling.steps=2", "diffusion.sampling.cfg_scale=4",
            *overrides)
        samples[name] = np.load(tmp_path / f"infer_{name}" / "samples.npz")["latents"]
    assert samples["ring1"].shape == (3, 1, 8, 8)
    # fp32: the halves' forwards at another batch size and layout reorder the sums, ~ulps of latents of max ~2.6 grown
    # by 2 steps at CFG 4: 1.1e-6 measured, and the losses within 1.1e-7 of themselves; the bounds are ~90x that
    np.testing.assert_allclose(samples["cfg_parallel"], samples["ring1"], atol=1e-4)
