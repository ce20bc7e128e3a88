"""Inputs that are wrong in ways a user can fix, refused up front with one line that names the file and the fix
(issue 20): non-finite values in any tensor of a text_latents shard, captions metadata that is not a JSON list of
one string per sample, metadata.jsonl rows that prepare cannot use (or whose file is not there: named in the
summary), and files given to the tools that read samples.npz."""

from __future__ import annotations

import json
import logging
import os
import re
import runpy
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from ringdit.data import latents as latents_module
from ringdit.data.synthetic_text_latents import synthetic_text_latents
from ringdit.data.text_latents import (
    TextLatentsDataModule,
    read_prompts,
    write_text_latents,
)
from ringdit.common.errors import ConfigError
from tests.helpers import FAST_FAIL_SECONDS, GOOD, LABELS, REPO, assert_refused, fail_fast, write_latents


def shard(path: Path, pooled: bool = False, **changes) -> Path:
    """A 4-sample synthetic text_latents shard, ``changes`` applied to write_text_latents' arguments."""
    arguments = synthetic_text_latents(4, pooled_dim=6 if pooled else 0)
    arguments.update(changes)
    return write_text_latents(path, **arguments)


# ---- 1. NaN / Inf anywhere in a text_latents shard -------------------------------------------------------------------


def poisoned(key: str) -> dict:
    """Arguments of a shard with NaN / Inf in tensor ``key``: three bad values in two rows (rows 1 and 3)."""
    arguments = synthetic_text_latents(4, pooled_dim=6)
    target = {"null_text": arguments["null"]["text"], "null_pooled": arguments["null"]["pooled"]}.get(key)
    if target is not None:  # the empty prompt's (L, D) / (P,): one row, three bad values
        target.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        return arguments
    if key == "text_mask":  # a float mask, as a hand-made shard might store it
        arguments["text_mask"] = arguments["text_mask"].float()
    values = arguments[key].view(len(arguments[key]), -1)
    values[1, 0], values[1, -1], values[3, 2] = float("nan"), float("inf"), float("nan")
    return arguments


ROWS = r" in 2 of its 4 rows \(the first: row 1\); re-encode those samples or drop them"


@pytest.mark.parametrize(("key", "shape", "detail"), [
    ("latents", r"\(4, 4, 3, 8, 8\)", ROWS), ("text", r"\(4, 8, 16\)", ROWS), ("pooled", r"\(4, 6\)", ROWS),
    ("null_text", r"\(1, 8, 16\)", r"; encode the empty prompt again \(null_\*\)"),
    ("null_pooled", r"\(1, 6\)", r"; encode the empty prompt again \(null_\*\)"),
])
def test_nonfinite_values_in_any_tensor_are_named(key, shape, detail, tmp_path):
    path = write_text_latents(tmp_path / "s.safetensors", **poisoned(key))
    with pytest.raises(ConfigError, match=rf"^data.path: {re.escape(str(path))}: {key} {shape} holds 3 NaN or Inf "
                                          rf"values{detail} \(an encoder may have overflowed, e.g. in float16\)$"):
        TextLatentsDataModule(str(path))


def test_every_bad_tensor_of_a_shard_is_listed(tmp_path):
    arguments = poisoned("text")
    arguments["null"]["text"][0, 0] = float("nan")
    path = write_text_latents(tmp_path / "s.safetensors", **arguments)
    with pytest.raises(ConfigError, match=r"text \(4, 8, 16\) holds 3 NaN or Inf values in 2 of its 4 rows \(the "
                                          r"first: row 1\); null_text \(1, 8, 16\) holds 1 NaN or Inf values; "
                                          r"re-encode those samples or drop them, and encode the empty prompt again"):
        TextLatentsDataModule(str(path))


def test_a_float_text_mask_is_checked_too(tmp_path):
    arguments = poisoned("text_mask")
    path = tmp_path / "s.safetensors"
    from safetensors.torch import save_file  # write_text_latents stores masks as bool: this one is hand-made

    save_file({"latents": arguments["latents"], "text": arguments["text"], "text_mask": arguments["text_mask"]},
              str(path), metadata={"format": "ringdit.text_latents/1"})
    with pytest.raises(ConfigError, match=r"text_mask \(4, 8\) holds 3 NaN or Inf values in 2 of its 4 rows"):
        TextLatentsDataModule(str(path))


