"""Hostile and wrong inputs to the newest surfaces -- images, JSON files (TeaCache coefficients, prompt lines),
the calibrate and export commands, sample sizes beyond a model's RoPE table, a LoRA base of another architecture,
image-to-video buckets without videos, a full disk, bucket steps the patch cannot divide, folders that name their
own code, Flux.2's pipeline-shaped position ids -- each ends in one line naming the setting or file, the value and
the fix, or works as the model itself would."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ringdit.common.errors import ConfigError
from tests.distributed import run_ranks
from tests.helpers import (TEXT_LEN, TINY, WAN, architecture, assert_refused, assert_same_numbers, fail_fast, run,
                           write_video)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# ---- images: one guard for every reader ------------------------------------------------------------------------------


def bomb_png(path: Path, side: int = 30000) -> Path:
    """A PNG whose header declares ``side`` x ``side`` pixels (900 M at 30000: Pillow's bomb guard refuses it at
    open); its one IDAT row is all there is."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 4))
                     + chunk(b"IEND", b""))
    return path


def test_a_decompression_bomb_is_one_unreadable_image_everywhere(tmp_path):
    """Pillow's DecompressionBombError is a plain Exception: infer.py's image check, prepare's probe and reader and
    the image folder's probe all see it as an unreadable file named in one line."""
    from ringdit.data.image_folder import _probe
    from ringdit.media.frames import UnreadableImage, probe, read_image
    from ringdit.spec.infer import check_image

    bomb = bomb_png(tmp_path / "bomb.png")
    with pytest.raises(ConfigError, match=rf"image={bomb} is not a readable image \(Image size \(900000000 pixels\) "
                                          r"exceeds limit .*decompression bomb.*; give a PNG / JPEG / WebP file"):
        check_image(str(bomb), 16, 16)
    for reader in (lambda: probe(bomb, is_video=False), lambda: read_image(bomb, 16, 16)):
        with pytest.raises(UnreadableImage, match=rf"{bomb} is not a readable image"):
            reader()
    assert _probe(bomb) is None  # a folder's bad file is skipped and counted, as every other unreadable one


# ---- JSON files: size and depth bounds ------------------------------------------------------------------------------


