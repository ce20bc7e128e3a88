"""The weights of the folders a run reads (``model.pretrained``, ``init_from`` diffusers folders, ``vae=``,
``text_encoder=``) are checked when the settings are: each safetensors file's header against its size, a sharded
index against its shards, and pickled (``.bin``) weights refused outright. Each mistake is one line naming the file
and the fix, exit code 2, before any rank is spawned or any model loaded."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ringdit.common.errors import ConfigError
from ringdit.models.diffusers.folders import check_weights_folder
from tests.helpers import TEXT_LEN, architecture, assert_refused, fail_fast, save_tiny_wan

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"
REFETCH = "re-download it, or re-save the model with save_pretrained"


def raw_safetensors(path: Path, header: dict, data: bytes, length: int | None = None) -> None:
    """A file laid out as safetensors is: 8-byte little-endian header length, the JSON header, the tensor bytes."""
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _not_json(path: Path) -> None:
    data = bytearray(path.read_bytes())
    length = struct.unpack("<Q", data[:8])[0]
    data[8:8 + length] = b"\xff{" + b"x" * (length - 2)
    path.write_bytes(bytes(data))


def _offsets_past_the_end(path: Path) -> None:  # a header announcing 4000 bytes of tensor data, 16 present
    raw_safetensors(path, {"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}, bytes(16))


def _header_past_the_end(path: Path) -> None:
    raw_safetensors(path, {}, b"", length=10**6)


def _broken_link(path: Path) -> None:  # a hub cache's snapshot whose blob was never (fully) downloaded
    path.unlink()
    path.symlink_to(path.parent / "blobs" / "0123abcd")


def _shape_against_bytes(path: Path) -> None:  # offsets fit the file, but 3 float32s are not 8 bytes
    raw_safetensors(path, {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8))


# (what breaks transformer/<WEIGHTS> of a healthy folder, the message's end after "<setting>=<value>: <file> ")
BROKEN_FILES = {
    "truncated": (_truncate, r"is truncated: its header describes a file of {size} bytes, it has {short} \(an "
                             r"interrupted download or save\?\)"),
    "empty": (lambda path: path.write_bytes(b""), r"is empty \(0 bytes\)"),
    "shorter than the length field": (lambda path: path.write_bytes(b"\x10\x00"),
                                      r"is truncated \(2 bytes: not even the 8-byte header length"),
    "header not JSON": (_not_json, r"is corrupt or not a safetensors file \(its header is not valid JSON: "),
    "header not an object": (lambda path: raw_safetensors(path, [1, 2], b""),
                             r"is corrupt \(its header is not a JSON object\)"),
    "no data_offsets": (lambda path: raw_safetensors(path, {"w": {"dtype": "F32", "shape": [1]}}, bytes(4)),
                        r"is corrupt \(tensor 'w' has no valid data_offsets in the header\)"),
    "offsets past the end": (_offsets_past_the_end, r"is truncated: its header describes a file of \d+ bytes, it has "),
    "header length past the end": (_header_past_the_end, r"is truncated or not a safetensors file \(its first 8 bytes "
                                                         r"announce a 1000000-byte header, the file has 10 bytes\)"),
    "bytes after the tensors": (lambda path: path.write_bytes(path.read_bytes() + b"garbage"),
                                r"is corrupt: it has 7 bytes after the end of the tensors its header describes "
                                r"\({size} bytes\)"),
    "shape against bytes": (_shape_against_bytes, r"is corrupt \("),
    "broken link": (_broken_link, r"is a broken link \(to .*/blobs/0123abcd, which is missing\)"),
    "git lfs pointer": (lambda path: path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\n"
                                                     "size 1\n"),
                        r"is a Git LFS pointer, not the weights; fetch them with `git lfs pull` in that repository"),
}


def _shards(folder: Path) -> list[str]:
    return sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))


def _no_weights(folder: Path) -> None:
    (folder / WEIGHTS).unlink()


def _missing_shard(folder: Path) -> None:
    (folder / _shards(folder)[-1]).unlink()


def _index_not_json(folder: Path) -> None:
    (folder / INDEX).write_text("{not json")


def _pickle_shard(folder: Path) -> None:
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"] = {key: "diffusion_pytorch_model-00001-of-00003.bin" for key in index["weight_map"]}
    (folder / INDEX).write_text(json.dumps(index))


def _shard_without_its_keys(folder: Path) -> None:
    index = json.loads((folder / INDEX).read_text())
    first, last = _shards(folder)[0], _shards(folder)[-1]
    index["weight_map"] = {key: first if name == last else name for key, name in index["weight_map"].items()}
    (folder / INDEX).write_text(json.dumps(index))


def _truncated_shard(folder: Path) -> None:
    _truncate(folder / _shards(folder)[1])


# (sharded?, what breaks the transformer folder, the message after "<setting>=<value>: ")
BROKEN_FOLDERS = {
    "no weights": (False, _no_weights,
                   rf"cannot load WanTransformer3DModel weights from {{folder}}: it has no {WEIGHTS} or {INDEX}; save "
                   rf"the model there with save_pretrained, or point {{setting}} at the folder that holds its weights"),
    "a variant only": (False, lambda f: (f / WEIGHTS).rename(f / "diffusion_pytorch_model.fp16.safetensors"),
                       rf"it has no {WEIGHTS} or {INDEX} \(it holds diffusion_pytorch_model.fp16.safetensors: a "
                       rf"variant or another model's files, which are not read\)"),
    "missing shard": (True, _missing_shard,
                      rf"{{folder}}/{INDEX} lists 3 shard\(s\), 1 of them missing from {{folder}}: "
                      rf"diffusion_pytorch_model-00003-of-00003.safetensors; download the missing shard\(s\)"),
    "index not JSON": (True, _index_not_json, rf"{{folder}}/{INDEX} is not a valid index of safetensors shards"),
    "index without weight_map": (True, lambda f: (f / INDEX).write_text('{"metadata": {}}'),
                                 rf"{INDEX} has no weight_map of tensor names to shard files"),
    "index naming a .bin shard": (True, _pickle_shard,
                                  r"lists shard\(s\) that are not safetensors \(diffusion_pytorch_model-00001-of-00003"
                                  r"\.bin\), which would be unpickled and can run code: refused"),
    "index and shards from different saves": (True, _shard_without_its_keys,
                                              r"places '.+' \(and \d+ more\) in diffusion_pytorch_model-00001-of-00003"
                                              r"\.safetensors, which does not hold it: the index and the shards are "
                                              r"from different saves"),
    "truncated shard": (True, _truncated_shard,
                        r"{folder}/diffusion_pytorch_model-00002-of-00003.safetensors is truncated: "),
}


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> dict[str, Path]:
    """Tiny Wan folders to copy and break: one weights file, and three shards with their index."""
    import diffusers

    root = tmp_path_factory.mktemp("healthy")
    save_tiny_wan(root / "single")
    diffusers.WanTransformer3DModel.from_pretrained(root / "single" / "transformer").save_pretrained(
        root / "sharded" / "transformer", max_shard_size="40KB")
    return {"single": root / "single", "sharded": root / "sharded"}


def broken_copy(healthy, tmp_path, sharded: bool = False) -> tuple[Path, Path]:
    folder = tmp_path / "wan"
    shutil.copytree(healthy["sharded" if sharded else "single"], folder)
    return folder, folder / "transformer"


def refusal(folder: Path, setting: str = "model.pretrained", value=None) -> str:
    with pytest.raises(ConfigError) as error:
        check_weights_folder(folder, setting=setting, value=value or folder.parent, class_name="WanTransformer3DModel")
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_healthy_folders_pass_and_load(healthy):
    from ringdit.models.diffusers import DiffusersTransformer

    assert _shards(healthy["sharded"] / "transformer") == [f"diffusion_pytorch_model-0000{i}-of-00003.safetensors"
                                                           for i in (1, 2, 3)]
    checked = check_weights_folder(healthy["sharded"] / "transformer", setting="model.pretrained",
                                   value=healthy["sharded"], class_name="WanTransformer3DModel")
    assert [path.name for path in checked] == _shards(healthy["sharded"] / "transformer")
    single = DiffusersTransformer("wan", pretrained=str(healthy["single"]))  # loaded (safetensors only)
    sharded = DiffusersTransformer("wan", pretrained=str(healthy["sharded"]))
    for key, value in single.state_dict().items():
        assert torch.equal(value, sharded.state_dict()[key]), key


@pytest.mark.parametrize("case", list(BROKEN_FILES))
def test_a_broken_weights_file_is_named_with_its_fix(case, healthy, tmp_path):
    breaks, message = BROKEN_FILES[case]
    root, folder = broken_copy(healthy, tmp_path)
    size = (folder / WEIGHTS).stat().st_size
    breaks(folder / WEIGHTS)
    text = refusal(folder)
    message = message.format(size=size, short=size - 100)
    assert re.fullmatch(rf"model\.pretrained={root}: {folder / WEIGHTS} {message}.*", text), text
    assert text.endswith(REFETCH) or case == "git lfs pointer", text


@pytest.mark.parametrize("case", list(BROKEN_FOLDERS))
def test_a_broken_weights_folder_is_named_with_its_fix(case, healthy, tmp_path):
    sharded, breaks, message = BROKEN_FOLDERS[case]
    root, folder = broken_copy(healthy, tmp_path, sharded)
    breaks(folder)
    text = refusal(folder, setting="init_from")
    assert re.search(message.format(folder=folder, setting="init_from"), text), text
    assert text.startswith(f"init_from={root}: "), text


def test_pickled_weights_are_refused_with_the_conversion_command(healthy, tmp_path):
    root, folder = broken_copy(healthy, tmp_path)
    (folder / WEIGHTS).unlink()
    (folder / "diffusion_pytorch_model.bin").write_bytes(b"never unpickled")
    text = refusal(folder)
    assert text == (f"model.pretrained={root}: cannot load WanTransformer3DModel weights from {folder}: it holds "
                    f"pickled weights only (diffusion_pytorch_model.bin), which can run code when loaded and are "
                    f"refused; convert them to safetensors once, where you trust the files: python -c \"from "
                    f"diffusers import WanTransformer3DModel as M; M.from_pretrained('{folder}')"
                    f".save_pretrained('{folder}', safe_serialization=True)\"")
    (folder / "diffusion_pytorch_model.bin").rename(folder / "wan.ckpt")  # not a name from_pretrained reads
    assert refusal(folder).endswith("holds pickled weights only (wan.ckpt), which can run code when loaded and are "
                                    "refused; convert the model to safetensors where you trust the files (load it "
                                    "there, then save_pretrained it into this folder)")
    (folder / WEIGHTS).write_bytes((healthy["single"] / "transformer" / WEIGHTS).read_bytes())
    check_weights_folder(folder, setting="model.pretrained", value=root, class_name="WanTransformer3DModel")


# ---- the entry points: one line, exit code 2, before any rank ------------------------------------------------------


class Payload:
    """Unpickling this creates ``marker``: a .bin that runs code when loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