def test_nonfinite_text_is_refused_before_training(tmp_path):
    """train.py: one line at start-up (the datamodule is built before any rank), naming file, tensor and count."""
    folder = tmp_path / "data"
    shard(folder / "a.safetensors", pooled=True)
    bad = write_text_latents(folder / "b.safetensors", **poisoned("text"))  # the second shard
    proc, seconds = fail_fast("train.py", "data=text_latents", f"data.path={folder}", f"hydra.run.dir={tmp_path / 'r'}")
    assert_refused(proc, rf"data.path: {re.escape(str(bad))}: text \(4, 8, 16\) holds 3 NaN or Inf values in 2 of "
                           rf"its 4 rows \(the first: row 1\); re-encode those samples or drop them")
    assert seconds < FAST_FAIL_SECONDS and not (tmp_path / "r" / "checkpoints").exists()


def test_the_scan_streams_in_chunks(tmp_path, monkeypatch):
    """Rows are read CHUNK_BYTES at a time (a shard larger than RAM is checked); the counts add up across chunks."""
    read = []
    original = latents_module.count_nonfinite

    class Recording:  # a safetensors slice that notes how many rows each read takes
        def __init__(self, rows):
            self.rows = rows

        def __getitem__(self, index):
            chunk = self.rows[index]
            read.append(len(chunk))
            return chunk

    def spy(rows, count, row_shape):
        return original(Recording(rows), count, row_shape)

    monkeypatch.setattr(latents_module, "CHUNK_BYTES", 6 * 8)  # one row of the smallest tensor (pooled, 6 values)
    monkeypatch.setattr("ringdit.data.text_latent_shards.count_nonfinite", spy)
    path = write_text_latents(tmp_path / "s.safetensors", **poisoned("text"))
    with pytest.raises(ConfigError, match=r"text \(4, 8, 16\) holds 3 NaN or Inf values in 2 of its 4 rows \(the "
                                          r"first: row 1\)"):
        TextLatentsDataModule(str(path))
    assert max(read) == 1 and len(read) == 4 + 4 + 4 + 1 + 1  # latents, text, pooled, null_text, null_pooled


def test_the_scan_is_skipped_where_it_is_not_needed(tmp_path, monkeypatch):
    """Once, in the launching process: not in the ranks Lightning spawns (their parent is the launcher, which checked),
    nor for a reader that asks not to (infer.py's held-out prompts)."""
    path = write_text_latents(tmp_path / "s.safetensors", **poisoned("text"))
    latents = write_latents(tmp_path, np.where(np.arange(GOOD.size).reshape(GOOD.shape) == 5, np.nan, GOOD)
                            .astype(np.float32), LABELS)
    assert TextLatentsDataModule(str(path), check_values=False).text_len == 8
    monkeypatch.setenv("RINGDIT_LAUNCHER_PID", str(os.getppid()))  # as in a rank the launcher started
    assert TextLatentsDataModule(str(path)).text_len == 8
    assert latents_module.LatentsDataModule(str(latents)).channels == 4
    monkeypatch.setenv("RINGDIT_LAUNCHER_PID", str(os.getpid()))  # the launcher itself
    with pytest.raises(ConfigError, match="NaN or Inf"):
        TextLatentsDataModule(str(path))
    with pytest.raises(ValueError, match="1 of 10 latent samples hold NaN or Inf"):
        latents_module.LatentsDataModule(str(latents))


def test_nonfinite_prompt_embeddings_are_refused(tmp_path):
    """infer.py's text_embeds= file: the same check (it is read whole anyway)."""
    path = write_text_latents(tmp_path / "p.safetensors", **poisoned("pooled"))
    with pytest.raises(ConfigError, match=rf"text_embeds={re.escape(str(path))}: pooled \(4, 6\) holds 3 NaN or Inf "
                                          rf"values in 2 of its 4 rows; encode those prompts again"):
        read_prompts(str(path))


