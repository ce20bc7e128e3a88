"""Settings and files that must be refused in one line, exit code 2, before any rank is spawned (reliability round
3): LoRA settings that would train nothing or something else, prompts given to a class-conditional model, sharded
(FSDP) checkpoint folders that are torn, and DCP folders whose pickles would run code."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from ringdit.checkpoints.weights import read_weights
from ringdit.common.errors import CheckpointError
from tests.helpers import TINY, assert_refused, fail_fast

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize(("overrides", "message"), [
    (["lora.rank=-4"], "lora.rank must be an integer >= 0, got -4; 0 disables LoRA"),
    (["lora.rank=2.5"], "lora.rank must be an integer >= 0, got 2.5"),
    (["lora.rank=4", "lora.alpha=0"], "lora.alpha must be > 0 (the adapters' output is scaled by alpha / rank, so 0 "
                                      "learns nothing)"),
    (["lora.rank=4", "lora.alpha=-8"], "lora.alpha must be > 0"),
    (["lora.rank=4", "lora.alpha=nan"], "lora.alpha must be a finite number, got nan"),
    (["lora.rank=4", "lora.dropout=1"], "lora.dropout=1 drops every input of the adapters"),
    (["lora.rank=4", "lora.dropout=-0.1"], "lora.dropout must be in [0, 1], got -0.1"),
    (["lora.rank=4", "lora.targets=[]"], "lora.targets must be null (the default projections) or module-name"),
], ids=["negative-rank", "fractional-rank", "zero-alpha", "negative-alpha", "nan-alpha", "dropout-1",
        "negative-dropout", "no-targets"])
def test_lora_settings_that_train_nothing_or_everything_are_refused(overrides, message, tmp_path):
    proc, _ = fail_fast("train.py", *TINY, *overrides, f"hydra.run.dir={tmp_path}")
    assert_refused(proc, text=message)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("setting", ["prompts=[a cat,a dog]", "negative_prompt=blurry", "text_embeds=p.safetensors",
                                     "negative_text_embeds=n.safetensors", "text_encoder=/models/t5"])
def test_text_settings_on_a_class_conditional_model_are_refused(setting, tiny_checkpoint, tmp_path):
    proc, _ = fail_fast("infer.py", f"ckpt_path={tiny_checkpoint}", setting, f"hydra.run.dir={tmp_path}")
    assert_refused(proc, text=f"{setting.split('=')[0]}=")
    assert "is a class-conditional model, which takes no text; choose classes with labels=[...]" in proc.stderr
    assert not (tmp_path / "samples.npz").exists()


def test_guidance_on_a_dit_is_refused(tiny_checkpoint, tmp_path):
    """``guidance=`` feeds a guidance-distilled model's embedding; a DiT has none, so it would be silently ignored."""
    proc, seconds = fail_fast("infer.py", f"ckpt_path={tiny_checkpoint}", "model.guidance=3.5",
                              f"hydra.run.dir={tmp_path}")
    assert_refused(proc, text="model.guidance=3.5 is the guidance embedding's value of a guidance-distilled model",
                   seconds=seconds)
    assert not (tmp_path / "samples.npz").exists()


# ---- sharded checkpoint folders ------------------------------------------------------------------------------------


def sharded_copy(single_file: Path, folder: Path, extra: dict | None = None) -> Path:
    """The layout of an FSDP run's checkpoint (``torch.distributed.checkpoint`` shards + Lightning's ``meta.pt``),
    written on this process from a single-file checkpoint; ``extra``: more (non-tensor) entries for the shards."""
    import torch.distributed.checkpoint as dcp

    checkpoint = torch.load(single_file, weights_only=True)
    dcp.save({"state_dict": checkpoint.pop("state_dict"), **(extra or {})}, checkpoint_id=folder, no_dist=True)
    checkpoint.pop("optimizer_states")
    torch.save(checkpoint, folder / "meta.pt")
    return folder


@pytest.fixture
def sharded(tiny_checkpoint, tmp_path) -> Path:
    folder = sharded_copy(tiny_checkpoint, tmp_path / "last.ckpt")
    assert read_weights(folder)[0].keys() == read_weights(tiny_checkpoint)[0].keys()  # a faithful copy
    return folder


def tear_shard(folder: Path) -> str:
    shard = next(folder.glob("*.distcp"))
    shard.unlink()
    return shard.name