WAN_RUN = ["experiment=wan_tiny", "data.num_samples=16", "data.batch_size=4", "trainer.max_steps=1", "logger=csv"]


@pytest.mark.parametrize(
    ("setting", "breaks", "message"),
    [("model.pretrained", "truncated", r"diffusion_pytorch_model.safetensors is truncated: its header describes"),
     ("model.pretrained", "missing shard", r"1 of them missing from"),
     ("init_from", "truncated", r"^Error: init_from=.*diffusion_pytorch_model.safetensors is truncated"),
     ("init_from", "empty", r"^Error: init_from=.*diffusion_pytorch_model.safetensors is empty"),
     ("model.pretrained", "pickle", r"holds pickled weights only \(diffusion_pytorch_model.bin\).*safe_serialization"),
     ("init_from", "pickle", r"holds pickled weights only \(diffusion_pytorch_model.bin\)"),
     ("model.pretrained", "no weights", r"has no diffusion_pytorch_model.safetensors or")],
)
def test_train_refuses_a_broken_folder_before_spawning(setting, breaks, message, healthy, tmp_path):
    root, folder = broken_copy(healthy, tmp_path, sharded=breaks == "missing shard")
    marker = tmp_path / "pwned"
    if breaks == "missing shard":
        _missing_shard(folder)
    elif breaks in ("pickle", "no weights"):
        (folder / WEIGHTS).unlink()
        if breaks == "pickle":  # what diffusers falls back to when a folder has no safetensors
            torch.save({"payload": Payload(marker)}, folder / "diffusion_pytorch_model.bin")
    else:
        BROKEN_FILES[breaks][0](folder / WEIGHTS)
    run_dir = tmp_path / "run"
    proc, seconds = fail_fast("train.py", *WAN_RUN, f"data.cache_dir={tmp_path / 'data'}", f"{setting}={root}",
                              f"hydra.run.dir={run_dir}")
    assert_refused(proc, message, seconds=seconds, run_dir=run_dir)
    assert f"Error: {setting}={root}: " in proc.stderr
    assert not marker.exists()