def test_empty_prompt_of_the_wrong_shape(tmp_path):
    arguments = synthetic_text_latents(4)
    arguments["null"]["text"] = torch.zeros(5, 16)  # L = 5, the shard's prompts have 8 tokens
    path = write_text_latents(tmp_path / "s.safetensors", **arguments)
    with pytest.raises(ConfigError, match=r"null_text has shape \(1, 5, 16\); expected \(1, 8, 16\), the empty "
                                          r"prompt's text \(1, L, D\)"):
        TextLatentsDataModule(str(path))


# ---- 2. captions metadata --------------------------------------------------------------------------------------------


BAD_CAPTIONS = {
    "not JSON": ("['blob 0', 'blob 1']", r"the captions metadata is not valid JSON \(Expecting value: line 1 column 2 "
                                         r"\(char 1\): \"\['blob 0', 'blob 1'\]\"\); store json.dumps\(captions\), "
                                         r"a list of 4 strings, one per sample \(or leave the key out\)"),
    "an object": ('{"0": "blob 0"}', r"the captions metadata is a JSON dict, not a list; store json.dumps"),
    "a number in the list": ('["a", "b", 3, "d"]', r"captions\[2\] is 3 \(int\), not a string; store json.dumps"),
    "null in the list": ('["a", null, "c", "d"]', r"captions\[1\] is None \(NoneType\), not a string"),
    "too few": ('["a", "b", "c"]', r"the captions metadata lists 3 captions for 4 samples; store json.dumps"),
    "too many": (json.dumps(["x"] * 5), r"the captions metadata lists 5 captions for 4 samples"),
}


@pytest.mark.parametrize("case", list(BAD_CAPTIONS))
def test_bad_captions_metadata_is_refused(case, tmp_path):
    text, message = BAD_CAPTIONS[case]
    path = shard(tmp_path / "s.safetensors", captions=None, metadata={"captions": text})
    with pytest.raises(ConfigError, match=rf"data.path: {re.escape(str(path))}: {message}"):
        TextLatentsDataModule(str(path))


def test_bad_captions_in_any_shard_stop_train_py(tmp_path):
    """Every shard is checked when the data is opened (not only the first, not only when previews need them)."""
    folder = tmp_path / "data"
    shard(folder / "a.safetensors")
    bad = shard(folder / "b.safetensors", captions=None, metadata={"captions": "blob 0, blob 1, blob 2, blob 3"})
    proc, seconds = fail_fast("train.py", "data=text_latents", f"data.path={folder}", f"hydra.run.dir={tmp_path / 'r'}")
    assert_refused(proc, rf"data.path: {re.escape(str(bad))}: the captions metadata is not valid JSON")
    assert seconds < FAST_FAIL_SECONDS


def test_good_captions_still_read_and_missing_ones_give_none(tmp_path):
    folder = tmp_path / "data"
    shard(folder / "a.safetensors", captions=["a", "b", "c", "d"])
    shard(folder / "b.safetensors", captions=["e", "f", "g", "h"])
    assert TextLatentsDataModule(str(folder)).captions() == list("abcdefgh")
    shard(folder / "c.safetensors", captions=None)
    assert TextLatentsDataModule(str(folder)).captions() is None


def test_prompt_file_captions_and_other_metadata(tmp_path):
    prompts = shard(tmp_path / "p.safetensors", captions=None, metadata={"captions": '["one", "two"]'})
    with pytest.raises(ConfigError, match=rf"text_embeds={re.escape(str(prompts))}: the captions metadata lists 2 "
                                          rf"captions for 4 samples"):
        read_prompts(str(prompts))
    vae = shard(tmp_path / "v.safetensors", metadata={"vae": "{'class': 'AutoencoderKL'}"})
    with pytest.raises(ConfigError, match=r"the vae metadata is not valid JSON .*prepare the shard again"):
        TextLatentsDataModule(str(vae))
    encoder = shard(tmp_path / "t.safetensors", metadata={"text_encoder": '["a folder"]'})
    with pytest.raises(ConfigError, match=r"the text_encoder metadata is a JSON list, not an object"):
        TextLatentsDataModule(str(encoder))


# ---- 3. metadata.jsonl / metadata.csv for prepare --------------------------------------------------------------------