@pytest.mark.parametrize("command", ["train-resume", "train-init_from", "infer"])
def test_a_torn_sharded_checkpoint_is_refused_before_spawning(command, sharded, tmp_path):
    name = tear_shard(sharded)
    args = {"train-resume": ("train.py", *TINY, f"ckpt_path={sharded}"),
            "train-init_from": ("train.py", *TINY, f"init_from={sharded}"),
            "infer": ("infer.py", f"ckpt_path={sharded}")}[command]
    proc, _ = fail_fast(*args, f"hydra.run.dir={tmp_path / 'run'}")
    assert_refused(proc, text=f"{sharded} is an incomplete sharded checkpoint: {name} is missing (of the 1 shard files its "
                         f".metadata lists); copy the whole folder again, or use an earlier checkpoint")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_torn_sharded_checkpoints_are_named_whatever_part_is_missing(sharded, tmp_path):
    shard = next(sharded.glob("*.distcp"))
    truncated = shutil.copytree(sharded, tmp_path / "truncated")
    size = (truncated / shard.name).stat().st_size
    os.truncate(truncated / shard.name, size // 2)
    with pytest.raises(CheckpointError, match=rf"{shard.name} is truncated \({size // 2} of {size} bytes\)"):
        read_weights(truncated)
    for index in (".metadata", "meta.pt"):
        torn = shutil.copytree(sharded, tmp_path / f"no{index}")
        (torn / index).unlink()
        with pytest.raises(CheckpointError, match=rf"incomplete sharded checkpoint: {index} missing"):
            read_weights(torn)
    garbage = shutil.copytree(sharded, tmp_path / "garbage")
    (garbage / ".metadata").write_bytes(b"not a pickle at all")
    with pytest.raises(CheckpointError, match=r"its .metadata is not readable"):
        read_weights(garbage)


class _RunsCode:
    """Unpickling this calls ``Path.touch`` on the sentinel: what a crafted checkpoint could do with any callable."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return Path.touch, (self.sentinel,)


def test_dcp_pickles_cannot_run_code(tiny_checkpoint, sharded, tmp_path):
    """DCP unpickles its ``.metadata`` with plain pickle and non-tensor entries with weights_only=False: ringdit
    reads both through allow-lists, so a crafted folder is refused and the payload never runs."""
    sentinel = tmp_path / "ran"
    evil_index = shutil.copytree(sharded, tmp_path / "evil_index")
    (evil_index / ".metadata").write_bytes(pickle.dumps(_RunsCode(sentinel)))
    with pytest.raises(CheckpointError, match=r"refusing to read .*\.metadata: [\w.]+ is not part of a "
                                              r"checkpoint's metadata"):
        read_weights(evil_index)
    evil_entry = sharded_copy(tiny_checkpoint, tmp_path / "evil_entry", extra={"extra": _RunsCode(sentinel)})
    sentinel.unlink(missing_ok=True)  # dcp.save pickled the payload without running it; make sure
    with pytest.raises(CheckpointError, match=r"refusing to load the checkpoint entry 'extra': it holds Python "
                                              r"objects that would run code"):
        from ringdit.checkpoints.loading import read_sharded_checkpoint

        read_sharded_checkpoint(evil_entry, keys=None)
    assert not sentinel.exists()
    proc, _ = fail_fast("infer.py", f"ckpt_path={evil_index}", f"hydra.run.dir={tmp_path / 'run'}")
    assert_refused(proc, text="is not part of a checkpoint's metadata")
    assert not sentinel.exists()


# ---- one run per run folder ------------------------------------------------------------------------------------------


def test_a_second_run_in_the_same_folder_is_refused_and_a_resume_appends(tmp_path):
    """The first run's records (its loss curve, checkpoints) survive a second launch into its folder; resuming
    from its own checkpoint continues its metrics.csv."""
    from tests.helpers import logged_losses, run

    run("train.py", tmp_path, *TINY, "trainer.max_steps=2")
    metrics = (tmp_path / "csv" / "metrics.csv").read_text()
    proc, _ = fail_fast("train.py", *TINY, "trainer.max_steps=2", f"hydra.run.dir={tmp_path}")
    assert_refused(proc, text=f"hydra.run.dir={tmp_path} already holds a run of train.py (.train-run.json, checkpoints, "
                         f"csv/metrics.csv, samples, started ")
    assert f"or resume it with ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}" in proc.stderr
    assert (tmp_path / "csv" / "metrics.csv").read_text() == metrics
    run("train.py", tmp_path, *TINY, "trainer.max_steps=4", f"ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}")
    assert (tmp_path / "csv" / "metrics.csv").read_text().startswith(metrics.rstrip("\n").split("\n")[0])
    assert sorted(logged_losses(tmp_path)) == [0, 1, 2, 3]  # steps 0-1 of the first run, 2-3 of the resumed one


def test_a_second_sampling_run_in_the_same_folder_is_refused(tiny_checkpoint, tmp_path):
    from tests.helpers import run

    sampling = [f"ckpt_path={tiny_checkpoint}", "num_samples=2", "diffusion.sampling.steps=2"]
    run("infer.py", tmp_path, *sampling)
    samples = (tmp_path / "samples.npz").read_bytes()
    proc, _ = fail_fast("infer.py", *sampling, f"hydra.run.dir={tmp_path}")
    assert_refused(proc, text=f"hydra.run.dir={tmp_path} already holds a run of infer.py (.infer-run.json, samples.npz")
    assert (tmp_path / "samples.npz").read_bytes() == samples


def test_the_run_folder_is_claimed_once_every_check_passed(tmp_path, monkeypatch):
    from ringdit.common.errors import ConfigError
    from ringdit.commands.run_folder import claim_run_folder, marker

    proc, _ = fail_fast("train.py", *TINY, "lora.rank=-4", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2 and not marker(tmp_path, "train").exists()  # a corrected launch may use the folder
    claim_run_folder(tmp_path, "train")
    with pytest.raises(ConfigError, match=r"already holds a run of train.py \(.train-run.json, started .* by pid"):
        claim_run_folder(tmp_path, "train")  # e.g. a launch while the first is still starting
    claim_run_folder(tmp_path, "infer")  # sampling into a training run's folder writes other files
    claim_run_folder(tmp_path, "train", resumes=str(tmp_path / "checkpoints" / "last.ckpt"))
    with pytest.raises(ConfigError, match="already holds a run of train.py"):
        claim_run_folder(tmp_path, "train", resumes=str(tmp_path.parent / "other" / "last.ckpt"))
    monkeypatch.setenv("LOCAL_RANK", "1")  # a rank Lightning's launcher spawned: the launcher claimed the folder
    claim_run_folder(tmp_path, "train")


# ---- a size beyond the position table: the size suggested is one the same check takes ---------------------------


@pytest.mark.parametrize("family, preset, data, given, fix", [
    # CogVideoX's RoPE grid (sample_height / sample_width 16 -> 8 x 8 tokens) bounds height and width both
    ("cogvideox15", "cogvideox15_tiny", {"image_size": [2, 8, 8], "frame_pad": 2}, ([256, 256], None),
     "size=[128, 128]"),
    ("cogvideox15", "cogvideox15_tiny", {"image_size": [2, 8, 8], "frame_pad": 2}, ([256, 64], None),
     "size=[128, 64]"),
    # Wan's RoPE table (16 positions per axis here): the frames and the size at once
    ("wan", "wan_tiny", {"image_size": [3, 8, 8]}, ([512, 512], 65), "size=[256, 256] frames=61"),
])
def test_a_size_beyond_the_position_table_is_refused_with_one_that_is_taken(family, preset, data, given, fix):
    from ringdit.common.errors import ConfigError
    from ringdit.models.diffusers import DiffusersTransformer
    from ringdit.sampling import SampleSizes
    from tests.helpers import architecture

    config = architecture(preset) | ({"rope_max_seq_len": 16} if family == "wan" else {})
    with torch.device("meta"):
        model = DiffusersTransformer(family, config=config)
    vae = {"spatial_compression": 8, "temporal_compression": 4, "frame_pad": data.get("frame_pad", 0)}
    sizes = SampleSizes.of({"image_size": data["image_size"], "vae": vae}, model.patch_shape, model.max_grid)
    with pytest.raises(ConfigError, match=r"position embedding covers") as refused:
        sizes.shape(*given)
    message = str(refused.value)
    assert message.endswith(f"the most it samples there is {fix}"), message
    import re

    advice = re.fullmatch(r"size=\[(\d+), (\d+)\](?: frames=(\d+))?", fix)
    size, frames = [int(advice[1]), int(advice[2])], int(advice[3]) if advice[3] else given[1]
    sizes.shape(size, frames)  # the advice is taken


# ---- a pipeline folder's scheduler_config.json: the file, the key, the value and the fix ------------------------



@pytest.mark.parametrize("key, value, message", [
    ("flow_shift", "abc", 'flow_shift="abc" must be a finite number (UniPCMultistepScheduler\'s default: 1.0)'),
    ("flow_shift", -3, "flow_shift=-3 must be above 0"),
    ("num_train_timesteps", 10**12, "num_train_timesteps=1000000000000 must be at least 1 and at most 100000"),
    ("solver_order", "two", 'solver_order="two" must be an integer'),
    ("use_flow_sigmas", "yes", 'use_flow_sigmas="yes" must be true or false'),  # was taken: a non-empty str is true
])
def test_a_bad_scheduler_config_value_is_named_with_its_file_and_key(key, value, message, wan_pipeline_folder,
                                                                    tmp_path):
    """Was "could not convert string to float: 'abc'" (no file, no key), a refusal of FlowMatching's shift, a
    scheduler that failed to build, or a string taken as true. Following the advice (removing the key) samples."""
    import json

    folder = tmp_path / "Wan-tiny"
    shutil.copytree(wan_pipeline_folder, folder)
    file = folder / "scheduler" / "scheduler_config.json"
    config = json.loads(file.read_text())
    file.write_text(json.dumps({**config, key: value}))
    sample = [f"ckpt_path={folder}", 'prompts=["a red fox"]', "size=[16,16]", "frames=5", "num_samples=1",
              "diffusion.sampling.steps=1"]
    proc, seconds = fail_fast("infer.py", *sample, f"hydra.run.dir={tmp_path / 'refused'}")
    assert_refused(proc, text=f"{file}: {message}", seconds=seconds)
    assert "remove the key for the scheduler's default" in proc.stderr
    file.write_text(json.dumps({k: v for k, v in config.items() if k != key}))
    if key == "flow_shift" and value == "abc":  # one of them sampled end to end; the others pass the same check
        from tests.helpers import run

        run("infer.py", tmp_path / "fixed", *sample)
    else:
        from ringdit.diffusion.schedulers import check_scheduler_file

        check_scheduler_file(json.loads(file.read_text()), file)


@pytest.mark.parametrize("part, key, value, message", [
    ("transformer", "num_attention_heads", "two", 'num_attention_heads="two" must be an integer '
                                                  "(WanTransformer3DModel's default: 40)"),
    ("transformer", "patch_size", "abc", 'patch_size="abc" must be a list of integers'),
    ("vae", "z_dim", "abc", 'z_dim="abc" must be an integer (AutoencoderKLWan\'s default: 16)'),
    ("text_encoder", "d_model", "abc", "d_model='abc' must be a positive integer (the text encoder's width)"),
])
def test_a_bad_config_json_value_is_named_with_its_file_and_key(part, key, value, message, wan_pipeline_folder,
                                                                tmp_path):
    """Was "not all arguments converted during string formatting", "empty(): argument 'size' failed to unpack" or
    "invalid literal for int()": no file, no key. Writing back the saved value (the advice) passes the checks."""
    import json

    folder = tmp_path / "Wan-tiny"
    shutil.copytree(wan_pipeline_folder, folder)
    file = folder / part / "config.json"
    saved = file.read_text()
    file.write_text(json.dumps({**json.loads(saved), key: value}))
    sample = [f"ckpt_path={folder}", 'prompts=["a red fox"]', "size=[16,16]", "frames=5", "num_samples=1",
              "diffusion.sampling.steps=1"]
    proc, seconds = fail_fast("infer.py", *sample, f"hydra.run.dir={tmp_path / 'refused'}")
    assert_refused(proc, text=f"{file}: {message}", seconds=seconds)
    file.write_text(saved)
    from ringdit.spec.pipeline_folder import pipeline_checkpoint

    assert pipeline_checkpoint(str(folder))["model"]  # the folder's settings are read and checked again


@pytest.mark.parametrize("change, message", [
    ("boundary_ratio", "model_index.json: boundary_ratio='abc' must be a number in (0, 1)"),  # was model.boundary_ratio
    ("missing", "is a folder that is neither a sharded checkpoint (no .metadata) nor a diffusers pipeline folder (no "
                "model_index.json)"),  # was "does not exist (it is a folder)"
])
def test_a_bad_model_index_is_named(change, message, wan_pipeline_folder, tmp_path):
    import json

    folder = tmp_path / "Wan-tiny"
    shutil.copytree(wan_pipeline_folder, folder)
    index = folder / "model_index.json"
    saved = index.read_text()
    if change == "missing":
        index.unlink()
    else:
        index.write_text(json.dumps({**json.loads(saved), change: "abc"}))
    proc, seconds = fail_fast("infer.py", f"ckpt_path={folder}", 'prompts=["a red fox"]', "num_samples=1",
                              f"hydra.run.dir={tmp_path / 'refused'}")
    assert_refused(proc, text=message, seconds=seconds)
    index.write_text(saved)  # the advice: the model_index.json save_pretrained wrote
    from ringdit.spec.pipeline_folder import pipeline_checkpoint

    assert pipeline_checkpoint(str(folder))["model"]
