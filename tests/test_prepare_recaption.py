"""Re-captioning a prepared folder (ringdit/media/retext.py): a re-run of ``python -m ringdit.prepare`` with new
captions, or another text encoder, re-encodes only the text -- the VAE is never called and the latents are kept
byte for byte."""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("av")

from safetensors import safe_open  # noqa: E402

from ringdit.errors import ConfigError  # noqa: E402
from ringdit.media.encode_folder import encode_folder  # noqa: E402
from ringdit.media.text import TextEncoder  # noqa: E402
from ringdit.media.vae import VAE  # noqa: E402
from tests.helpers import TEXT_LEN, write_video  # noqa: E402

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


def test_recaptioning_reencodes_only_the_text(models, clips, tmp_path):
    """Prepare 3 clips (2 shards), change one caption: the re-run calls the VAE 0 times, rewrites only that shard, whose
    text equals the new caption's encoding and whose latents are the same bytes; the other shard is untouched. Another
    text encoder setting (max_text_len) re-encodes every shard's text, again without the VAE; a re-run with nothing
    changed skips everything."""
    out = tmp_path / "out"
    wan = str(models["wan"])
    settings = dict(size=16, frames=5, max_text_len=TEXT_LEN, shard_size=2, progress=False)
    with mock.patch.object(VAE, "encode", autospec=True, side_effect=VAE.encode) as calls:
        first = encode_folder(str(clips), str(out), wan, wan, **settings)
    assert first.samples == 3 and calls.call_count == 2  # one batch a shard
    before = {p.name: p.read_bytes() for p in out.glob("shard-*")}
    latents_before = shard(out / "shard-00001.safetensors")[0]["latents"]

    (clips / "c2.txt").write_text("a red cat")  # shard 1's only sample
    with mock.patch.object(VAE, "encode", autospec=True, side_effect=VAE.encode) as calls:
        again = encode_folder(str(clips), str(out), wan, wan, **settings)
    assert calls.call_count == 0
    assert (again.texts_encoded, again.shards_skipped, again.shards_written) == (1, 1, 0)
    assert "1 re-encoded for new captions or a new text encoder, their latents kept" in again.summary()
    assert (out / "shard-00000.safetensors").read_bytes() == before["shard-00000.safetensors"]
    tensors, metadata = shard(out / "shard-00001.safetensors")
    assert json.loads(metadata["captions"]) == ["a red cat"] and json.loads(metadata["files"]) == ["c2.mp4"]
    assert torch.equal(tensors["latents"], latents_before)
    direct = TextEncoder(wan, max_len=TEXT_LEN)(["a red cat", ""])
    assert torch.equal(tensors["text"], direct["text"][:1])
    assert torch.equal(tensors["text_mask"], direct["text_mask"][:1])
    assert torch.equal(tensors["null_text"], direct["text"][1:])

    latents0 = shard(out / "shard-00000.safetensors")[0]["latents"]
    longer = {**settings, "max_text_len": TEXT_LEN + 2}  # another text encoder setting: every shard's text again
    with mock.patch.object(VAE, "encode", autospec=True, side_effect=VAE.encode) as calls:
        third = encode_folder(str(clips), str(out), wan, wan, **longer)
    assert calls.call_count == 0 and third.texts_encoded == 2
    tensors, metadata = shard(out / "shard-00000.safetensors")
    assert tensors["text"].shape[1] == TEXT_LEN + 2 and json.loads(metadata["text_encoder"])["max_len"] == TEXT_LEN + 2
    assert torch.equal(tensors["latents"], latents0)
    fourth = encode_folder(str(clips), str(out), wan, wan, **longer)
    assert (fourth.texts_encoded, fourth.shards_skipped) == (0, 2)


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
