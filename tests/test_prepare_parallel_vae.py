"""``python -m ringdit.prepare parallel_vae=true`` on two ranks (forked as torchrun starts them: their rank in the
environment): every rank encodes every clip, its VAE tiles split over the ranks (ringdit.media.encode_folder
``TileGroup``), and rank 0 writes the very shards one process writes.

Equality: each shard is compared with a one-process prepare of the same folder: its tensor bytes exactly, its header
(dtypes, shapes, offsets and metadata) as JSON. Each tile is encoded by the same kernels on one thread in both
(the ranks run one thread each, OMP_NUM_THREADS=1 as torchrun sets it, and the reference runs with
``torch.set_num_threads(1)``)
and blended by diffusers' own code in its order (ringdit.media.parallel_vae), and the captions' text states come
from rank 0 alone, so the tensors are bit-identical. The files themselves are not byte-identical, not even between
two one-process runs: safetensors writes the metadata keys from a Rust HashMap, in an order that changes per call.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("imageio")

from ringdit.common.errors import ConfigError  # noqa: E402
from ringdit.media.encode_folder import TileGroup, encode_folder  # noqa: E402
from ringdit.media.vae import VAE  # noqa: E402
from tests.distributed import run_command_ranks  # noqa: E402
from tests.helpers import TEXT_LEN, TILE, split, write_video  # noqa: E402

@pytest.fixture
def clips(tmp_path) -> Path:
    """Four 48 x 64 clips and a corrupt one, sorted so that the corrupt one shares shard 0 with a good one."""
    folder = tmp_path / "clips"
    folder.mkdir()
    for name, seed, caption in (("a", 1, "a red fox"), ("c", 3, "a blue cat"), ("d", 4, "green field"),
                                ("e", 5, "a red sky")):
        write_video(folder / f"{name}.mp4", 6, seed=seed, size=(64, 48))
        (folder / f"{name}.txt").write_text(caption)
    (folder / "b.mp4").write_bytes(b"not a video")
    (folder / "b.txt").write_text("a cat running")
    return folder


def settings(models, clips, out, **extra) -> dict:
    return dict(input=str(clips), out=str(out), vae=str(models["wan"]), text_encoder=str(models["wan"]),
                size=[48, 64], frames=5, max_text_len=TEXT_LEN, shard_size=2, batch_size=2, tile=TILE, **extra)


def one_process(models, clips, out) -> None:
    """The reference: plain prepare in this process, one thread as each torchrun rank."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = encode_folder(**settings(models, clips, out), progress=False)
    finally:
        torch.set_num_threads(threads)
    assert report.samples == 4 and report.shards_written == 3 and len(report.unreadable) == 1


def test_two_ranks_write_the_one_process_shards(models, clips, tmp_path):
    """shards: 0 = [a, b (corrupt)], 1 = [c, d], 2 = [e]; shard 1 is there already (resume), so the 2 ranks encode
    shard 0 (one clip left) and shard 2 together, tile by tile, and rank 0 writes them."""
    from ringdit.media.parallel_vae import encode_grid

    vae = VAE(models["wan"], tile=TILE)
    assert len(encode_grid(vae.model, torch.zeros(1, 3, 5, 48, 64)).tiles()) == 6  # several tiles to split

    reference, out = tmp_path / "reference", tmp_path / "parallel"
    one_process(models, clips, reference)
    out.mkdir()
    shutil.copy(reference / "shard-00001.safetensors", out)  # a shard done before: skipped, not rewritten
    shutil.copytree(reference / "text", out / "text", ignore=lambda _, names: [n for n in names if "00001" not in n])
    overrides = [f"{key}={value}".replace(" ", "") for key, value in settings(models, clips, out).items()]
    done = run_command_ranks("-m ringdit.prepare", (*overrides, "parallel_vae=true"), 2,
                             {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "prepared 2 samples into 2 new shards (1 already done)" in done.stdout, done.stdout
    assert "skipped 1 unreadable files" in done.stdout
    assert "parallel_vae=true: encoded a share of the VAE tiles of 2 batches" in done.stdout  # rank 1 took part
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    for shard in sorted([*reference.glob("shard-*.safetensors"), *reference.glob("text/shard-*.safetensors")]):
        assert split(out / shard.relative_to(reference)) == split(shard), shard.name


def test_bad_parallel_vae_settings(models, clips, tmp_path, caplog, capsys):
    from ringdit.prepare import main

    with pytest.raises(ConfigError, match=r"parallel_vae must be true or false, got 'yes'; pass parallel_vae=true"):
        encode_folder(**settings(models, clips, tmp_path / "out"), parallel_vae="yes", progress=False)
    with pytest.raises(SystemExit) as exit_info:  # the command line: one line, exit code 2, nothing written
        main([f"{key}={value}".replace(" ", "") for key, value in settings(models, clips, tmp_path / "o").items()]
             + ["parallel_vae=maybe"])
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and error.startswith("Error: parallel_vae must be true or false, got 'maybe'")
    assert "Traceback" not in error and not (tmp_path / "o").exists()
    with pytest.raises(ConfigError, match="parallel_vae=true splits the VAE's spatial tiles .* tiling=false"):
        encode_folder(**settings(models, clips, tmp_path / "out"), tiling=False, parallel_vae=True, progress=False)
    with pytest.raises(ConfigError, match=r"parallel_vae=true: vae=.* has spatial tiling off.*pass tiling=true"):
        TileGroup.check(VAE(models["wan"], tiling=False), models["wan"])

    # one process: the plain prepare, with a warning that there is nothing to split (of one clip, to be quick)
    for name in "cde":
        (clips / f"{name}.mp4").unlink()
    with caplog.at_level(logging.WARNING, logger="ringdit.prepare"):
        report = encode_folder(**settings(models, clips, tmp_path / "alone"), parallel_vae=True, progress=False)
    assert report.samples == 1 and "parallel_vae=true in one process" in caplog.text
