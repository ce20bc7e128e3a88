"""``python -m ringdit.prepare dtype=bfloat16``: the VAE and text encoder run (and the shards are stored) in bfloat16;
float32 stays the default. Its effect on the latents and text, measured against float32 on the tiny models with
``ringdit.media.compare`` (docs/data.md quotes this test's numbers: ``pytest tests/test_prepare_dtype.py -s``)."""

from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("diffusers")
pytest.importorskip("av")


from ringdit.commands.cli import CONF_DIR  # noqa: E402
from ringdit.media.compare import compare_folders, main  # noqa: E402
from ringdit.media.encode_folder import encode_folder  # noqa: E402
from tests.helpers import TEXT_LEN, read_prepared, write_video  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"


def test_bfloat16_encoders_against_float32(models, tmp_path, capsys):
    """Three 9-frame clips through the tiny Wan VAE and T5 in float32 and in bfloat16: the bf16 shards hold bf16
    tensors, and their latents / text differ from float32's by bf16's rounding carried through the encoders: at most
    2 % of the values' scale, about 5 of bf16's relative steps (8 significant bits: 2^-8 = 0.4 %); measured 0.3 %
    for the latents and 0.4 % for the text (docs/data.md)."""
    assert OmegaConf.load(CONF_DIR / "prepare.yaml").dtype == "float32"  # the default
    clips = tmp_path / "clips"
    clips.mkdir()
    for i, caption in enumerate(["a red fox running", "a blue cat", "green field"]):
        write_video(clips / f"c{i}.mp4", 9, seed=i)
        (clips / f"c{i}.txt").write_text(caption)
    wan = str(models["wan"])
    for dtype in ("float32", "bfloat16"):
        encode_folder(str(clips), str(tmp_path / dtype), wan, wan, size=16, frames=9, max_text_len=TEXT_LEN,
                      dtype=dtype, progress=False)
    tensors = read_prepared(tmp_path / "bfloat16" / "shard-00000.safetensors")[0]
    assert tensors["latents"].dtype == tensors["text"].dtype == torch.bfloat16
    result = compare_folders(tmp_path / "float32", tmp_path / "bfloat16")
    for key in ("latents", "text"):
        stats = result[key]
        with capsys.disabled():  # the numbers docs/data.md quotes
            print(f"\n{key}: max |fp32 - bf16| {stats['max']:.4g}, mean {stats['mean']:.4g}, max |fp32| "
                  f"{stats['scale']:.4g}")
        assert 0 < stats["max"] <= 0.02 * stats["scale"]
    assert main([str(tmp_path / "float32"), str(tmp_path / "bfloat16")]) == 0
    assert "latents          max |a - b|" in capsys.readouterr().out
    assert main([str(tmp_path / "float32"), str(tmp_path / "missing")]) == 2  # one line: no such shard
    assert "has no shard-00000.safetensors" in capsys.readouterr().err
