"""Files are data: configs carried by weights files cannot run code, and every file-borne setting that is wrong
(weights-only resume, changed optimizer, finished run, broken data, unwritable export) fails before any rank is
spawned, in one line with exit code 2. Files ringdit writes respect the umask; two runs never share a folder."""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from safetensors.torch import save_file

from ringdit.checkpoints.loading import safe_torch_load
from ringdit.checkpoints.safetensors_export import export_safetensors
from ringdit.checkpoints.weights import read_weights
from ringdit.commands.cli import register_resolvers
from ringdit.common.errors import CheckpointError, ConfigError
from ringdit.export import main as export_main
from ringdit.training.resume import check_resume
from ringdit.common.safe_config import ALLOWED_TARGETS, allow_target
from ringdit.training.checkpoint_io import AtomicCheckpointIO
from tests.distributed import run_commands_side_by_side
from tests.helpers import CONF, TINY, fail_fast, logged_losses, run, write_classes, write_latents

PRECIOUS = "precious data\n"


@pytest.fixture(scope="module")
def sentinels(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("sentinels")
    return {"victim": folder / "victim.txt", "created": folder / "created.txt"}


def payloads(sentinels) -> dict[str, dict]:
    """Configs that would empty ``victim`` (open(..., "w")) or create ``created`` (numpy.savetxt) if instantiated."""
    sentinels["victim"].write_text(PRECIOUS)
    return {"open": {"_target_": "builtins.open", "file": str(sentinels["victim"]), "mode": "w"},
            "savetxt": {"_target_": "numpy.savetxt", "fname": str(sentinels["created"]), "X": [[1.0]]}}


def assert_untouched(sentinels) -> None:
    assert sentinels["victim"].read_text() == PRECIOUS
    assert not sentinels["created"].exists()


def craft_ckpt(tiny: Path, path: Path, edit) -> Path:
    checkpoint = torch.load(tiny, weights_only=True)
    edit(checkpoint["hyper_parameters"])
    torch.save(checkpoint, path)
    return path


def craft_safetensors(tiny: Path, path: Path, edit, raw: dict | None = None) -> Path:
    state, info = read_weights(tiny)
    info = copy.deepcopy(info)
    edit(info)
    metadata = {key: json.dumps(value) for key, value in info.items()} | (raw or {}) | {"format": "ringdit"}
    save_file({k: v.contiguous() for k, v in state.items()}, path, metadata=metadata)
    return path


def _set(key: str, sub: str | None, value):
    def edit(configs):
        if sub is None:
            configs[key] = value
        else:
            configs[key][sub] = value
    return edit


# (edit of the file's configs, the key path the refusal names); P = the payloads, filled in per test
CRAFTED = {
    "model target": (lambda p: _set("model", "_target_", "builtins.open"), r"model\._target_ names 'builtins.open'"),
    "objective target": (lambda p: _set("objective", None, p["open"]), r"objective\._target_ names 'builtins.open'"),
    "nested": (lambda p: _set("model", "extra", {"deeper": p["savetxt"]}),
               r"model\.extra\.deeper\._target_ names 'numpy.savetxt'"),
    "in a list": (lambda p: _set("model", "extra", [1, p["savetxt"]]), r"model\.extra\[1\]\._target_"),
    "data": (lambda p: _set("data", "extra", p["open"]), r"data\.extra\._target_"),
    "sampling": (lambda p: _set("sampling", "sampler", p["savetxt"]), r"sampling\.sampler\._target_"),
    "non-string target": (lambda p: _set("objective", "_target_", ["builtins.open"]), r"objective\._target_ names \["),
    "partial": (lambda p: _set("objective", "_partial_", True), r"objective\._partial_ is a Hydra instantiation key"),
    "args": (lambda p: _set("model", "_args_", [p["open"]]), r"model\._args_ is a Hydra instantiation key"),
    "interpolation": (lambda p: _set("model", "hidden_size", "${oc.env:HOME}"),
                      r"model\.hidden_size holds an interpolation '\$\{oc.env:HOME\}'"),
    "another hyper-parameter": (lambda p: _set("init_from", None, {"x": p["open"]}), r"init_from\.x\._target_"),
}


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
@pytest.mark.parametrize("case", list(CRAFTED))
def test_file_configs_cannot_name_code(case, fmt, tiny_checkpoint, sentinels, tmp_path):
    edit, where = CRAFTED[case]
    if fmt == "safetensors" and case == "another hyper-parameter":
        pytest.skip("exports carry only model, data, objective and sampling")
    edit = edit(payloads(sentinels))
    craft = craft_ckpt if fmt == "ckpt" else craft_safetensors
    path = craft(tiny_checkpoint, tmp_path / f"evil.{fmt}", edit)
    with pytest.raises(CheckpointError, match=rf"^refusing .*evil\.{fmt}: its config {where}") as error:
        read_weights(path)
    assert "\n" not in str(error.value)
    assert_untouched(sentinels)


def test_the_allow_list_is_a_registry(tiny_checkpoint, tmp_path):
    read_weights(tiny_checkpoint)  # what training writes is allowed
    assert {"ringdit.models.DiT", "ringdit.diffusion.FlowMatching", "ringdit.diffusion.DDPM"} <= ALLOWED_TARGETS
    path = craft_ckpt(tiny_checkpoint, tmp_path / "custom.ckpt", _set("objective", "_target_", "my.Objective"))
    with pytest.raises(CheckpointError, match="names 'my.Objective', which ringdit does not build from a file"):
        read_weights(path)
    allow_target("my.Objective")
    try:
        assert read_weights(path)[1]["objective"]["_target_"] == "my.Objective"
    finally:
        ALLOWED_TARGETS.discard("my.Objective")
    with pytest.raises(ValueError, match="allow_target takes a dotted import path"):
        allow_target("${oc.env:X}")


@pytest.fixture(scope="module")
def evil_files(tmp_path_factory, tiny_checkpoint, sentinels) -> dict[str, Path]:
    """A checkpoint and an export whose objective would empty the victim and whose model config would create a
    file (nested in a list): both run on today's infer.py if the configs are instantiated."""
    folder = tmp_path_factory.mktemp("evil")
    p = payloads(sentinels)

    def edit(configs):
        configs["objective"] = p["open"]
        configs["model"]["extra"] = {"inner": [p["savetxt"]]}

    return {"ckpt": craft_ckpt(tiny_checkpoint, folder / "evil.ckpt", edit),
            "safetensors": craft_safetensors(tiny_checkpoint, folder / "evil.safetensors", edit)}


@pytest.mark.parametrize(
    ("command", "fmt"),
    [(["infer.py", "ckpt_path={}"], "ckpt"), (["infer.py", "ckpt_path={}"], "safetensors"),
     (["train.py", "init_from={}", *TINY], "safetensors"), (["train.py", "ckpt_path={}", *TINY], "ckpt"),
     (["-m", "ringdit.export", "ckpt_path={}", "out={out}"], "ckpt")],
    ids=["infer-ckpt", "infer-safetensors", "train-init_from", "train-ckpt_path", "export"],
)
def test_crafted_files_are_refused_by_every_entry_point(command, fmt, evil_files, sentinels, tmp_path):
    payloads(sentinels)
    out = tmp_path / "exported.safetensors"
    args = [arg.format(evil_files[fmt], out=out) for arg in command]
    overrides = [] if command[0] == "-m" else [f"hydra.run.dir={tmp_path / 'run'}"]
    proc, _ = fail_fast(" ".join(args[:2]), *args[2:]) if command[0] == "-m" else fail_fast(*args, *overrides)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"refusing {evil_files[fmt]}: its config model.extra.inner[0]._target_ names 'numpy.savetxt'" in errors[0]
    assert_untouched(sentinels)
    assert not out.exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_lightning_load_from_checkpoint_is_guarded_too(evil_files, sentinels, tmp_path):
    """``DiffusionModule.load_from_checkpoint`` builds the module from the file's hyper-parameters: checked first."""
    from ringdit.training import DiffusionModule

    payloads(sentinels)
    with pytest.raises(CheckpointError, match=r"refusing .*evil.ckpt: its config model.extra.inner\[0\]._target_"):
        DiffusionModule.load_from_checkpoint(evil_files["ckpt"])
    hparams = tmp_path / "hparams.yaml"
    hparams.write_text("objective:\n  _target_: builtins.open\n  file: x\n  mode: w\n")
    with pytest.raises(CheckpointError, match=r"refusing .*hparams.yaml: its config objective._target_"):
        DiffusionModule.load_from_checkpoint(_clean_copy(evil_files["ckpt"], tmp_path), hparams_file=hparams)
    assert_untouched(sentinels)


def _clean_copy(evil: Path, tmp_path: Path) -> Path:
    checkpoint = torch.load(evil, weights_only=True)
    checkpoint["hyper_parameters"]["model"].pop("extra")
    checkpoint["hyper_parameters"]["objective"] = {"_target_": "ringdit.diffusion.FlowMatching"}
    torch.save(checkpoint, tmp_path / "clean.ckpt")
    return tmp_path / "clean.ckpt"


def test_invalid_json_metadata_names_the_file_and_key(tiny_checkpoint, tmp_path):
    path = craft_safetensors(tiny_checkpoint, tmp_path / "w.safetensors", lambda info: None, raw={"model": "{oops"})
    with pytest.raises(CheckpointError, match=r"w.safetensors: its metadata entry 'model' is not valid JSON"):
        read_weights(path)


# ---- files ringdit writes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_respect_the_umask(umask, mode, tiny_checkpoint, tmp_path):
    previous = os.umask(umask)
    try:
        AtomicCheckpointIO().save_checkpoint({"step": 1}, tmp_path / "last.ckpt")
        export_safetensors(tiny_checkpoint, tmp_path / "w.safetensors")
    finally:
        os.umask(previous)
    assert (tmp_path / "last.ckpt").stat().st_mode & 0o777 == mode
    assert (tmp_path / "w.safetensors").stat().st_mode & 0o777 == mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "w.safetensors"]  # no temporary files


