"""train.py and infer.py end to end on CPU ranks, and the configs they compose."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import OmegaConf

from ringdit.commands.cli import register_resolvers
from ringdit.spec import build_on_meta, model_config, resolve_shift
from tests.helpers import (
    LazyRuns,
    assert_same_numbers,
    CONF,
    GOOD,
    LABELS,
    SGD,
    TINY,
    fail_fast,
    in_process,
    logged_losses,
    model_weights,
    run,
    write_classes,
    write_latents,
)

# ---- configs -----------------------------------------------------------------------------------------------------


def group_options():
    """Every option of every group, but the real-model recipes: they need a pretrained folder and prepared data, and
    test_recipes composes each and trains its tiny twin."""
    for group in sorted(p for p in CONF.iterdir() if p.is_dir()):
        for option in sorted(group.glob("*.yaml")):
            if "Sources of the settings" not in option.read_text():
                yield group.name, option.stem


def companion_overrides(group: str, option: str, tmp_path: Path) -> list[str]:
    """What an option needs beside it: its input files, or the model / data that fits it."""

    if (group, option) == ("data", "image_folder"):
        write_classes(tmp_path / "images", {"a": 1, "b": 1})
        return [f"data.root={tmp_path / 'images'}"]
    if (group, option) == ("data", "latents"):
        return [f"data.path={write_latents(tmp_path, GOOD, LABELS)}"]
    if (group, option) in (("data", "moving_digits"), ("model", "dit_video")):
        return ["data=moving_digits", "model=dit_video"]
    if (group, option) == ("data", "captioned_moving_digits"):  # pixels: one channel, the demo's text width
        return [f"data.cache_dir={tmp_path}", "data.num_videos=8", "model=wan_tiny", "model.config.in_channels=1",
                "model.config.out_channels=1", "model.config.text_dim=32"]
    synthetic = ["data=synthetic_text_latents", f"data.cache_dir={tmp_path}", "data.num_samples=4"]
    if (group, option) in (("data", "text_latents"), ("data", "datasets")):
        from ringdit.data.synthetic_text_latents import synthetic_text_latents
        from ringdit.data.text_latents import write_text_latents

        shard = write_text_latents(tmp_path / "shard.safetensors", **synthetic_text_latents(4))
        where = f"data.path={shard}" if option == "text_latents" else f"data.datasets=[{{path: {shard}, repeats: 2}}]"
        return [where, "model=wan_tiny"]
    if (group, option) in (("data", "synthetic_text_latents"), ("model", "wan_tiny")):
        return [*synthetic, "model=wan_tiny"]
    if (group, option) == ("model", "wan22_a14b_tiny"):  # two experts
        return synthetic
    if (group, option) == ("model", "wan22_i2v_a14b_tiny"):
        return [*synthetic, "data.image=true"]
    if (group, option) == ("model", "wan22_i2v_a14b"):
        return [*synthetic, "data.image=true", "data.channels=16", "data.text_dim=4096", "data.size=4"]
    if (group, option) in (("model", "wan_1_3b"), ("model", "wan_14b"), ("model", "wan22_a14b")):
        return [*synthetic, "data.channels=16", "data.text_dim=4096"]
    if (group, option) == ("model", "wan"):
        from tests.helpers import save_tiny_wan

        save_tiny_wan(tmp_path / "wan")
        return [*synthetic, f"model.pretrained={tmp_path / 'wan'}"]
    images = [*synthetic, "data.frames=0"]
    if (group, option) == ("model", "flux_tiny"):
        return [*images, "data.channels=1", "data.text_dim=32", "data.pooled_dim=32"]
    if (group, option) in (("model", "flux_dev"), ("model", "flux_schnell")):
        return [*images, "data.channels=16", "data.text_dim=4096", "data.pooled_dim=768", "data.size=4"]
    if (group, option) == ("model", "flux"):  # the bare family needs a folder: a tiny Flux saved by diffusers
        from diffusers import FluxTransformer2DModel

        config = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "flux_tiny.yaml").config)
        FluxTransformer2DModel(**config).save_pretrained(tmp_path / "flux" / "transformer")
        return [*images, f"model.pretrained={tmp_path / 'flux'}", "data.channels=1", "data.text_dim=32",
                "data.pooled_dim=32"]
    if (group, option) == ("model", "flux2_tiny"):
        return [*images, "data.channels=1", "data.text_dim=32"]
    if (group, option) == ("model", "flux2"):
        return [*images, "data.channels=32", "data.text_dim=15360", "data.size=4"]
    if (group, option) == ("model", "qwenimage_tiny"):
        return [*images, "data.text_dim=16"]
    if (group, option) == ("model", "qwenimage_edit_tiny"):  # + the reference images' latents
        return [*images, "data.text_dim=16", "data.reference=true"]
    if (group, option) in (("model", "qwenimage_edit"), ("model", "qwenimage_edit_2511")):
        return [*images, "data.channels=16", "data.text_dim=3584", "data.size=4", "data.reference=true"]
    if (group, option) == ("model", "qwenimage"):
        return [*images, "data.channels=16", "data.text_dim=3584", "data.size=4"]
    if (group, option) == ("model", "hunyuan_video15_tiny"):
        return synthetic
    if (group, option) == ("model", "hunyuan_video15"):
        return [*synthetic, "data.channels=32", "data.text_dim=3584", "data.size=4"]
    if (group, option) == ("model", "hunyuan_video15_i2v_tiny"):  # + the first frames' latents and SigLIP-like states
        return [*synthetic, "data.image=true", "data.image_dim=12"]
    if (group, option) == ("model", "hunyuan_video15_i2v"):
        return [*synthetic, "data.image=true", "data.image_dim=1152", "data.channels=32", "data.text_dim=3584",
                "data.size=4"]
    if (group, option) in (("model", "skyreels_v2_tiny"), ("model", "ltx_video_tiny")):
        return synthetic
    if (group, option) == ("model", "wan22_ti2v_tiny"):  # image-to-video: the first frames' latents in the data
        return [*synthetic, "data.image=true"]
    if (group, option) == ("model", "wan22_ti2v"):
        return [*synthetic, "data.image=true", "data.channels=48", "data.text_dim=4096", "data.size=4"]
    if (group, option) == ("model", "wan_i2v_tiny"):  # + CLIP image embeddings; Wan's image keys assume 512 text
        return [*synthetic, "data.image=true", "data.image_dim=16", "data.text_len=512"]
    if (group, option) == ("model", "wan_i2v"):
        return [*synthetic, "data.image=true", "data.image_dim=1280", "data.channels=16", "data.text_dim=4096",
                "data.text_len=512", "data.size=4"]
    if (group, option) == ("model", "skyreels_v2"):
        return [*synthetic, "data.channels=16", "data.text_dim=4096", "data.size=4"]
    if (group, option) == ("model", "ltx_video"):
        return [*synthetic, "data.channels=128", "data.text_dim=4096", "data.size=4"]
    if (group, option) == ("model", "ltx2_tiny"):  # + the clips' audio latents (2 channels x 2 mel bins)
        return [*synthetic, "data.audio=[2,5,2]"]
    if (group, option) == ("model", "ltx2"):  # LTX-2's audio VAE: 8 channels x 16 mel bins
        return [*synthetic, "data.channels=128", "data.text_dim=3840", "data.size=4", "data.audio=[8,5,16]"]
    if (group, option) == ("model", "minimax_h3_tiny"):  # + the stereo audio latents (2 channels x audio_in_channels)
        return [*synthetic, "data.audio=[2,5,8]"]
    if (group, option) == ("model", "minimax_h3"):
        return [*synthetic, "data.channels=24", "data.text_dim=5120", "data.size=4", "data.audio=[2,5,32]"]
    if (group, option) == ("model", "wan_vace_tiny"):  # + the control video's latents (vace_in_channels)
        return [*synthetic, "data.control=72"]
    if (group, option) in (("model", "wan_vace_1_3b"), ("model", "wan_vace_14b")):
        return [*synthetic, "data.control=96", "data.channels=16", "data.text_dim=4096", "data.size=4"]
    if (group, option) == ("model", "wan_vace"):  # the bare family needs a folder: a tiny VACE saved by diffusers
        from diffusers import WanVACETransformer3DModel

        config = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "wan_vace_tiny.yaml").config)
        WanVACETransformer3DModel(**config).save_pretrained(tmp_path / "wan_vace" / "transformer")
        return [*synthetic, "data.control=72", f"model.pretrained={tmp_path / 'wan_vace'}"]
    if (group, option) == ("model", "cogvideox15_tiny"):  # latent frames: a multiple of its temporal patch
        return [*synthetic, "data.frames=4"]
    if (group, option) == ("model", "cogvideox15"):
        return [*synthetic, "data.frames=2", "data.channels=16", "data.text_dim=4096", "data.size=4"]
    if (group, option) in (("experiment", "wan_tiny"), ("experiment", "flux_tiny"),
                           ("experiment", "hunyuan_video15_tiny"), ("experiment", "skyreels_v2_tiny"),
                           ("experiment", "ltx_video_tiny"), ("experiment", "flux2_tiny"),
                           ("experiment", "cogvideox_tiny")):
        return [f"data.cache_dir={tmp_path}", "data.num_samples=4"]
    return []


@pytest.mark.parametrize(("group", "option"), list(group_options()))
def test_every_config_option_composes_and_instantiates(group, option, tmp_path):
    register_resolvers()
    if group == "cache":  # infer.py's group: composed with infer.yaml and checked as InferSpec checks it
        from ringdit.caching import CacheSettings

        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            CacheSettings.from_config(compose("infer", overrides=[f"cache={option}"]).cache)
        return
    overrides = [f"{group}={option}", *companion_overrides(group, option, tmp_path), f"hydra.run.dir={tmp_path}"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        cfg.paths.output_dir = str(tmp_path)
        datamodule = instantiate(cfg.data)
        if group in ("model", "data"):
            model = build_on_meta(model_config(cfg.model, datamodule.describe()))  # shapes only: DiT-XL in ms
            assert model.in_channels == datamodule.channels
        objective = OmegaConf.to_container(cfg.diffusion.objective, resolve=True)
        resolve_shift(objective, {}, tokens=256)  # shift=resolution (Flux) depends on the image token count
        instantiate(objective)
        for node in ("logger", "callbacks"):
            for item in (cfg.get(node) or {}).values():
                if node == "logger" and "wandb" in item._target_:
                    item.mode = "disabled"
                instantiate(item)
        if cfg.get("optimizer"):
            optimizer = instantiate(cfg.optimizer)(params=[torch.nn.Parameter(torch.zeros(1))])
            if cfg.get("scheduler"):
                instantiate(cfg.scheduler)(optimizer=optimizer)
        if cfg.trainer.accelerator != "gpu" or torch.cuda.is_available():
            instantiate(cfg.trainer, logger=False, callbacks=[])


def test_cfg_job_shows_the_composed_config():
    proc, _ = in_process("train.py", "--cfg", "job", "ring_degree=4")
    assert proc.returncode == 0, proc.stderr
    assert "ring_degree: 4" in proc.stdout and "_target_: ringdit.models.DiT" in proc.stdout


# ---- end to end ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sgd_runs(tmp_path_factory):
    """The same 3 SGD steps on the same global batch under different parallel layouts (each trained when first read)."""
    layouts = {
        "ring1": [],
        "ring2": ["ring_degree=2"],
        "ulysses2": ["ulysses_degree=2"],
        "ring4": ["ring_degree=4"],
        "ring2_ulysses2": ["ring_degree=2", "ulysses_degree=2"],
        "dp2_ring2": ["dp_degree=2", "ring_degree=2", "data.batch_size=8"],  # same 16-sample global batch
    }
    return LazyRuns(tmp_path_factory.mktemp("sgd"), layouts, *TINY, *SGD)


# ring x Ulysses and dp x ring run by default; the single-kind layouts are slow duplicates of what they combine (and
# tests/test_dit.py proves each layout's forward and backward in-process).
@pytest.mark.parametrize("layout", [pytest.param("ring2", marks=pytest.mark.slow),
                                    pytest.param("ulysses2", marks=pytest.mark.slow),
                                    pytest.param("ring4", marks=pytest.mark.slow), "ring2_ulysses2", "dp2_ring2"])
def test_sgd_steps_equal_one_device(sgd_runs, layout):
    """Plain SGD shows a wrongly scaled gradient at once (Adam would normalise it away).

    In fp32, as training runs: a layout only reorders sums (other GEMM shapes per rank, the ring's merges, the
    gradients' all-reduce), each rounded at u = 6e-8, so after three steps the weights (max ~1) differ by an ulp or
    two and the losses (means of 16 x 256 squared errors) by ~1e-7 of themselves: measured at most 4e-8 and 8e-8
    (ring 2 x Ulysses 2). rel 1e-5 and atol 1e-6 are >= 10x that at every element; a wrongly scaled or reduced
    gradient moves a weight by ~lr x its gradient."""
    reference, parallel = logged_losses(sgd_runs.trained("ring1")), logged_losses(sgd_runs.trained(layout))
    assert sorted(reference) == sorted(parallel) == [0, 1, 2]
    for step in reference:
        assert parallel[step] == pytest.approx(reference[step], rel=1e-5), f"step {step}"
    assert reference[2] != pytest.approx(reference[0], rel=1e-3)  # the steps did change the model
    ref_weights, weights = model_weights(sgd_runs.trained("ring1")), model_weights(sgd_runs.trained(layout))
    assert_same_numbers(weights, ref_weights, rtol=1e-5, atol=1e-6, where=layout)


def test_run_outputs(sgd_runs):
    run_dir = sgd_runs.trained("ring2_ulysses2")
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert (run_dir / "checkpoints" / "step_0000002.ckpt").is_file()
    assert (run_dir / "samples" / "step_0000003.png").is_file()  # the final preview grid
    assert (run_dir / ".hydra" / "config.yaml").is_file()


def test_infer_from_the_trained_checkpoint(sgd_runs, tmp_path):
    ckpt = sgd_runs.trained("ring2_ulysses2") / "checkpoints" / "last.ckpt"
    common = [f"ckpt_path={ckpt}", "num_samples=6", "labels=[1,7]", "diffusion.sampling.steps=3",
              "diffusion.sampling.cfg_scale=2.0", "batch_size=4"]
    outputs = {}
    for name, layout in {"ring1": [], "ring2": ["ring_degree=2"]}.items():
        proc = run("infer.py", tmp_path / name, *common, *layout)
        assert "wrote 6 samples" in proc.stdout
        outputs[name] = np.load(tmp_path / name / "samples.npz")
        assert (tmp_path / name / "samples.png").is_file()
    reference = outputs["ring1"]
    assert reference["images"].shape == (6, 8, 8, 1) and reference["images"].dtype == np.uint8
    assert reference["labels"].tolist() == [1, 7, 1, 7, 1, 7] and reference["labels"].dtype == np.int64
    diff = np.abs(outputs["ring2"]["images"].astype(int) - reference["images"].astype(int)).max()
    assert diff <= 1, f"ring 2 samples differ by {diff} / 255"  # fp32 reordering may flip a rounding


def test_the_original_dits_objective_and_sampler_end_to_end(tmp_path):
    """diffusion=ddpm with learn_sigma: training logs the hybrid loss (MSE + vb) and previews with the ddpm sampler;
    infer.py's ddpm samples (fresh noise each step, per sample) are the same under ring 2 as on one rank."""
    ddpm = ["diffusion=ddpm", "model.learn_sigma=true", "diffusion.sampling.sampler=ddpm"]
    run("train.py", tmp_path / "train", *TINY, *ddpm, "trainer.max_steps=2")
    assert (tmp_path / "train" / "samples" / "step_0000002.png").is_file()
    ckpt = tmp_path / "train" / "checkpoints" / "last.ckpt"
    common = [f"ckpt_path={ckpt}", "num_samples=3", "labels=[1,7]", "diffusion.sampling.steps=4",
              "diffusion.sampling.cfg_scale=2.0", "diffusion.sampling.guidance_channels=1"]
    images = {}
    for name, layout in {"ring1": [], "ring2": ["ring_degree=2"]}.items():
        run("infer.py", tmp_path / name, *common, *layout)
        images[name] = np.load(tmp_path / name / "samples.npz")["images"].astype(int)
    assert np.abs(images["ring2"] - images["ring1"]).max() <= 1  # fp32 reordering may flip a rounding


def test_infer_without_arguments_samples_the_newest_run(sgd_runs, tmp_path):
    """``python infer.py`` = ``ckpt_path=last``: the newest training run under paths.log_dir; none says how to get one."""
    import shutil

    logs = tmp_path / "logs"
    for age, (name, run_name) in enumerate([("dp2_ring2", "2026-01-01_00-00-00"), ("ring1", "2026-01-02_00-00-00")]):
        target = logs / "train" / "runs" / run_name / "checkpoints"
        target.mkdir(parents=True)
        shutil.copy(sgd_runs.trained(name) / "checkpoints" / "last.ckpt", target / "last.ckpt")
        os.utime(target / "last.ckpt", (1e9 + age, 1e9 + age))  # the second is the newest
    proc = run("infer.py", tmp_path / "infer", f"paths.log_dir={logs}", "num_samples=2", "diffusion.sampling.steps=2")
    assert "2026-01-02_00-00-00/checkpoints/last.ckpt" in proc.stdout + proc.stderr
    assert np.load(tmp_path / "infer" / "samples.npz")["images"].shape == (2, 8, 8, 1)

    empty, _ = fail_fast("infer.py", f"paths.log_dir={tmp_path / 'none'}", f"hydra.run.dir={tmp_path / 'x'}")
    assert empty.returncode == 2 and "Traceback" not in empty.stderr
    assert empty.stderr.splitlines()[0] == (
        f"Error: ckpt_path=last: no training run under {tmp_path / 'none' / 'train'} (no checkpoints/last.ckpt); "
        f"train one with `python train.py`, or pass ckpt_path=PATH to a .ckpt or .safetensors")


def sample_under_layouts(rank, world, ckpt):
    """The sampling path of infer.py (a Sampler of the checkpoint's weights) under every layout."""
    from ringdit.models.build import build_model
    from ringdit.parallel import init_sequence_parallel
    from ringdit.sampling import Sampler
    from ringdit.checkpoints.weights import read_weights

    info = read_weights(ckpt)[1]
    labels, seeds = torch.tensor([1, 7, 3]), [10, 11, 12]
    results = {}
    for ring, ulysses in [(1, 1), (2, 1), (4, 1), (2, 2)]:
        # what SamplingModule.configure_model builds under the strategy's mesh
        dims = init_sequence_parallel(ring, ulysses)
        model, _ = build_model(info["model"], dims=dims, init_from=str(ckpt))
        sampler = Sampler.for_run(model, info["objective"], {**info["sampling"], "steps": 4, "cfg_scale": 2.0},
                                  info["data"], dims=dims)
        results[(ring, ulysses)] = sampler.generate(labels, seeds)
    for layout, samples in results.items():
        # fp32 (generate draws fp32 noise): a layout reorders the sums of each forward, ~2e-7 of max|x| (pixels, in
        # [-1, 1]) measured after 4 heun steps at CFG 2; atol 1e-5 is 50x that, and a sample that depended on the
        # layout (its noise, its tokens) would be off by O(1)
        assert_same_numbers(samples, results[(1, 1)], rtol=1e-4, atol=1e-5, where=str(layout))


def test_samples_do_not_depend_on_the_rank_layout(sgd_runs):
    from tests.distributed import run_ranks

    run_ranks(sample_under_layouts, 4, sgd_runs.trained("ring2_ulysses2") / "checkpoints" / "last.ckpt")


def test_the_old_module_name_still_loads_checkpoints(sgd_runs):
    """``DiTModule`` (the module's name before it trained every model kind) still loads a checkpoint, with a warning."""
    with pytest.warns(DeprecationWarning, match="DiTModule is now DiffusionModule"):
        from ringdit.training import DiTModule
    checkpoint = sgd_runs.trained("ring1") / "checkpoints" / "last.ckpt"
    module = DiTModule.load_from_checkpoint(checkpoint)  # strict: the model and its EMA, every key
    state = torch.load(checkpoint, weights_only=True)["state_dict"]
    assert_same_numbers(dict(module.state_dict()), state)
    ema = {key[len("ema.module."):]: value for key, value in state.items() if key.startswith("ema.module.")}
    with module.ema_weights() as model:  # the weights worth sampling: the EMA's, swapped in
        assert_same_numbers(dict(model.state_dict()), ema)
    assert_same_numbers(dict(module.state_dict()), state)  # and swapped back


def test_a_run_without_ema_saves_and_exports_its_raw_weights(tmp_path):
    """ema_decay=null: no averaged copy is kept or saved; previews sample the raw weights, and every reader of the
    checkpoint (export, infer.py with its default weights=ema) takes the raw weights, the only ones there are."""
    from ringdit.checkpoints.weights import read_weights
    from ringdit.export import main

    run("train.py", tmp_path / "run", *TINY, "trainer.max_steps=2", "ema_decay=null")
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    assert state and not [key for key in state if key.startswith("ema.")]
    assert list((tmp_path / "run" / "samples").glob("*.png"))
    assert main([f"ckpt_path={ckpt}", f"out={tmp_path / 'weights.safetensors'}"]) == 0
    exported, _ = read_weights(tmp_path / "weights.safetensors")
    assert_same_numbers(exported, {key[len("model."):]: value for key, value in state.items()})


def test_resume_continues_the_step_count(sgd_runs, tmp_path):
    ckpt = sgd_runs.trained("ring1") / "checkpoints" / "last.ckpt"
    run("train.py", tmp_path / "resumed", *TINY, *SGD, "trainer.max_steps=5", f"ckpt_path={ckpt}")
    losses = logged_losses(tmp_path / "resumed")
    assert sorted(losses) == [3, 4]
    assert torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 5


def test_training_without_label_dropout(tmp_path):
    """No null class: nothing to drop, and guidance off (cfg_scale 1)."""
    run("train.py", tmp_path, *TINY, "model.class_dropout_prob=0", "diffusion.sampling.cfg_scale=1.0")
    assert sorted(logged_losses(tmp_path)) == [0, 1, 2]


def test_multirun_sweep(tmp_path):
    """Hydra's -m: one run per seed (Hydra's basic launcher runs them one after the other, here in this process)."""
    proc, _ = in_process("train.py", "-m", "seed=1,2", *TINY, "trainer.max_steps=1", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(logged_losses(tmp_path / job) for job in ("0", "1"))
    assert logged_losses(tmp_path / "0")[0] != logged_losses(tmp_path / "1")[0]  # the seeds differ


def test_wandb_offline_run_writes_its_files(tmp_path):
    """No API key: the logger goes offline by itself. Each run (here two, in this process, as a notebook's
    ``ringdit.train`` calls) ends its wandb run when training ends: its own run folder, its files complete."""
    import wandb

    env = {"WANDB_API_KEY": "", "WANDB_MODE": ""}
    for name in ("first", "second"):
        run("train.py", tmp_path / name, *TINY, "logger=wandb", "trainer.max_steps=2", env=env)
        assert wandb.run is None, "the run's wandb run is still open"
        runs = list((tmp_path / name / "wandb").glob("offline-run-*"))
        assert len(runs) == 1, list((tmp_path / name).iterdir())
        assert list(runs[0].glob("*.wandb")), list(runs[0].iterdir())


def test_a_run_without_a_logger_trains(tmp_path):
    """logger=none: no experiment tracker, so no learning-rate monitor (Lightning refuses one without a logger); the
    checkpoints are still written."""
    run("train.py", tmp_path, *TINY, "logger=none", "trainer.max_steps=2")
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
