"""Previews that fit the run, and videos at each model's own frame rate.

A preview drawn in micro-batches (``callbacks.sample_grid.batch_size``) has the samples of one batch, exactly in fp64,
with the memory of one micro-batch; a preview prompt file (infer.py's, plus seed / steps / cfg_scale / guidance) is
read and checked before any rank starts; the frame rate is a fact of the model kind, which ``fps=`` overrides."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from ringdit.diffusion.pipeline import SamplingPipeline, in_micro_batches
from ringdit.common.errors import ConfigError
from ringdit.parallel import ParallelDims
from tests.helpers import architecture, assert_refused, fail_fast

SHAPE = (2, 4, 4)  # latent frames, height, width: 8 tokens at Wan's (1, 2, 2) patch


def tiny_wan_pipeline():
    """A tiny diffusers Wan in fp64 (random init) and its pipeline: Euler at shift 3, guided (two halves a forward)."""
    from ringdit.diffusion.objectives import FlowMatching
    from ringdit.models.diffusers import DiffusersTransformer

    torch.manual_seed(0)
    model = DiffusersTransformer("wan", config=architecture("wan_tiny"), input_size=SHAPE, in_channels=4, text_len=7,
                                 text_dim=16).double().eval()
    pipeline = SamplingPipeline.for_run(FlowMatching(shift=3.0), {"steps": 2, "cfg_scale": 5.0, "sampler": "euler",
                                                                  "shift": 3.0},
                                        {"image_size": list(SHAPE), "latent_scale": 1.0})
    return model, pipeline


def test_an_80_sample_preview_in_micro_batches_of_4_has_the_samples_of_one_batch():
    """Each sample's noise comes from its own seed, so the split changes nothing (fp64: exactly equal up to the
    summation order of a GEMM of another batch size, measured 0); every forward sees at most 4 samples (8 rows with
    guidance's two halves): the activations are one micro-batch's."""
    model, pipeline = tiny_wan_pipeline()
    g = torch.Generator().manual_seed(1)
    condition = {"text": torch.randn(80, 7, 16, generator=g, dtype=torch.float64)}
    seeds = list(range(100, 180))
    rows = []
    hook = model.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))

    def generate(condition, seeds, negative=None):
        return pipeline.generate(model, condition, seeds, dims=ParallelDims(), device="cpu", negative=negative)

    try:
        whole = generate(condition, seeds)
        assert set(rows) == {160}  # one batch: 80 samples, both halves of guidance
        rows.clear()
        micro = in_micro_batches(generate, condition, seeds, 4)
    finally:
        hook.remove()
    assert micro.dtype == torch.float64 and micro.shape == whole.shape == (80, 4, *SHAPE)
    assert torch.equal(micro, whole)
    assert max(rows) == 8 and len(rows) == 20 * 2  # 20 micro-batches x 2 steps


def test_micro_batches_split_per_sample_negatives_and_keep_a_shared_one():
    """A negative prompt per sample is split with the samples; one for all (1, ...) goes to every micro-batch."""
    calls = []

    def generate(condition, seeds, negative=None):
        calls.append((condition["text"][:, 0, 0].tolist(), None if negative is None else negative["text"][:, 0, 0].tolist()))
        return condition["text"][:, :1, :1]

    text = torch.arange(5.0)[:, None, None].expand(5, 2, 2)
    in_micro_batches(generate, {"text": text}, [0, 1, 2, 3, 4], 2, negative={"text": -text})
    assert calls == [([0, 1], [0, -1]), ([2, 3], [-2, -3]), ([4], [-4])]
    calls.clear()
    in_micro_batches(generate, {"text": text}, [0, 1, 2, 3, 4], 2, negative={"text": text[:1] + 7})
    assert [negative for _, negative in calls] == [[7.0]] * 3


# ---- the preview's settings --------------------------------------------------------------------------------------


def grid(**settings):
    from ringdit.training import SampleGrid

    return SampleGrid(output_dir="unused", **settings)


@pytest.mark.parametrize("setting, value, message", [
    ("fps", 0, r"callbacks.sample_grid.fps must be a positive integer, got 0; the frames per second"),
    ("fps", -1, r"callbacks.sample_grid.fps must be a positive integer, got -1"),
    ("fps", float("nan"), r"callbacks.sample_grid.fps must be a positive integer, got nan"),
    ("fps", "abc", r"callbacks.sample_grid.fps must be a positive integer, got 'abc'"),
    ("batch_size", 0, r"callbacks.sample_grid.batch_size must be a positive integer, got 0; samples per forward"),
    ("per_class", 0, r"callbacks.sample_grid.per_class must be a positive integer, got 0"),
    ("max_classes", 0, r"callbacks.sample_grid.max_classes must be a positive integer, got 0"),
])
def test_bad_preview_numbers_are_refused(setting, value, message):
    with pytest.raises(ConfigError, match=message):
        grid(**{setting: value})


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a fox", "seed": -3}', r'line 2 "seed" must be an integer from 0 to 2\*\*32 - 1'),
    ('{"prompt": "a fox", "steps": 0}', r'line 2 "steps" must be a positive integer, got 0'),
    ('{"prompt": "a fox", "cfg_scale": "high"}', r'line 2 "cfg_scale" must be a finite number'),
    ('{"prompt": "a fox", "shift": 3}', r"line 2: unknown key 'shift'; a line holds prompt, size, frames, "
                                        r"negative_prompt, seed, steps, cfg_scale, guidance"),
    ('{"prompt": ""}', r'line 2: "prompt" must be a non-empty string'),
    ("not json", r"line 2"),
])
def test_a_bad_preview_prompt_line_is_refused_naming_the_file_and_line(tmp_path, line, message):
    file = tmp_path / "previews.jsonl"
    file.write_text('{"prompt": "a red fox", "seed": 3, "steps": 20, "cfg_scale": 5.0}\n' + line + "\n")
    with pytest.raises(ConfigError, match=r"callbacks.sample_grid.prompt_file=\S+previews.jsonl " + message):
        grid(prompt_file=str(file))


def test_a_preview_prompt_file_that_does_not_exist_is_refused_before_spawning(tmp_path):
    proc, seconds = fail_fast("train.py", "experiment=wan_tiny", f"callbacks.sample_grid.prompt_file={tmp_path}/no.jsonl",
                              f"hydra.run.dir={tmp_path / 'run'}")
    assert_refused(proc, rf"callbacks.sample_grid.prompt_file={tmp_path}/no.jsonl does not exist", seconds=seconds)


def test_a_preview_prompt_file_needs_the_text_encoder_the_data_was_encoded_with(tmp_path):
    """Procedural text latents record no text encoder: the prompts could not be encoded as the data's were."""
    file = tmp_path / "previews.jsonl"
    file.write_text(json.dumps({"prompt": "a red fox", "seed": 3}) + "\n")
    proc, seconds = fail_fast("train.py", "experiment=wan_tiny", f"callbacks.sample_grid.prompt_file={file}",
                              f"hydra.run.dir={tmp_path / 'run'}")
    assert_refused(proc, r"callbacks.sample_grid.prompt_file=\S+: its prompts are encoded with the text encoder the "
                         r"data was prepared with, but the data records none", seconds=seconds)


# ---- the frame rate ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset, fps", [
    ("wan_tiny", 16), ("wan22_a14b_tiny", 16), ("wan_i2v_tiny", 16), ("wan22_ti2v_tiny", 24),
    ("hunyuan_video15_tiny", 24), ("hunyuan_video15_i2v_tiny", 24), ("skyreels_v2_tiny", 24), ("ltx_video_tiny", 25),
    ("cogvideox15_tiny", 16), ("flux_tiny", None), ("qwenimage_tiny", None), ("dit_video", 16), ("dit_digits", None),
])
def test_each_model_kind_has_its_own_frame_rate_and_fps_overrides_it(preset, fps):
    from ringdit.commands.cli import model_preset
    from ringdit.sampling import frame_rate

    config = model_preset(preset)
    assert frame_rate("fps", None, config) == fps
    assert frame_rate("fps", 30, config) == 30