def captioned_folder(root: Path, rows: list, name: str = "metadata.jsonl") -> Path:
    """Two PNGs, a.png and sub/b.png, and ``rows`` (dicts, or raw lines as strings) as the metadata file."""
    from PIL import Image

    (root / "sub").mkdir(parents=True)
    for i, file in enumerate(("a.png", "sub/b.png")):
        Image.fromarray(np.full((16, 16, 3), 60 * i, np.uint8)).save(root / file)
    if name.endswith(".jsonl"):
        (root / name).write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    else:
        (root / name).write_text("".join(r + "\n" for r in rows))
    return root


GOOD_ROWS = [{"file_name": "a.png", "text": "a red fox"}, {"file_name": "sub/b.png", "text": "a blue cat"}]


BAD_ROWS = {
    "a line that is not JSON": ([GOOD_ROWS[0], "{'file_name': 'sub/b.png'}", GOOD_ROWS[1]],
                                r"metadata.jsonl row 2 is not valid JSON \(Expecting property name enclosed in double "
                                r"quotes.*\); each line is one object like \{\"file_name\": \"a.mp4\", \"text\": "
                                r"\"a caption\"\}"),
    "a line that is a list": ([GOOD_ROWS[0], '["sub/b.png", "a blue cat"]'],
                              r"metadata.jsonl row 2 is a JSON list, not an object like"),
    "no file_name": ([GOOD_ROWS[0], {"file": "sub/b.png", "text": "a blue cat"}],
                     r"metadata.jsonl row 2 has columns \['file', 'text'\]; it needs 'file_name' and the caption "
                     r"column 'text'"),
    "no caption": ([GOOD_ROWS[0], {"file_name": "sub/b.png"}], r"metadata.jsonl row 2 has columns \['file_name'\]"),
    "a null caption": ([GOOD_ROWS[0], {"file_name": "sub/b.png", "text": None}],
                       r"metadata.jsonl row 2: the caption \(text\) of sub/b.png is None \(NoneType\), not a string; "
                       r"give every file a text caption"),
    "a numeric caption": ([GOOD_ROWS[0], {"file_name": "sub/b.png", "text": 7}],
                          r"metadata.jsonl row 2: the caption \(text\) of sub/b.png is 7 \(int\), not a string"),
    "a list caption": ([GOOD_ROWS[0], {"file_name": "sub/b.png", "text": ["a", "b"]}],
                       r"metadata.jsonl row 2: the caption \(text\) of sub/b.png is \['a', 'b'\] \(list\)"),
    "a numeric file_name": ([GOOD_ROWS[0], {"file_name": 3, "text": "x"}, GOOD_ROWS[1]],
                            r"metadata.jsonl row 2: file_name is 3; give the file's path relative to the folder"),
    "a path outside the folder": ([*GOOD_ROWS, {"file_name": "../elsewhere/c.png", "text": "x"}],
                                  r"metadata.jsonl row 3: file_name='../elsewhere/c.png' is outside input=.*; file "
                                  r"names are paths relative to the folder that holds metadata.jsonl, inside it"),
    "a path out and back in": ([*GOOD_ROWS, {"file_name": "sub/../../c.png", "text": "x"}],
                               r"metadata.jsonl row 3: file_name='sub/../../c.png' is outside input="),
    "an absolute path": ([*GOOD_ROWS, {"file_name": "/etc/passwd.png", "text": "x"}],
                         r"metadata.jsonl row 3: file_name='/etc/passwd.png' is outside input="),
    "a file listed twice": ([*GOOD_ROWS, {"file_name": "./a.png", "text": "another caption"}],
                            r"metadata.jsonl row 3: file_name='./a.png' has a row already \(row 1\); give each "
                            r"file one row"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_metadata_rows_are_refused_with_one_line(case, tmp_path):
    from ringdit.media.folder import list_media

    rows, message = BAD_ROWS[case]
    folder = captioned_folder(tmp_path / "in", rows)
    with pytest.raises(ConfigError, match=rf"input: {re.escape(str(folder))}/{message}"):
        list_media(folder)


def test_bad_csv_rows_and_text_files(tmp_path):
    from ringdit.media.folder import list_media

    short = captioned_folder(tmp_path / "csv", ["file_name,text", "a.png,a red fox", "sub/b.png"], "metadata.csv")
    with pytest.raises(ConfigError, match=r"metadata.csv row 2: the caption \(text\) of sub/b.png is empty \(the row "
                                          r"has fewer columns than the header\)"):
        list_media(short)
    bom = captioned_folder(tmp_path / "bom", [], "metadata.csv")  # Excel's UTF-8 CSV starts with a byte-order mark
    (bom / "metadata.csv").write_bytes(b"\xef\xbb\xbffile_name,text\na.png,a red fox\nsub/b.png,a blue cat\n")
    assert [item.caption for item in list_media(bom)] == ["a red fox", "a blue cat"]
    latin = captioned_folder(tmp_path / "latin", GOOD_ROWS)
    (latin / "metadata.jsonl").write_bytes('{"file_name": "a.png", "text": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"input: the metadata file .*metadata.jsonl is not UTF-8 text"):
        list_media(latin)
    sidecar = tmp_path / "sidecar"
    sidecar.mkdir()
    from PIL import Image

    Image.new("RGB", (8, 8)).save(sidecar / "a.png")
    (sidecar / "a.txt").write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"input=.*: the caption file .*a.txt is not UTF-8 text"):
        list_media(sidecar)


def test_listed_files_that_are_not_there_are_named(tmp_path, caplog):
    """Left out of the shards like an unreadable file, and named: in a warning and in the list prepare reports."""
    from ringdit.media.folder import list_media

    folder = captioned_folder(tmp_path / "in", [*GOOD_ROWS, {"file_name": "gone.png", "text": "x"},
                                                {"file_name": "notes.txt", "text": "y"}])
    (folder / "notes.txt").write_text("a text file, not an image")
    missing: list[str] = []
    with caplog.at_level(logging.WARNING):
        items = list_media(folder, missing=missing)
    assert [item.caption for item in items] == ["a red fox", "a blue cat"]
    assert missing == [str(folder / "gone.png"), str(folder / "notes.txt")]
    assert f"skipping {folder / 'gone.png'}: the metadata file lists it, but it does not exist" in caplog.text
    assert f"skipping {folder / 'notes.txt'}: the metadata file lists it, but it is not an image or video" \
        in caplog.text


def test_prepare_summary_names_every_skipped_file(models, tmp_path):
    """python -m ringdit.prepare's summary: the missing file with the corrupt one, each named."""
    from ringdit.media.encode_folder import encode_folder
    from tests.helpers import TEXT_LEN

    folder = captioned_folder(tmp_path / "in", [*GOOD_ROWS, {"file_name": "gone.png", "text": "a red sky"},
                                                {"file_name": "broken.png", "text": "a broken file"}])
    (folder / "broken.png").write_bytes(b"not a png at all")
    report = encode_folder(str(folder), str(tmp_path / "out"), str(models["flux"]), str(models["flux"]), size=16,
                           max_text_len=TEXT_LEN, progress=False)
    assert report.samples == 2 and report.missing == [str(folder / "gone.png")]
    assert report.unreadable == [str(folder / "broken.png")]
    summary = report.summary()
    assert f"skipped 1 unreadable files ({folder / 'broken.png'}), 0 clips too short for the bucket and 1 files the " \
           f"metadata lists that are missing or not images / videos ({folder / 'gone.png'})" in summary
    other_rank = encode_folder(str(folder), str(tmp_path / "out2"), str(models["flux"]), str(models["flux"]),
                               size=16, max_text_len=TEXT_LEN, shard_size=1, rank=1, world_size=2, progress=False)
    assert other_rank.missing == []  # every rank sees them; rank 0 reports them, so totals add up


# ---- 4. samples.npz for python -m ringdit.media.decode and benchmarks/digits_accuracy.py ---------------------------


EXPECTED = (r"pass the samples.npz infer.py wrote for a model trained on latents: it holds 'latents', float32 "
            r"\(N, C, H, W\) images or \(N, C, T, H, W\) videos")


def bad_npz(folder: Path) -> dict[str, Path]:
    files = {"garbage": folder / "garbage.npz", "zip-like": folder / "zip.npz", "truncated": folder / "cut.npz",
             "npy": folder / "one.npy", "folder": folder / "adir", "missing": folder / "nowhere.npz",
             "no latents": folder / "other.npz", "pixel samples": folder / "pixels.npz",
             "pickled latents": folder / "obj.npz", "wrong rank": folder / "rank.npz", "integers": folder / "int.npz",
             "no samples": folder / "empty.npz"}
    files["garbage"].write_text("this is not an npz\n")
    files["zip-like"].write_bytes(b"PK\x03\x04 then nothing a zip needs")
    np.savez(files["truncated"], latents=np.ones((2, 4, 8, 8), np.float32))
    files["truncated"].write_bytes(files["truncated"].read_bytes()[:300])
    np.save(files["npy"], np.zeros((2, 4, 8, 8), np.float32))
    files["folder"].mkdir()
    np.savez(files["no latents"], z=np.zeros((2, 4, 8, 8), np.float32))
    np.savez(files["pixel samples"], images=np.zeros((2, 8, 8, 3), np.uint8), labels=np.arange(2))
    np.savez(files["pickled latents"], latents=np.array([{"a": 1}], dtype=object))
    np.savez(files["wrong rank"], latents=np.zeros((2, 4, 8), np.float32))
    np.savez(files["integers"], latents=np.zeros((2, 4, 8, 8), np.int32))
    np.savez(files["no samples"], latents=np.zeros((0, 4, 8, 8), np.float32))
    return files


BAD_SAMPLES = {
    "garbage": r"samples={path} is not a readable .npz file \(neither a zip archive nor a .npy array\); " + EXPECTED,
    "zip-like": r"samples={path} is not a readable .npz file \(BadZipFile: File is not a zip file\); " + EXPECTED,
    "truncated": r"samples={path} is not a readable .npz file \(BadZipFile: .*\); " + EXPECTED,
    "npy": r"samples={path} is a single .npy array \(2, 4, 8, 8\), not an .npz archive; " + EXPECTED,
    "folder": r"samples={path} is a folder, not a file; " + EXPECTED,
    "missing": r"samples={path} does not exist; " + EXPECTED,
    "no latents": r"samples={path} holds \['z'\], no 'latents'; " + EXPECTED,
    "pixel samples": r"samples={path} holds \['images', 'labels'\], no 'latents': it was sampled in pixel space, so "
                     r"its pictures are already written beside it",
    "pickled latents": r"samples={path}: its 'latents' cannot be read \(ValueError: Object arrays cannot be loaded "
                       r"when allow_pickle=False\); " + EXPECTED,
    "wrong rank": r"samples={path}: latents have shape \(2, 4, 8\); " + EXPECTED,
    "integers": r"samples={path}: latents are int32, not floating point; " + EXPECTED,
    "no samples": r"samples={path}: latents have shape \(0, 4, 8, 8\), no samples; " + EXPECTED,
}


def decode_main(capsys, *argv: str):
    from types import SimpleNamespace

    from ringdit.media.decode import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(list(argv))
    captured = capsys.readouterr()
    return SimpleNamespace(returncode=stop.value.code, stdout=captured.out, stderr=captured.err)


@pytest.mark.parametrize("case", list(BAD_SAMPLES))
def test_decode_refuses_what_is_not_a_samples_npz(case, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    path = bad_npz(tmp_path)[case]
    proc = decode_main(capsys, str(path), f"vae={tmp_path}")
    assert_refused(proc, BAD_SAMPLES[case].format(path=re.escape(str(path))))


@pytest.mark.parametrize(("settings", "message"), [
    (["vae={tmp}/no_vae"], r"vae=.*/no_vae does not exist; pass a local diffusers VAE folder"),
    (["vae={tmp}", "fps=0"], r"fps must be a positive integer, got 0"),
    (["vae={tmp}", "tile=-8"], r"tile must be a positive integer, got -8; the VAE's spatial tile size"),
    (["vae={tmp}", "tiling=maybe"], r"tiling must be true or false, got 'maybe'"),
    (["vae={tmp}", "out={tmp}/good.npz"], r"out=.*/good.npz is a file; pass a folder"),
    (["vae=["], r"could not parse an override"),
    (["vae={tmp}", "nomralised=false"], r"no setting named 'nomralised'; did you mean normalised\?"),
])
def test_decode_settings_are_checked_before_any_work(settings, message, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    good = tmp_path / "good.npz"
    np.savez(good, latents=np.zeros((2, 4, 8, 8), np.float32))
    proc = decode_main(capsys, str(good), *(s.format(tmp=tmp_path) for s in settings))
    assert_refused(proc, message)


def test_decode_video_latents_with_an_image_vae(models, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    video = tmp_path / "video.npz"
    np.savez(video, latents=np.zeros((1, 4, 2, 4, 4), np.float32))
    proc = decode_main(capsys, str(video), f"vae={models['flux']}")
    assert_refused(proc, r"latents are videos \(1, 4, 2, 4, 4\) \(N, C, T, H, W\) but vae=.*flux/vae is an image VAE "
                           r"\(AutoencoderKL\); decode with the video VAE")


def test_decode_is_one_line_from_the_command_line(tmp_path):
    """The reported case, as a user runs it (its command line, in this process): no BadZipFile traceback."""
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"PK\x03\x04garbage")
    proc, _ = fail_fast("-m ringdit.media.decode", str(garbage), f"vae={tmp_path}")
    assert_refused(proc, rf"samples={re.escape(str(garbage))} is not a readable .npz file \(BadZipFile")


@pytest.fixture(scope="module")
def digits_accuracy():
    pytest.importorskip("sklearn")
    return runpy.run_path(str(REPO / "benchmarks" / "digits_accuracy.py"))  # not __main__: main() does not run


@pytest.mark.parametrize(("case", "message"), [
    ("garbage", r"{path} is not a readable .npz archive \(neither a zip archive nor a .npy array\)"),
    ("zip-like", r"{path} is not a readable .npz archive \(BadZipFile: File is not a zip file\)"),
    ("npy", r"{path} is a single .npy array, not an .npz archive"),
    ("missing", r"{path} does not exist"),
    ("folder", r"{path} is a folder"),
    ("no latents", r"{path} holds \['z'\], no 'images'"),
    ("pickled latents", r"{path} is not a readable .npz archive \(ValueError: Object arrays cannot be loaded when "
                        r"allow_pickle=False\)"),  # never unpickled
])
def test_digits_accuracy_reads_only_samples_npz(case, message, digits_accuracy, tmp_path, capsys):
    path = bad_npz(tmp_path)[case]
    with pytest.raises(SystemExit) as stop:
        digits_accuracy["load_samples"](str(path))
    error = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(error.splitlines()) == 1
    assert re.match("Error: " + message.format(path=re.escape(str(path))) + ".*; pass the samples.npz infer.py wrote "
                    "for a pixel-space digits model", error), error
    good = tmp_path / "good.npz"
    np.savez(good, images=np.zeros((2, 8, 8, 1), np.uint8), labels=np.arange(2))
    assert digits_accuracy["load_samples"](str(good))["labels"].tolist() == [0, 1]


def test_np_load_never_unpickles_user_files():
    """Every np.load of a file a user names says allow_pickle=False (numpy's default today; explicit, so a changed
    default or a copied line cannot turn a data file into code)."""
    for file in [*REPO.glob("ringdit/**/*.py"), *REPO.glob("benchmarks/*.py"), REPO / "train.py", REPO / "infer.py"]:
        for number, line in enumerate(file.read_text().splitlines(), 1):
            if "np.load(" in line:
                assert "allow_pickle=False" in line, f"{file.relative_to(REPO)}:{number}: {line.strip()}"


def test_a_corrupt_zip_member_is_named(tmp_path, capsys, monkeypatch):
    """A zip whose latents member is damaged (CRC / deflate errors surface only when it is read)."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    path = tmp_path / "damaged.npz"
    np.savez_compressed(path, latents=np.random.default_rng(0).normal(size=(4, 4, 16, 16)).astype(np.float32))
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo("latents.npy")
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    for i in range(start + 200, start + 260):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    proc = decode_main(capsys, str(path), f"vae={tmp_path}")
    assert_refused(proc, rf"samples={re.escape(str(path))}: its 'latents' cannot be read \(")


# ---- a list of prompts on the command line: the taught form keeps its commas, the ambiguous one is refused --------


def taught_prompts() -> list[str]:
    """The prompts= examples --help (conf/infer.yaml's comment) and docs/sampling.md teach, as the shell passes them."""
    import shlex

    comment = re.search(r"^\s+# stays in its prompt: (.*)$", (REPO / "conf" / "infer.yaml").read_text(), flags=re.M)
    docs = re.search(r"^python infer\.py ('prompts=.*?') negative_prompt", (REPO / "docs" / "sampling.md").read_text(),
                     flags=re.M)
    return [shlex.split(comment.group(1))[0], shlex.split(docs.group(1))[0]]


@pytest.mark.parametrize("override", taught_prompts())
def test_the_taught_prompt_list_keeps_the_comma_in_its_prompt(override):
    """Through the shell's quoting (shlex) and Hydra's parser, as infer.py receives them."""
    import ringdit
    from ringdit.spec.infer import check_prompt_list

    cfg = ringdit.config("infer", [override])
    assert list(cfg.prompts) == ["a red fox, running in the snow", "a cat"]
    check_prompt_list(cfg.prompts)  # quoted: not refused



def test_an_unquoted_list_of_prompts_is_refused_and_its_advice_samples(wan_pipeline_folder, tmp_path):
    """infer.py prompts=[a red fox, running in the snow] would sample two prompts; it is refused before anything is
    built, with the quoted forms for one prompt and for two, and the one-prompt form samples one prompt."""
    import shlex

    sample = [f"ckpt_path={wan_pipeline_folder}", "size=[16,16]", "frames=5", "diffusion.sampling.steps=1",
              "num_samples=1"]
    proc, seconds = fail_fast("infer.py", *sample, "prompts=[a red fox, running in the snow]",
                              f"hydra.run.dir={tmp_path / 'refused'}")
    assert_refused(proc, text="prompts=[a red fox, running in the snow]: Hydra splits an unquoted list at every comma, so "
                         "this is 2 prompts (a red fox | running in the snow); quote each prompt: "
                         "'prompts=[\"a red fox, running in the snow\"]' for one prompt, "
                         "'prompts=[\"a red fox\", \"running in the snow\"]' for 2", seconds=seconds)
    one, two = re.findall(r"('prompts=\[.*?\]')", proc.stderr)
    import ringdit

    assert list(ringdit.config("infer", shlex.split(two)).prompts) == ["a red fox", "running in the snow"]
    from tests.helpers import run

    run("infer.py", tmp_path / "one", *sample, *shlex.split(one))
    with np.load(tmp_path / "one" / "samples.npz") as samples:
        assert list(samples["captions"]) == ["a red fox, running in the snow"]


def test_a_broken_tokenizer_file_is_named(tmp_path):
    """An empty tokenizer.json in a pipeline folder: one line naming the tokenizer folder, not the JSON parser's."""
    from transformers import T5Config, T5EncoderModel

    from ringdit.common.errors import ConfigError
    from ringdit.media.text import TextEncoder, word_level_tokenizer
    from tests.helpers import WORDS

    T5EncoderModel(T5Config(vocab_size=len(WORDS), d_model=16, d_ff=32, d_kv=4, num_layers=1, num_heads=2)
                   ).save_pretrained(tmp_path / "text_encoder")
    word_level_tokenizer(WORDS).save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("")
    with pytest.raises(ConfigError, match=rf"tokenizer={tmp_path / 'tokenizer'}: cannot load its tokenizer"):
        TextEncoder(tmp_path, max_len=8)


def test_class_ids_are_ascii_digits():
    """labels=[３] (a full-width digit, which int() reads as 3) is no class id; labels=[3] is."""
    from ringdit.sampling import resolve_labels

    digits = {"num_classes": 10, "class_names": []}
    with pytest.raises(ValueError, match="labels: '３' is not a class id"):
        resolve_labels(["３"], 1, digits)
    assert resolve_labels(["3"], 2, digits) == [3, 3]