@pytest.mark.parametrize(
    ("out", "message"),
    [("folder", r"out=.*folder is a folder; give the file to write"),
     ("w.bin", r"out=.*w.bin must end in .safetensors"),
     ("CKPT", r"out=.*last.ckpt is the checkpoint itself: exporting would replace it"),
     ("a_file/w.safetensors", r"cannot write out=.*a_file/w.safetensors \(.*\); choose a writable file path")],
)
def test_export_to_a_bad_destination(out, message, tiny_checkpoint, tmp_path, capsys):
    (tmp_path / "folder").mkdir()
    (tmp_path / "a_file").write_text("a file, not a folder")
    before = tiny_checkpoint.read_bytes()
    out = tiny_checkpoint if out == "CKPT" else tmp_path / out
    assert export_main([f"ckpt_path={tiny_checkpoint}", f"out={out}"]) == 2
    assert tiny_checkpoint.read_bytes() == before
    err = capsys.readouterr().err
    # the one-line error, then the HYDRA_FULL_ERROR hint every command prints
    assert len(err.strip().splitlines()) == 2 and re.search(message, err.splitlines()[0]), err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a_file", "folder"]  # no temporary file left


# ---- resuming ---------------------------------------------------------------------------------------------------------


def adamw():
    return lambda params: torch.optim.AdamW(params, lr=1e-3)