def test_skyreels_embeds_the_rate_it_writes_at():
    """SkyReels-V2's fps embedding (an index: 0 for 16 fps) and its written rate are one fact."""
    from ringdit.models.diffusers.skyreels import FPS, FPS_INDEX, SKYREELS_V2

    assert SKYREELS_V2.fps == FPS == 24 and FPS_INDEX == 1


# ---- the preview's memory and time, before the run ---------------------------------------------------------------


def test_a_preview_that_cannot_fit_is_refused_before_training_and_its_advice_fits(tmp_path, caplog):
    """A million samples a class row in one forward would need far more memory than the machine has, where a training
    step fits: refused naming callbacks.sample_grid.batch_size and the micro-batch that fits; with it the run's
    settings pass, and the run says what a preview costs."""
    import re

    from ringdit.commands.cli import command_config
    from ringdit.spec import TrainSpec

    huge = ["experiment=wan_tiny", "callbacks.sample_grid.per_class=1000000", f"hydra.run.dir={tmp_path / 'run'}"]
    proc, seconds = fail_fast("train.py", *huge)
    assert_refused(proc, r"callbacks.sample_grid.batch_size=null: a preview forward of 20000000 rows x \d+ tokens "
                         r"needs about \d+\.\d GiB per rank beside the training state, but \d+\.\d GiB is available; "
                         r"set callbacks.sample_grid.batch_size=\d+", seconds=seconds)
    fits = re.search(r"set callbacks.sample_grid.batch_size=(\d+)", proc.stderr + proc.stdout).group(1)
    logger = logging.getLogger("ringdit.costs.previews")  # ringdit's loggers may not propagate to pytest's root handler
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO", logger="ringdit.costs.previews"):
            TrainSpec.from_config(command_config("train", [*huge, f"callbacks.sample_grid.batch_size={fits}"],
                                                 run_dir=tmp_path / "run"))
    finally:
        logger.removeHandler(caplog.handler)
    assert re.search(rf"previews: 10000000 samples every 100 steps, {fits} a forward \(x2: guidance\), 30 steps: "
                     r"about \d+\.\d GiB per rank, ~\d+ s each", caplog.text)


