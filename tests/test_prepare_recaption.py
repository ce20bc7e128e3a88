"""Re-captioning a prepared folder (ringdit/media/retext.py): a re-run of ``python -m ringdit.prepare`` with new
captions, or another text encoder, re-encodes only the text -- the VAE is never called and the latents are kept
byte for byte."""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("av")

from safetensors import safe_open  # noqa: E402

from ringdit.data.text_latents import TextLatentsDataModule, read_prompts  # noqa: E402
from ringdit.common.errors import ConfigError  # noqa: E402
from ringdit.media.encode_folder import encode_folder  # noqa: E402
from ringdit.media.text import TextEncoder  # noqa: E402
from ringdit.media.vae import VAE  # noqa: E402
from tests.helpers import TEXT_LEN, read_prepared, write_video  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"


def shard(path):
    with safe_open(str(path), framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}, f.metadata()  # noqa: SIM118


@pytest.fixture
def clips(tmp_path):
    folder = tmp_path / "clips"
    folder.mkdir()
    for i, caption in enumerate(["a red fox running", "a blue cat", "green field"]):
        write_video(folder / f"c{i}.mp4", 5, seed=i)
        (folder / f"c{i}.txt").write_text(caption)
    return folder


def rows(folder) -> list:
    """Every sample of a prepared folder as training reads it, the empty prompt's condition and the captions."""
    data = TextLatentsDataModule(str(folder))
    dataset = data.build_dataset()
    return [dataset[i] for i in range(len(dataset))], data.null_condition(), data.captions()


def assert_same_rows(a, b) -> None:
    (samples_a, null_a, captions_a), (samples_b, null_b, captions_b) = a, b
    assert captions_a == captions_b and len(samples_a) == len(samples_b)
    for (latents_a, cond_a), (latents_b, cond_b) in zip(samples_a, samples_b):
        assert torch.equal(latents_a, latents_b) and cond_a.keys() == cond_b.keys()
        assert all(torch.equal(cond_a[key], cond_b[key]) for key in cond_a)
    assert null_a.keys() == null_b.keys() and all(torch.equal(null_a[key], null_b[key]) for key in null_a)