# ---- VAE and text encoder folders: infer.py vae= / text_encoder=, python -m ringdit.prepare --------------------------


@pytest.fixture(scope="module")
def wan_export(tmp_path_factory) -> Path:
    """A ringdit export of a tiny text-to-video Wan (random weights): what infer.py samples from."""
    from ringdit.models.diffusers import DiffusersTransformer

    shape = [1, 8, 8]
    model_cfg = {"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "wan", "config": architecture("wan_tiny"),
                 "input_size": shape, "in_channels": 4, "text_len": TEXT_LEN, "text_dim": 16}
    kwargs = {k: v for k, v in model_cfg.items() if k != "_target_"}
    state = DiffusersTransformer(**kwargs).state_dict()
    data = {"channels": 4, "image_size": shape, "conditioning": "text", "text_len": TEXT_LEN, "text_dim": 16,
            "num_classes": 0, "class_names": [], "latent_scale": 1.0}
    path = tmp_path_factory.mktemp("export") / "wan.safetensors"
    metadata = {"model": model_cfg, "data": data, "objective": {"_target_": "ringdit.diffusion.FlowMatching"},
                "sampling": {"sampler": "euler", "steps": 2}}
    save_file({k: v.contiguous() for k, v in state.items()}, path,
              metadata={k: json.dumps(v) for k, v in metadata.items()} | {"format": "ringdit"})
    return path