REAL_PRESETS = ["wan21_14b_lora", "wan21_14b_full", "wan21_1_3b_full", "wan21_1_3b_lora", "wan22_a14b_i2v_lora",
                "wan22_a14b_t2v_lora", "wan22_ti2v_5b_lora", "hunyuan_video15_i2v_lora", "hunyuan_video15_t2v_lora",
                "ltx_video_lora", "skyreels_v2_lora", "flux_dev_lora", "flux2_lora", "qwenimage_lora",
                "cogvideox15_lora"]


def test_every_real_preset_previews_a_handful_of_samples_one_a_forward():
    """2 prompts x 1 sample every 250 steps, one sample a forward, at the recipe's own sampling settings and the
    model's frame rate."""
    from ringdit.commands.cli import command_config

    for name in REAL_PRESETS:
        grid = command_config("train", [f"experiment={name}"], run_dir="unused").callbacks.sample_grid
        assert (grid.every_n_steps, grid.max_classes, grid.per_class, grid.batch_size) == (250, 2, 1, 1), name
        assert grid.steps is None and grid.cfg_scale is None and grid.fps is None, name


def test_the_planner_counts_the_previews_and_its_advice_fits(capsys):
    """``python -m ringdit.plan`` ends with the previews' memory on the recommended layout: train.py's default grid
    (80 samples in one guided forward) does not fit Wan 14B at 480x832x81 on 80 GB GPUs; the micro-batch it names
    does."""
    import re

    from ringdit.plan import main

    plan = ["model=wan_14b", "data.frames=81", "data.size=[480,832]", "gpus=8", "lora.rank=32"]
    assert main(plan) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    found = re.fullmatch(r"Previews \(callbacks.sample_grid: 80 samples, 80 a forward x2 \(guidance\), 50 steps\): "
                         r"about \d+\.\d GiB per rank with the training state, does not fit: "
                         r"\+callbacks.sample_grid.batch_size=(\d+) does; ~\d+ s each on this layout", line)
    assert found, line
    assert main([*plan, f"+callbacks.sample_grid.batch_size={found.group(1)}"]) == 0
    assert re.search(r"fits; ~\d+ s each", capsys.readouterr().out.strip().splitlines()[-1])