def test_teacache_coefficient_files_are_bounded(tmp_path):
    """A file nested past the parser's recursion limit, one of millions of coefficients, one larger than a
    coefficients file can be, and the wrong JSON shapes: each one ConfigError naming the file."""
    from ringdit.caching.cache_settings import read_coefficients

    cases = {
        "deep": ("[" * 100_000 + "]" * 100_000, r"is not valid JSON \(nested too deeply\)"),
        "many": (json.dumps({"coefficients": [0.5] * 50_000}), r"holds 50,000 coefficients, a polynomial of degree "
                                                                r"49999; .*at most 16 coefficients"),
        "huge": (json.dumps({"coefficients": [0.5] * 300_000}), r"is 1,\d{3},\d{3} bytes, more than the 1,048,576 "
                                                                 r"such a file can need"),
        "array": ("[1, 2]", r"holds a JSON array, not an object"),
        "no key": ('{"coefs": [1, 2]}', r'has no "coefficients" key'),
        "not numbers": ('{"coefficients": ["a"]}', r"must be a non-empty list of finite numbers"),
        "not utf-8": (b"\xff\xfe{}", r"is not UTF-8 text"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.json"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(ConfigError, match=rf"cache.coefficients={path}.*{message}"):
            read_coefficients("cache.coefficients", str(path))
    with pytest.raises(ConfigError, match=r"cache.coefficients holds 17 coefficients"):
        read_coefficients("cache.coefficients", [1.0] * 17)
    assert read_coefficients("cache.coefficients", [1.0] * 16) == (1.0,) * 16


def test_deeply_nested_json_in_data_files_is_one_line(tmp_path):
    """Prompt-file lines and a latents folder's class names go through the same parser guard."""
    from ringdit.data.latents import _parse_names
    from ringdit.sampling import read_prompt_file

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a cat"}\n' + "[" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=rf"prompt_file={prompts} line 2: the line is not valid JSON \(nested too "
                                          r"deeply\); each line is one object"):
        read_prompt_file(str(prompts))
    with pytest.raises(ConfigError, match=r"class_names.json is not valid JSON \(nested too deeply\); give a list"):
        _parse_names(tmp_path, "class_names.json", "[" * 100_000)


# ---- the calibrate and export commands -------------------------------------------------------------------------------


def command(main, argv, capsys) -> tuple[int, str]:
    """A ``python -m`` command's ``main(argv)`` in this process: its exit code and stderr."""
    code = main(argv)
    return code, capsys.readouterr().err


def test_calibrate_is_a_hydra_command_with_one_line_errors(tiny_checkpoint, tmp_path, capsys):
    from ringdit.caching.calibrate import main

    for argv, message in (
        (["calibrate", f"ckpt_path={tmp_path / 'missing.ckpt'}"], r"ckpt_path=.*missing.ckpt is not a file; give a "
                                                                  r"training run's .ckpt"),
        (["calibrate", f"ckpt_path={tiny_checkpoint}", "num_samples=0"], r"num_samples must be a positive integer, "
                                                                         r"got 0"),
        (["calibrate", f"ckpt_path={tiny_checkpoint}", "diffusion.sampling.steps=-2"],
         r"steps must be a positive integer, got -2"),
        (["calibrate", f"ckpt_path={tiny_checkpoint}", f"out={tmp_path}"], r"out=.* is a folder; give the file"),
        (["calibrate"], r"ckpt_path is required"),
        (["fit"], r"python -m ringdit.caching has one command: calibrate"),
        # a 1-step model: adaLN-Zero blocks still add almost nothing, so no evaluation's change is a usable point
        (["calibrate", f"ckpt_path={tiny_checkpoint}", "num_samples=2", "diffusion.sampling.steps=3",
         f"out={tmp_path / 'c.json'}"],
         r"calibration recorded 0 usable evaluations, fewer than degree \+ 1 = 5; sample more steps or samples"),
        # a Wan VACE checkpoint: its samples need a control video, which calibration has none of
        (["calibrate", f"ckpt_path={vace_checkpoint(tmp_path)}"], r"ckpt_path=.* is a control-video model "
                                                                 r"\(model.family=wan_vace\): calibration samples"),
    ):
        code, err = command(main, argv, capsys)
        assert code == 2 and len(err.strip().splitlines()) <= 2 and "Traceback" not in err, err
        assert re.search(message, err.splitlines()[0]), err


def vace_checkpoint(tmp_path) -> Path:
    """A checkpoint file whose hyper-parameters name a Wan VACE model (all calibration reads before refusing)."""
    path = tmp_path / "vace.ckpt"
    torch.save({"hyper_parameters": {"model": {"family": "wan_vace"}, "data": {"conditioning": "text"}}}, path)
    return path


def test_export_refuses_an_out_it_cannot_write(tiny_checkpoint, tmp_path, capsys):
    """A LoRA export over a file, a file export into a folder or below a file: one line before reading weights."""
    from ringdit.export import main

    (tmp_path / "file").write_text("keep me")
    for overrides, message in (
        (["lora=true", f"out={tmp_path / 'file'}"], r"out=.*file is a file; lora=true writes a folder"),
        (["format=diffusers", f"out={tmp_path / 'file'}"], r"out=.*file is a file; format=diffusers"),
        ([f"out={tmp_path}"], r"out=.* is a folder; give the file to write \(format=ringdit writes one file\)"),
        (["format=comfyui", f"out={tmp_path / 'lora.safetensors'}"], r"out=.*lora.safetensors: format=comfyui writes "
                                                                     r"a folder .*; give a folder, e.g. out=.*lora$"),
        ([f"out={tmp_path / 'file' / 'w.safetensors'}"], r"cannot write out=.* \(.*file is a file, not a folder\)"),
    ):
        code, err = command(main, [f"ckpt_path={tiny_checkpoint}", *overrides], capsys)
        assert code == 2 and re.search(message, err.splitlines()[0]) and "Traceback" not in err, err
    assert (tmp_path / "file").read_text() == "keep me"


# ---- sizes beyond the RoPE table, a LoRA base of another size ------------------------------------------------------


def test_sample_sizes_beyond_the_position_table_are_refused():
    """Wan's RoPE table has rope_max_seq_len positions per axis: a longer axis is named in the units it was given."""
    from ringdit.models.diffusers import DiffusersTransformer
    from ringdit.sampling import SampleSizes

    with torch.device("meta"):
        wan = DiffusersTransformer("wan", config={**architecture("wan_tiny"), "rope_max_seq_len": 16})
    assert wan.max_grid == (16, 16, 16)
    sizes = SampleSizes.of({"image_size": [3, 8, 8], "vae": {"spatial_compression": 8, "temporal_compression": 4}},
                           wan.patch_shape, wan.max_grid)
    assert sizes.shape([256, 256], 61) == (16, 32, 32)  # 16 x 16 x 16 tokens: the table's end
    with pytest.raises(ConfigError, match=r"size=\[256, 272\]: 17 tokens along one axis, more than the 16 positions "
                                          r"the model's position embedding covers .* there is size=\[256, 256\]"):
        sizes.shape([256, 272])
    with pytest.raises(ConfigError, match=r"frames=65: 17 tokens .* there is frames=61"):
        sizes.shape(None, 65)


@pytest.fixture(scope="module")
def wan_lora(tmp_path_factory):
    """A Wan LoRA run (adapters on attention only) on a tiny pipeline folder."""
    import diffusers

    root = tmp_path_factory.mktemp("wan_lora")
    diffusers.WanTransformer3DModel.from_config(architecture("wan_tiny")).save_pretrained(root / "wan" / "transformer")
    run("train.py", root / "run", *WAN, "trainer.max_steps=1", "lora.rank=4", f"model.pretrained={root / 'wan'}")
    return root


def test_a_lora_base_of_another_architecture_is_refused(wan_lora, tmp_path):
    """Attention-only adapters fit a base whose MLP is twice as wide; the recorded architecture does not."""
    import diffusers

    ckpt = wan_lora / "run" / "checkpoints" / "last.ckpt"
    wide = {**architecture("wan_tiny"), "ffn_dim": 2 * architecture("wan_tiny")["ffn_dim"]}
    diffusers.WanTransformer3DModel.from_config(wide).save_pretrained(tmp_path / "wide" / "transformer")
    proc, seconds = fail_fast("infer.py", f"ckpt_path={ckpt}", f"base={tmp_path / 'wide'}",
                              f"hydra.run.dir={tmp_path / 'refused'}")
    assert_refused(proc, rf"base={tmp_path / 'wide'} does not fit the LoRA adapter in ckpt_path={ckpt}: its "
                         rf"architecture differs: ffn_dim {wide['ffn_dim']} \(trained on {wide['ffn_dim'] // 2}\)",
                   seconds=seconds)
    proc, seconds = fail_fast("infer.py", f"ckpt_path={ckpt}", "size=[16384,32]",
                              f"hydra.run.dir={tmp_path / 'refused'}")
    assert_refused(proc, r"size=\[16384, 32\]: 8192 tokens along one axis, more than the 32 positions the model's "
                         r"position embedding covers", seconds=seconds)


# ---- prepare: image-to-video without a clip; folders that name their own code ---------------------------------------


def test_i2v_with_only_one_frame_buckets_is_refused(models, tmp_path):
    from ringdit.media.encode_folder import encode_folder

    clips = tmp_path / "clips"
    clips.mkdir()
    write_video(clips / "a.mp4", 6)
    (clips / "a.txt").write_text("a red fox")
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"task=i2v: every file of input=.* falls in a 1-frame bucket .*a 1-frame "
                                          r"clip is its own first frame.*give frame buckets of 1 \+ k \* 4 frames"):
        encode_folder(str(clips), str(out), str(models["wan"]), str(models["wan"]), task="i2v", buckets=[[16, 24]],
                      size=[16, 24], frames=5, frame_buckets=[1], max_text_len=TEXT_LEN, progress=False)
    assert not list(out.glob("shard-*")) if out.exists() else True


def test_folders_that_name_their_own_code_are_refused_before_loading(models, tmp_path):
    """transformers would import a folder's ``auto_map`` classes (and, on a terminal, ask to run them): refused in
    one line naming the setting; the folder's code never runs."""
    import shutil

    from ringdit.media.text import TextEncoder

    sentinel = tmp_path / "ran"
    for part, name in (("tokenizer", "tokenizer_config.json"), ("text_encoder", "config.json")):
        folder = tmp_path / part
        shutil.copytree(models["wan"], folder)
        target = folder / part / name
        config = json.loads(target.read_text())
        config["auto_map"] = {"AutoTokenizer": ["evil.Evil", None], "AutoModel": "evil.Evil"}
        target.write_text(json.dumps(config))
        (folder / part / "evil.py").write_text(f"open({str(sentinel)!r}, 'w').write('ran')\n")
        with pytest.raises(ConfigError, match=rf"(tokenizer|text_encoder)={folder}(/{part})?: .*{name} names custom "
                                              r"code \(auto_map: .*\), which ringdit never runs"):
            TextEncoder(folder, max_len=TEXT_LEN)
    assert not sentinel.exists()


# ---- a full disk, a bucket step the patch cannot divide --------------------------------------------------------------


def test_a_full_disk_is_said_and_the_previous_file_kept(tmp_path, monkeypatch):
    """torch.save's own writer hides ENOSPC ("unexpected pos"): a write that fails with the disk (nearly) full is
    one DiskFullError naming the file, and the previous file is intact."""
    from ringdit.common import atomic

    target = tmp_path / "last.ckpt"
    target.write_bytes(b"previous")
    monkeypatch.setattr(atomic, "free_bytes", lambda folder: 4096)
    with pytest.raises(atomic.DiskFullError, match=rf"the disk is full: writing {target} failed \(0.0 MiB left .*"
                                                   r"the previous last.ckpt .* is intact"):
        with atomic.atomic_write(target) as tmp:
            tmp.write_bytes(b"partial")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert target.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="not about space"):  # plenty of space: the error stays what it was
        with atomic.atomic_write(target) as tmp:
            raise RuntimeError("not about space")
    assert atomic.disk_full(OSError(28, "No space left on device"), tmp_path)


def test_a_write_removes_a_killed_writes_temporary_but_not_one_in_progress(tmp_path):
    """Two processes writing the same cached shard at once must not delete each other's temporary file (the second
    one's rename would fail); a temporary left by a killed write is removed by the next write."""
    import os

    from ringdit.common import atomic

    import subprocess
    import sys

    target = tmp_path / "shard.safetensors"
    host = atomic._owner().partition("-")[2]
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f".shard.safetensors.{int(ended.stdout)}-{host}.abc.tmp"  # its writer was killed just now
    old = tmp_path / ".shard.safetensors.other-host.abc.tmp"  # untouched for long: a writer elsewhere, killed
    live = tmp_path / f".shard.safetensors.{os.getpid()}-{host}.abc.tmp"  # a writer that runs
    fresh = tmp_path / ".shard.safetensors.1-otherhost.abc.tmp"  # another host's write in progress
    for temporary in (dead, old, live, fresh):
        temporary.write_bytes(b"partial")
    then = old.stat().st_mtime - atomic.STALE_TEMPORARY_SECONDS - 1
    os.utime(old, (then, then))
    with atomic.atomic_write(target) as tmp:
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new" and not dead.exists() and not old.exists()
    assert live.read_bytes() == fresh.read_bytes() == b"partial"


def test_a_real_full_file_system(tmp_path):
    """A 1 MiB tmpfs (where this machine lets the test mount one) filled by a checkpoint write."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root, or no CAP_SYS_ADMIN)")
    try:
        from ringdit.common.atomic import DiskFullError, atomic_write

        (mount / "step_0000002.ckpt").write_bytes(b"good")
        with pytest.raises(DiskFullError, match=r"nothing was written at .*step_0000004.ckpt; the last good one, "
                                                r"step_0000002.ckpt, is intact"):
            with atomic_write(mount / "step_0000004.ckpt") as tmp:
                torch.save({"w": torch.zeros(2**20)}, tmp)
        assert sorted(p.name for p in mount.iterdir()) == ["step_0000002.ckpt"]
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_bucket_step_the_patch_cannot_divide_is_named(tmp_path):
    """The most frequent bucket is the bad one: the bucket check runs before the model is built around it."""
    rng = np.random.default_rng(0)
    for name, count, (height, width) in (("a", 6, (35, 35)), ("b", 2, (30, 42))):
        (tmp_path / "images" / name).mkdir(parents=True)
        for i in range(count):
            Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
                tmp_path / "images" / name / f"{i}.png")
    proc, seconds = fail_fast("train.py", *TINY, "data=image_folder", f"data.root={tmp_path / 'images'}",
                              "data.buckets=auto", "data.bucket_step=5", "data.image_size=35",
                              f"hydra.run.dir={tmp_path / 'run'}")
    assert_refused(proc, r"the bucket \[35, 35\] \(6 samples\) is not divisible by the model's patch \[2, 2\].*"
                         r"data.bucket_step a multiple of the patch", seconds=seconds)


# ---- Flux.2 called as Flux2Pipeline calls it -------------------------------------------------------------------------


def check_flux2_pipeline_ids(rank, world):
    """(B, S, 4) ids, as Flux2Pipeline passes them, and (S, 4) ids give the unmodified model's output at ring 2."""
    import diffusers
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    from ringdit.models import parallelize
    from ringdit.models.diffusers import DiffusersTransformer
    from ringdit.parallel import init_sequence_parallel

    config = architecture("flux2_tiny")
    torch.manual_seed(0)
    reference = diffusers.Flux2Transformer2DModel.from_config(config).double()
    model = DiffusersTransformer("flux2", config=config, input_size=(6, 10), in_channels=1, text_len=5, text_dim=32,
                                 guidance=4.0)
    model.transformer.load_state_dict(reference.state_dict())
    parallelize(model.double(), dims=init_sequence_parallel(world, 1))
    g = torch.Generator().manual_seed(1)
    x, text = torch.randn(2, 1, 6, 10, generator=g, dtype=torch.float64), torch.randn(2, 5, 32, generator=g,
                                                                                     dtype=torch.float64)
    patches = Flux2Pipeline._patchify_latents(x)
    call = dict(hidden_states=Flux2Pipeline._pack_latents(patches), encoder_hidden_states=text,
                timestep=torch.tensor([0.03, 0.81], dtype=torch.float64),
                guidance=torch.full((2,), 4.0, dtype=torch.float64), txt_ids=Flux2Pipeline._prepare_text_ids(text),
                img_ids=Flux2Pipeline._prepare_latent_ids(patches), return_dict=False)
    expected = reference(**call)[0]
    # fp64: only the order of the sums differs between one process and the ring (RoPE rounds q, k to fp32 alike)
    assert_same_numbers(model.transformer(**call)[0], expected, atol=1e-11, where="(B, S, 4) ids")
    flat = {**call, "img_ids": call["img_ids"][0], "txt_ids": call["txt_ids"][0]}
    assert_same_numbers(model.transformer(**flat)[0], expected, atol=1e-11, where="(S, 4) ids")


def test_flux2_takes_the_pipelines_3d_ids_at_ring_2():
    run_ranks(check_flux2_pipeline_ids, 2)



# ---- the launchers: one run folder per job ---------------------------------------------------------------------------


def test_the_ranks_of_a_torchrun_or_srun_job_share_one_run_folder(monkeypatch):
    """Each torchrun / srun rank composes the config itself: the folder's name is the job's, not a time and a random
    id per process (which scattered a run, and an FSDP checkpoint, over one folder per rank)."""
    from ringdit.commands.cli import run_name

    for name in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    alone = {run_name() for _ in range(3)}
    assert len(alone) == 3 and all(re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_[0-9a-f]{6}", n) for n in alone)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "4f1c")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert run_name() == run_name() == "torchrun-4f1c"
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: its own folder as usual
    assert run_name() != run_name()
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    monkeypatch.setenv("SLURM_STEP_ID", "2")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    assert run_name() == "slurm-1234.2"


# ---- values a sweep of every new setting found: each one line -------------------------------------------------------


def test_json_with_a_lone_surrogate_escape_is_refused():
    """``"\\ud800"`` is JSON, but no character: a tokenizer or a file writer would fail on it far from the file."""
    from ringdit.common.safe_json import parse_json

    with pytest.raises(ConfigError, match=r"prompts.jsonl line 1 is not valid JSON \(a lone UTF-16 surrogate escape "
                                          r"'\\ud800' is no character\); give"):
        parse_json('{"prompt": "a \\ud800 cat"}', "prompts.jsonl line 1", fix="give UTF-8 text")
    assert parse_json('{"prompt": "a \\ud83d\\ude00 cat"}', "x", fix="") == {"prompt": "a \U0001F600 cat"}


def test_images_of_more_than_8_bits_are_named_not_whitened(tmp_path):
    """Pillow's convert("RGB") clips a 16-bit or float image to white / black: such a file is unreadable, named."""
    from ringdit.media.frames import UnreadableImage, read_image

    deep = tmp_path / "deep.png"
    Image.fromarray(np.full((8, 8), 40_000, dtype=np.uint16)).save(deep)
    with pytest.raises(UnreadableImage, match=rf"{deep} is a 16-bit image \(Pillow mode I;16\), not a readable 8-bit "
                                              r"one .*save it as an 8-bit PNG / JPEG"):
        read_image(deep, 8, 8)
    flat = tmp_path / "flat.png"
    Image.fromarray(np.full((8, 8, 3), 200, dtype=np.uint8)).save(flat)
    assert read_image(flat, 8, 8).shape == (3, 8, 8)


def test_bucket_settings_out_of_range_are_named():
    from ringdit.media.buckets import allowed_frames, size_pair

    with pytest.raises(ConfigError, match=r"frame_buckets: inf is not a frame count the VAE encodes .*use e.g. 5"):
        allowed_frames(17, 4, [float("inf")])
    with pytest.raises(ConfigError, match=r"size=480832: 480832 pixels on a side is more than 16384; give "
                                          r"\[H, W\], e.g. size=\[480,832\]"):
        size_pair(480832)
    assert size_pair("480x832") == (480, 832)


def test_prepare_refuses_a_device_it_cannot_encode_on(models, tmp_path):
    from ringdit.media.encode_folder import encode_folder

    clips = tmp_path / "clips"
    clips.mkdir()
    write_video(clips / "a.mp4", frames=5, size=(16, 16))
    (clips / "a.txt").write_text("a cat")
    for device, message in (("meta", r"device=meta holds no data, so nothing can be encoded on it; use device=cpu"),
                            ("cuda:7", r"device=cuda:7: this machine has .*; use device=cpu or an index it has"),
                            ("gpu0", r"device='gpu0' is not a torch device")):
        with pytest.raises(ConfigError, match=message):
            encode_folder(str(clips), str(tmp_path / "out"), str(models["wan"]), str(models["wan"]), device=device)
    assert not (tmp_path / "out").exists()


def test_metadata_lines_go_through_the_json_guard(tmp_path):
    from ringdit.media.folder import list_media

    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    (tmp_path / "metadata.jsonl").write_text('{"file_name": "a.png", "text": "a cat"}\n' + "[" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=r"metadata.jsonl row 2 is not valid JSON \(nested too deeply: '\[\[\[.*"
                                          r"each line is one object like"):
        list_media(tmp_path)


def test_outputs_that_are_not_regular_files_are_never_replaced(tiny_checkpoint, tmp_path, capsys):
    """A FIFO or a device given as out= (as root a rename would replace /dev/null itself), and calibrate's out= that
    holds an earlier fit: refused before any work, the file left as it was."""
    from ringdit.common.atomic import atomic_write
    from ringdit.caching.calibrate import main
    from ringdit.checkpoints.location import CheckpointError, checked_output

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(FileExistsError, match=rf"{fifo} exists and is not a regular file"):
        with atomic_write(fifo):
            pass
    assert fifo.is_fifo()
    with pytest.raises(CheckpointError, match=r"out=/dev/null is not a regular file or folder \(a device or pipe\)"):
        checked_output("/dev/null", folder=False, what="export", overwrite=True)
    earlier = tmp_path / "teacache.json"
    earlier.write_text('{"coefficients": [1.0, 0.0]}')
    code, err = command(main, ["calibrate", f"ckpt_path={tiny_checkpoint}", f"out={earlier}"], capsys)
    assert code == 2 and re.search(r"out=.*teacache.json exists.*overwrite=true", err), err
    assert earlier.read_text() == '{"coefficients": [1.0, 0.0]}'


def test_a_teacache_file_fitted_to_another_model_is_refused(tmp_path):
    """calibrate records the model it fitted (family, width, depth); the file beside a checkpoint of another model
    is named, not used."""
    from ringdit.caching.cache_settings import read_coefficients

    fitted = tmp_path / "teacache.json"
    fitted.write_text(json.dumps({"coefficients": [1.0, 0.5], "model": ["dit", 64, 4]}))
    assert read_coefficients("f", str(fitted), fingerprint=("dit", 64, 4)) == (1.0, 0.5)
    with pytest.raises(ConfigError, match=r"was fitted to another model \(\['dit', 64, 4\]: family, width, depth\), "
                                          r"not this one \(\['dit', 32, 2\]\); calibrate this checkpoint"):
        read_coefficients("f", str(fitted), fingerprint=("dit", 32, 2))


def test_prepare_that_prepares_nothing_fails(models, tmp_path, capsys):
    """Every file unreadable: the summary, as an error (exit 2), not "prepared 0 samples" and exit 0."""
    from ringdit.prepare import main

    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "broken.png").write_bytes(b"not a png at all")
    (folder / "broken.txt").write_text("a broken file")
    with pytest.raises(SystemExit) as stop:
        main([f"input={folder}", f"out={tmp_path / 'out'}", f"vae={models['flux']}", f"text_encoder={models['flux']}",
              "size=16", "max_text_len=8"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and re.search(rf"Error: input={folder}: nothing was prepared -- prepared 0 samples .*"
                                              rf"skipped 1 unreadable files \({folder / 'broken.png'}\)", err), err


def test_vae_tiles_smaller_than_two_latent_cells_are_named(models):
    """diffusers' tiles are whole latent cells blended over a quarter of one: a smaller tile divides by zero."""
    from ringdit.media.vae import VAE

    for tile in (2, 3):  # the tiny AutoencoderKL: 2-pixel latent cells
        with pytest.raises(ConfigError, match=rf"vae_tile={tile}: the VAE's tiles are whole 2-pixel latent cells, at "
                                              r"least 2 of them; use a multiple of 2 from 4, e.g. vae_tile=256"):
            VAE(models["flux"], tile=tile, tile_setting="vae_tile")
    assert VAE(models["flux"], tile=4).spatial == 2


def test_infer_output_settings_are_checked_without_a_vae(tiny_checkpoint, tmp_path):
    """fps and vae_tile are checked although this checkpoint has no VAE to use them; guidance= on a model without a
    guidance embedding is refused, not ignored."""
    common = [f"ckpt_path={tiny_checkpoint}", f"hydra.run.dir={tmp_path}"]
    for setting, message in (("fps=0", r"fps must be a positive integer, got 0"),
                             ("vae_tile=-8", r"vae_tile must be a positive integer, got -8; the VAE's spatial tile"),
                             ("model.guidance=3.5",
                              r"guidance=3.5 is the guidance embedding's value of a guidance-distilled "
                                              r"model \(Flux-dev\); the DiT has none")):
        assert_refused(fail_fast("infer.py", *common, setting)[0], message)


def test_guidance_on_a_diffusers_model_without_the_embedding_is_refused():
    """Wan and FLUX.1-schnell-like models have no guidance embedding; FLUX.2's class has one by default."""
    from ringdit.spec.diffusion import check_sampling

    flow = {"_target_": "ringdit.diffusion.objectives.FlowMatching"}
    DIFFUSERS = {"_target_": "ringdit.models.diffusers.DiffusersTransformer"}
    with pytest.raises(ConfigError, match=r"guidance=3.5 is the guidance embedding's value .*but this wan model has "
                                          r"none \(guidance_embeds\) and would ignore it"):
        check_sampling({**DIFFUSERS, "family": "wan", "config": {"num_layers": 2}}, flow, {"guidance": 3.5})
    check_sampling({**DIFFUSERS, "family": "flux2", "config": {"num_layers": 1}}, flow, {"guidance": 3.5})
    check_sampling({**DIFFUSERS, "family": "flux", "config": {"guidance_embeds": True}}, flow, {"guidance": 3.5})
    check_sampling({**DIFFUSERS, "family": "wan", "pretrained": "/models/Wan"}, flow, {"guidance": 3.5})  # read when built


def test_the_planner_refuses_lora_targets_that_match_nothing(capsys):
    """Training would refuse them; a plan that left the adapters out would quote memory for another run."""
    from ringdit.plan import main as plan

    common = ["model=wan_tiny", "data.frames=5", "data.size=[16,16]", "gpus=2", "lora.rank=4"]
    assert plan([*common, "lora.targets=[nothing_here]"]) == 2
    assert re.search(r"Error: lora.targets=\['nothing_here'\] match no linear layer of DiffusersTransformer; name "
                     r"linear layers by their path suffix, e.g. \[.*'to_k'", capsys.readouterr().err)
    assert plan([*common, "lora.targets=[to_q]"]) == 0


def test_a_vae_whose_statistics_do_not_match_its_channels_is_named(tmp_path):
    """A Wan VAE saved with z_dim=4 but the default 16 latents_mean values (diffusers' pipelines fail on it too):
    one line naming the folder's config.json, not a reshape error."""
    from diffusers import AutoencoderKLWan

    from ringdit.media.vae import VAE

    AutoencoderKLWan(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                     temperal_downsample=[False, True, True]).save_pretrained(tmp_path / "vae")
    with pytest.raises(ConfigError, match=rf"vae={tmp_path}: {tmp_path / 'vae' / 'config.json'}: latents_mean / "
                                          r"latents_std hold 16 / 16 values for 4 latent channels"):
        VAE(tmp_path)