def pipeline_copy(models, tmp_path, part: str, breaks: str) -> Path:
    """A copy of the tiny Wan pipeline folder (conftest's ``models``) with ``part``'s weights broken."""
    root = tmp_path / "pipeline"
    shutil.copytree(models["wan"], root)
    name = WEIGHTS if part == "vae" else "model.safetensors"
    weights = root / part / name
    if breaks == "pickle":
        weights.unlink()
        torch.save({"payload": Payload(tmp_path / "pwned")}, weights.with_name(
            "diffusion_pytorch_model.bin" if part == "vae" else "pytorch_model.bin"))
    else:
        BROKEN_FILES[breaks][0](weights)
    return root


@pytest.mark.parametrize(
    ("part", "breaks", "message"),
    [("vae", "truncated", r"^Error: vae=.*/vae/diffusion_pytorch_model.safetensors is truncated: "),
     ("vae", "pickle", r"^Error: vae=.*: cannot load AutoencoderKLWan weights from .*/vae: it holds pickled weights "
                       r"only \(diffusion_pytorch_model.bin\)"),
     ("text_encoder", "header not JSON", r"^Error: text_encoder=.*/text_encoder/model.safetensors is corrupt or not a "
                                         r"safetensors file"),
     ("text_encoder", "pickle", r"^Error: text_encoder=.*: cannot load T5EncoderModel weights from .*/text_encoder: it "
                                r"holds pickled weights only \(pytorch_model.bin\).*from transformers import "
                                r"T5EncoderModel as M; M.from_pretrained\('.*', use_safetensors=False\)")],
)
def test_infer_refuses_a_broken_vae_or_text_encoder_before_sampling(part, breaks, message, models, wan_export,
                                                                    tmp_path):
    root = pipeline_copy(models, tmp_path, part, breaks)
    run_dir = tmp_path / "infer"
    proc, seconds = fail_fast("infer.py", f"ckpt_path={wan_export}", f"{part}={root}", "prompts=[a red fox]",
                              "num_samples=1", "diffusion.sampling.steps=1", f"hydra.run.dir={run_dir}")
    assert_refused(proc, message, seconds=seconds)
    assert not (run_dir / "samples.npz").exists() and not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(("part", "breaks"), [("vae", "empty"), ("text_encoder", "truncated"),
                                              ("text_encoder", "pickle")])
def test_prepare_refuses_a_broken_vae_or_text_encoder(part, breaks, models, tmp_path, capsys):
    from PIL import Image

    from ringdit.prepare import main

    root = pipeline_copy(models, tmp_path, part, breaks)
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(images / "fox.png")
    (images / "fox.txt").write_text("a red fox")
    with pytest.raises(SystemExit) as stop:
        main([f"input={images}", f"out={tmp_path / 'out'}", f"vae={root}", f"text_encoder={root}", "size=16",
              f"max_text_len={TEXT_LEN}"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("Error:")]
    assert stop.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    weights = WEIGHTS if part == "vae" else "model.safetensors"
    expected = (rf"^Error: {part}={root}: .*holds pickled weights only" if breaks == "pickle" else
                rf"^Error: {part}={root}: {root / part / weights} is {breaks}")
    assert re.search(expected, lines[0]), lines[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "pwned").exists()