def test_resume_checks(tiny_checkpoint, tmp_path):
    # weights only: an export, a bare state dict, a checkpoint saved without optimizer state
    export = export_safetensors(tiny_checkpoint, tmp_path / "w.safetensors")
    bare = tmp_path / "w.pt"
    torch.save(read_weights(tiny_checkpoint)[0], bare)
    no_optimizer = tmp_path / "no_opt.ckpt"
    torch.save({k: v for k, v in safe_torch_load(tiny_checkpoint).items() if k != "optimizer_states"}, no_optimizer)
    for path in (export, bare, no_optimizer):
        with pytest.raises(ConfigError, match=rf"ckpt_path={path} holds weights only.*ckpt_path resumes a training "
                                              rf"checkpoint .*use init_from={path}$"):
            check_resume(str(path), max_steps=10, optimizer=adamw(), optimizer_name="torch.optim.AdamW")
    # resume_optimizer=false accepts a checkpoint without optimizer state
    check_resume(str(no_optimizer), max_steps=10, optimizer=adamw(), optimizer_name="x", resume_optimizer=False)
    # a finished run
    with pytest.raises(ConfigError, match=r"is at step 1 and trainer.max_steps=1: nothing is left to train; raise "
                                          r"trainer.max_steps above 1"):
        check_resume(str(tiny_checkpoint), max_steps=1, optimizer=adamw(), optimizer_name="torch.optim.AdamW")
    # another optimizer: SGD with or without momentum, Adam's state cannot load into it
    for sgd in (lambda params: torch.optim.SGD(params, lr=0.1), lambda params: torch.optim.SGD(params, 0.1, 0.9)):
        with pytest.raises(ConfigError, match=r"was trained with another optimizer than optimizer=torch.optim.SGD "
                                              r"\(their settings differ in amsgrad, betas.*resume_optimizer=false"):
            check_resume(str(tiny_checkpoint), max_steps=10, optimizer=sgd, optimizer_name="torch.optim.SGD")
    check_resume(str(tiny_checkpoint), max_steps=10, optimizer=adamw(), optimizer_name="torch.optim.AdamW")
    with pytest.raises(ConfigError, match=r"^resume_optimizer must be true or false, got 'maybe'$"):
        check_resume(str(tiny_checkpoint), max_steps=10, optimizer=adamw(), optimizer_name="x", resume_optimizer="maybe")