def test_a_preview_prompt_file_previews_its_prompts_at_the_models_frame_rate(tmp_path):
    """Captioned moving digits (its data record the text encoder): two prompt lines, one with its own seed, steps and
    negative prompt, two samples each drawn one a forward: a row per line, an MP4 per sample at Wan's 16 fps, the
    same samples as at one forward (the grid GIF's frames are equal)."""
    import av
    import imageio.v3 as iio

    from tests.helpers import run

    file = tmp_path / "previews.jsonl"
    file.write_text(json.dumps({"prompt": "a 3 moving left"}) + "\n" +
                    json.dumps({"prompt": "a 7 moving up", "seed": 5, "steps": 3, "negative_prompt": "a 1"}) + "\n")
    tiny = ["experiment=captioned_moving_digits", "data.num_videos=32", "model.config.num_layers=1",
            "model.config.ffn_dim=32", "trainer.max_steps=1", "logger=none", "scheduler=constant",
            "callbacks.sample_grid.steps=2", "callbacks.sample_grid.per_class=2", f"callbacks.sample_grid.prompt_file={file}"]
    grids = []
    for batch in (1, "null"):
        out = tmp_path / f"batch_{batch}"
        run("train.py", out, *tiny, f"callbacks.sample_grid.batch_size={batch}", env={"HF_HUB_OFFLINE": "1"})
        videos = sorted((out / "samples" / "step_0000001").glob("*.mp4"))
        assert len(videos) == 4
        with av.open(str(videos[0])) as container:
            assert container.streams.video[0].average_rate == 16
        grids.append(iio.imread(out / "samples" / "step_0000001.gif"))
    # fp32: one forward of 4 rows or of 2 sums in another order (the GEMM kernel the batch size picks): at most one
    # uint8 level (infer.py's documented bound); a wrong seed, prompt or negative would change whole glyphs
    assert abs(grids[0].astype(int) - grids[1]).max() <= 1


@pytest.fixture(scope="module")
def ltx_checkpoint(tmp_path_factory):
    """A tiny LTX-Video trained one step (synthetic latents: no VAE here, so no preview is drawn)."""
    from tests.helpers import run

    out = tmp_path_factory.mktemp("ltx")
    run("train.py", out, "experiment=ltx_video_tiny", "data.num_samples=8", "data.batch_size=2", "trainer.max_steps=1",
        "logger=none", "callbacks.sample_grid.per_class=1", "callbacks.sample_grid.steps=1")
    return out / "checkpoints" / "last.ckpt"


def test_infer_writes_at_the_models_frame_rate_unless_fps_says_otherwise(ltx_checkpoint, tmp_path):
    """infer.py's (and the server's: the same InferSpec) fps: LTX-Video's 25 by default, fps=30 when given; a bad
    value is refused in one line naming fps."""
    from ringdit.commands.cli import command_config
    from ringdit.spec import InferSpec

    def fps(*overrides):
        return InferSpec.from_config(command_config("infer", [f"ckpt_path={ltx_checkpoint}", *overrides],
                                                    run_dir=tmp_path / "run")).output.fps

    assert fps() == 25 and fps("fps=30") == 30
    for value, shown in (("0", "0"), ("-1", "-1"), ("nan", "nan"), ("abc", "'abc'")):
        proc, seconds = fail_fast("infer.py", f"ckpt_path={ltx_checkpoint}", f"fps={value}",
                                  f"hydra.run.dir={tmp_path / value}")
        assert_refused(proc, rf"fps must be a positive integer, got {shown}; the frames per second videos are "
                             rf"written at; null: the model's own", seconds=seconds)