def test_recaptioning_reencodes_only_the_text(models, clips, tmp_path):
    """Prepare 3 clips (2 shards: the latents in shard-*, the text in text/shard-*), change one caption: the re-run
    calls the VAE 0 times and leaves every latent shard byte-identical; only that shard's text file is rewritten, its
    text the new caption's encoding. Another text encoder (max_text_len, another folder, another dtype) re-encodes
    every text file, again without the VAE and with the latents' bytes kept; a re-run with nothing changed skips
    everything; what training reads equals a fresh prepare with the final captions and encoder. A folder whose
    shards hold their text inside (as ringdit wrote them before the text was kept apart) loads as before, and goes
    through the same re-runs the same way: its shards' bytes kept, text files written beside them."""
    from safetensors.torch import save_file

    out, old = tmp_path / "out", tmp_path / "old"
    wan = str(models["wan"])
    settings = dict(size=16, frames=5, max_text_len=TEXT_LEN, shard_size=2, progress=False)
    with mock.patch.object(VAE, "encode", autospec=True, side_effect=VAE.encode) as calls:
        first = encode_folder(str(clips), str(out), wan, wan, **settings)
    assert first.samples == 3 and calls.call_count == 2  # one batch a shard
    latents = {p.name: p.read_bytes() for p in out.glob("shard-*")}
    texts = {p.name: p.read_bytes() for p in (out / "text").glob("shard-*")}
    assert sorted(latents) == sorted(texts) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert "text" not in shard(out / "shard-00000.safetensors")[0]
    old.mkdir()
    for name in latents:  # the same shards with their text inside
        tensors, metadata = read_prepared(out / name)
        save_file(tensors, str(old / name), metadata=metadata)
    whole = {p.name: p.read_bytes() for p in old.glob("shard-*")}
    assert_same_rows(rows(old), rows(out))

    def rerun(folder, text_encoder, **changed):
        with mock.patch.object(VAE, "encode", autospec=True, side_effect=VAE.encode) as calls:
            report = encode_folder(str(clips), str(folder), wan, text_encoder, **settings | changed)
        assert calls.call_count == 0
        assert {p.name: p.read_bytes() for p in folder.glob("shard-*")} == (latents if folder == out else whole)
        return report

    (clips / "c2.txt").write_text("a red cat")  # shard 1's only sample
    again = rerun(out, wan)
    assert (again.texts_encoded, again.shards_skipped, again.shards_written) == (1, 1, 0)
    assert "1 re-encoded for new captions or a new text encoder, their latents kept" in again.summary()
    assert (out / "text" / "shard-00000.safetensors").read_bytes() == texts["shard-00000.safetensors"]
    tensors, metadata = read_prepared(out / "shard-00001.safetensors")
    assert json.loads(metadata["captions"]) == ["a red cat"] and json.loads(metadata["files"]) == ["c2.mp4"]
    direct = TextEncoder(wan, max_len=TEXT_LEN)(["a red cat", ""])
    assert torch.equal(tensors["text"], direct["text"][:1])
    assert torch.equal(tensors["text_mask"], direct["text_mask"][:1])
    assert torch.equal(tensors["null_text"], direct["text"][1:])
    prompts, captions = read_prompts(str(out / "shard-00001.safetensors"))  # infer.py text_embeds=<a prepared shard>
    assert captions == ["a red cat"] and torch.equal(prompts["text"], direct["text"][:1])
    assert rerun(old, wan).texts_encoded == 1
    assert [p.name for p in (old / "text").iterdir()] == ["shard-00001.safetensors"]

    for text_encoder in (wan, str(models["flux"])):  # another text encoder setting (max_text_len), then folder
        for folder in (out, old):
            assert rerun(folder, text_encoder, max_text_len=TEXT_LEN + 2).texts_encoded == 2
        tensors, metadata = read_prepared(out / "shard-00000.safetensors")
        described = json.loads(metadata["text_encoder"])
        assert tensors["text"].shape[1] == TEXT_LEN + 2 and described["max_len"] == TEXT_LEN + 2
        assert described["path"].startswith(str(Path(text_encoder).resolve()))
    with pytest.raises(ConfigError, match=r"text_dtype='fp8' is not a dtype ringdit takes; use one of .*bfloat16"):
        encode_folder(str(clips), str(out), wan, wan, **settings | {"text_dtype": "fp8"})  # before any model loads
    for folder in (out, old):  # the text encoder in another dtype (the advice's bfloat16)
        assert rerun(folder, str(models["flux"]), max_text_len=TEXT_LEN + 2, text_dtype="bfloat16").texts_encoded == 2
    assert read_prepared(out / "shard-00000.safetensors")[0]["text"].dtype == torch.bfloat16
    final = settings | {"max_text_len": TEXT_LEN + 2, "text_dtype": "bfloat16"}
    fourth = encode_folder(str(clips), str(out), wan, str(models["flux"]), **final)
    assert (fourth.texts_encoded, fourth.shards_skipped) == (0, 2)
    fresh = tmp_path / "fresh"
    encode_folder(str(clips), str(fresh), wan, str(models["flux"]), **final)
    assert_same_rows(rows(out), rows(fresh))
    assert_same_rows(rows(old), rows(fresh))

    (out / "text" / "shard-00001.safetensors").replace(out / "text" / "shard-00000.safetensors")  # other samples'
    # text; the advice (prepare's re-run) encodes both shards' text again
    with pytest.raises(ConfigError, match=r"text/shard-00000.safetensors holds the text of other samples than "
                                          r"shard-00000.safetensors; run python -m ringdit.prepare over the folder "
                                          r"again \(it re-encodes only the text\)"):
        rows(out)
    assert rerun(out, str(models["flux"]), max_text_len=TEXT_LEN + 2, text_dtype="bfloat16").texts_encoded == 2
    assert_same_rows(rows(out), rows(fresh))


def test_a_shard_whose_files_moved_is_one_line(models, clips, tmp_path):
    """A clip added before the others moves every shard's files: re-captioning in place is refused, naming the
    out= folder; its advice (a new out= folder) prepares."""
    wan = str(models["wan"])
    settings = dict(size=16, frames=5, max_text_len=TEXT_LEN, shard_size=2, progress=False)
    encode_folder(str(clips), str(tmp_path / "out"), wan, wan, **settings)
    write_video(clips / "a0.mp4", 5, seed=9)
    (clips / "a0.txt").write_text("sky")
    with pytest.raises(ConfigError, match=r"shard-00000.safetensors holds c1.mp4, which the input folder no longer "
                                          r"puts in this shard .* prepare into a new out= folder"):
        encode_folder(str(clips), str(tmp_path / "out"), wan, wan, **settings)
    assert encode_folder(str(clips), str(tmp_path / "new"), wan, wan, **settings).samples == 4


def test_recaptioning_from_the_command_line(models, clips, tmp_path):
    """python -m ringdit.prepare run again after a caption is edited: exit code 0, its summary says which shard's text
    was re-encoded and that the latents were kept."""
    from tests.helpers import fail_fast

    words = [f"input={clips}", f"out={tmp_path / 'out'}", f"vae={models['wan']}", f"text_encoder={models['wan']}",
             "size=16", "frames=5", f"max_text_len={TEXT_LEN}", "shard_size=2"]
    first, _ = fail_fast("-m ringdit.prepare", *words)
    assert first.returncode == 0, first.stderr
    (clips / "c0.txt").write_text("a blue fox")
    again, _ = fail_fast("-m ringdit.prepare", *words)
    assert again.returncode == 0, again.stderr
    assert ("prepared 0 samples into 0 new shards (1 already done, 1 re-encoded for new captions or a new text "
            "encoder, their latents kept)") in again.stdout