def test_changed_optimizer_fails_before_spawning(tiny_checkpoint, tmp_path):
    proc, seconds = fail_fast("train.py", *TINY, f"ckpt_path={tiny_checkpoint}", "optimizer=sgd", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "was trained with another optimizer than optimizer=torch.optim.SGD" in proc.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_resume_with_a_fresh_optimizer_trains_on(tiny_checkpoint, tmp_path):
    run("train.py", tmp_path, *TINY, f"ckpt_path={tiny_checkpoint}", "optimizer=sgd", "optimizer.lr=0.5",
        "resume_optimizer=false", "trainer.max_steps=2")
    before, after = safe_torch_load(tiny_checkpoint), safe_torch_load(tmp_path / "checkpoints" / "last.ckpt")
    assert after["global_step"] == 2 and sorted(logged_losses(tmp_path)) == [1]  # one more step, from step 1
    group = after["optimizer_states"][0]["param_groups"][0]
    assert "momentum" in group and group["lr"] == 0.5  # SGD, at its configured lr
    changed = [k for k, v in before["state_dict"].items() if not torch.equal(v, after["state_dict"][k])]
    assert any(k.startswith("model.") for k in changed) and any(k.startswith("ema.") for k in changed)
    assert int(after["state_dict"]["ema.n_averaged"]) == int(before["state_dict"]["ema.n_averaged"]) + 1


# ---- settings named right ---------------------------------------------------------------------------------------------


def prepare_error(script: str, tmp_path, *overrides: str) -> str:
    """The one-line error that train.py's / infer.py's checks raise for ``overrides``, found in this process (no
    subprocess, nothing spawned)."""
    module = __import__(script)
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(script, overrides=[*overrides, f"hydra.run.dir={tmp_path}"], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        with pytest.raises((ConfigError, InstantiationException)) as error:
            module.prepare(cfg)
    return str(error.value.__cause__ or error.value)


@pytest.mark.parametrize(
    ("script", "overrides", "message"),
    [("train", ["seed=-1"], "seed must be an integer from 0 to 2**32 - 1 = 4294967295, got -1"),
     ("train", ["seed=4294967296"], "seed must be an integer from 0 to 2**32 - 1 = 4294967295, got 4294967296"),
     ("train", ["seed=true"], "seed must be an integer from 0 to 2**32 - 1 = 4294967295, got True"),
     ("train", ["init_weights=foo"], "init_weights must be one of ema | model, got 'foo'"),
     ("train", ["data.seed=-3"], "data.seed must be an integer from 0 to 2**32 - 1 (it defaults to seed), got -3"),
     ("train", ["data=moving_digits", "model=dit_video", "data.seed=-3"], "data.seed must be an integer from 0"),
     ("infer", ["weights=foo"], "weights must be one of ema | model, got 'foo'"),
     ("infer", ["seed=-1"], "seed must be an integer from 0 to 2**32 - 1 = 4294967295, got -1")],
)
def test_settings_are_named(script, overrides, message, tiny_checkpoint, tmp_path):
    if script == "infer":
        overrides = [f"ckpt_path={tiny_checkpoint}", *overrides]
    assert prepare_error(script, tmp_path, *overrides).startswith(message)


def test_bad_seed_exits_2_in_one_line(tmp_path):
    proc, _ = fail_fast("train.py", "seed=-1", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2 and "Error: seed must be an integer from 0 to 2**32 - 1" in proc.stderr, \
        proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


# ---- run folders ------------------------------------------------------------------------------------------------------


def test_runs_started_in_the_same_second_get_their_own_folders(tmp_path):
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        dirs = {compose("train", return_hydra_config=True).hydra.run.dir for _ in range(3)}
    assert len(dirs) == 3  # the same second (or not): three folders
    logs = tmp_path / "logs"
    # two processes started at the same moment (forked from the fork server), each composing its own run folder
    for proc in run_commands_side_by_side("train.py", (*TINY, "trainer.max_steps=1", f"paths.log_dir={logs}"), 2,
                                          {"WANDB_MODE": "offline"}, timeout=240):
        assert proc.returncode == 0, proc.stderr[-2000:]
    runs = sorted((logs / "train" / "runs").iterdir())
    assert len(runs) == 2
    for folder in runs:
        assert sorted(logged_losses(folder)) == [0]


# ---- data -------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "npy"])
def test_nonfinite_latents_are_found_up_front(fmt, tmp_path, monkeypatch):
    from ringdit.data import LatentsDataModule
    from ringdit.data import latents as latents_module

    monkeypatch.setattr(latents_module, "CHUNK_BYTES", 3 * 4 * 8 * 8 * 8)  # 3 samples per chunk: stream in chunks
    latents = np.zeros((10, 4, 8, 8), np.float32)
    latents[7, 1, 2, 3], latents[9, 0, 0, 0] = np.nan, np.inf
    path = write_latents(tmp_path, latents, np.arange(10) % 2, fmt=fmt)
    with pytest.raises(ValueError, match=rf"data.path={path}: 2 of 10 latent samples hold NaN or Inf values, the "
                                         rf"first is sample 7; re-encode or drop them"):
        LatentsDataModule(path=str(path))


def test_an_image_that_breaks_when_decoded_is_skipped(tmp_path, caplog):
    import io

    from PIL import Image

    from ringdit.data import ImageFolderDataModule

    write_classes(tmp_path, {"a": 2, "b": 2})
    noise = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    jpeg = io.BytesIO()
    Image.fromarray(noise).save(jpeg, "JPEG")
    broken = tmp_path / "a" / "1b.jpg"  # sorts between a/1.png and b/...
    broken.write_bytes(jpeg.getvalue()[: len(jpeg.getvalue()) // 2])
    with Image.open(broken) as image:
        image.verify()  # the scan's check passes: only decoding finds it
    data = ImageFolderDataModule(root=str(tmp_path), image_size=8)
    assert not data.skipped and len(data.samples) == 5
    index = [path for path, _ in data.samples].index(str(broken))
    dataset = data.build_dataset()
    with caplog.at_level(logging.WARNING):
        x, label = dataset[index]
    expected_x, expected_label = dataset[index + 1]  # the next readable image takes its place
    assert torch.equal(x, expected_x) and label == expected_label
    assert f"could not decode {broken}" in caplog.text and "1 file(s) skipped while loading" in caplog.text
    again, _ = data.build_dataset()[index]  # another process (rank) makes the same replacement
    assert torch.equal(again, x)


def test_remote_code_in_a_text_encoder_folder_is_never_run(models, tmp_path):
    """A text encoder (and tokenizer) whose config.json names its own code with ``auto_map`` is refused in one line
    (transformers would import it, and on a terminal offer to run it): the folder's Python file is never imported.
    Each part alone: tests/test_hostile_inputs.py."""
    import shutil

    from ringdit.media.text import TextEncoder

    sentinel = tmp_path / "ran"
    pipeline = shutil.copytree(models["wan"], tmp_path / "wan")
    for folder, key, value in ((pipeline / "text_encoder", "auto_map", {"AutoConfig": "evil.EvilConfig",
                                                                        "AutoModel": "evil.EvilModel"}),
                               (pipeline / "tokenizer", "auto_map", {"AutoTokenizer": ["evil.EvilTokenizer", None]})):
        (folder / "evil.py").write_text(f"open({str(sentinel)!r}, 'w').write('ran')\n")
        config_file = folder / ("config.json" if folder.name == "text_encoder" else "tokenizer_config.json")
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        config_file.write_text(json.dumps({**config, key: value}))
    with pytest.raises(ConfigError, match=r"text_encoder=.*config.json names custom code \(auto_map: AutoConfig, "
                                          r"AutoModel\), which ringdit never runs"):
        TextEncoder(pipeline / "text_encoder")
    assert not sentinel.exists()
