"""Fixtures shared by the test modules (helpers without pytest's injection are in helpers.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import LAUNCH_VARIABLES, TINY, WORDS, run


def _share_the_cores() -> None:
    """Each pytest-xdist worker computes on its share of the cores (2 workers on 2 cores: one thread each), and so do
    the runs it starts (OMP_NUM_THREADS, which Lightning and torch read). Two workers with a two-thread pool each on
    two cores spin at every parallel region's barrier waiting for a descheduled thread: measured 2.4x slower for the
    same tests (the diffusers-model, joint-attention and original-DDPM modules: 224 s against 92 s, with -n 2 on a
    loaded 2-core machine). A thread count the user set is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


_share_the_cores()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items) -> None:
    """The suite runs on pytest-xdist workers (``-n 2 --dist loadgroup`` in pyproject's addopts): each test goes to
    whichever worker is free, except that the tests of a module sharing a module-scoped fixture (a trained run, a
    checkpoint: the costly part) form one group on one worker, so the fixture is built once."""
    for item in items:
        if any(defs[-1].scope == "module" for defs in item._fixtureinfo.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.fixture(autouse=True)
def launcher_environment_restored():
    """Each test starts with the worker's own environment: a run in this process that Lightning launched leaves
    LOCAL_RANK, NODE_RANK and MASTER_* behind (its teardown removes only WORLD_SIZE), which the next train.py this
    worker starts would take for one rank of an external launch."""
    saved = {name: os.environ.get(name) for name in LAUNCH_VARIABLES}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("tiny")
    run("train.py", run_dir, *TINY, "trainer.max_steps=1")
    return run_dir / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A pipeline-shaped folder (vae/, text_encoder/, tokenizer/) per VAE kind, as Wan's and Flux's repos are."""
    from diffusers import AutoencoderKL, AutoencoderKLWan
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from ringdit.media.text import word_level_tokenizer

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("models")
    fast = word_level_tokenizer(WORDS)
    AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                     temperal_downsample=[False, True, True]).save_pretrained(root / "wan" / "vae")
    AutoencoderKL(block_out_channels=[8, 8], down_block_types=["DownEncoderBlock2D"] * 2,
                  up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4, norm_num_groups=4,
                  scaling_factor=0.5, shift_factor=0.1).save_pretrained(root / "flux" / "vae")
    T5EncoderModel(T5Config(vocab_size=len(WORDS), d_model=16, d_ff=32, d_kv=4, num_layers=1, num_heads=2)
                   ).save_pretrained(root / "wan" / "text_encoder")
    CLIPTextModel(CLIPTextConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=1,
                                 pad_token_id=0)).save_pretrained(root / "flux" / "text_encoder")
    for name in ("wan", "flux"):
        fast.save_pretrained(root / name / "tokenizer")
    (root / "not_a_vae").mkdir()
    return {"wan": root / "wan", "flux": root / "flux", "not_a_vae": root / "not_a_vae"}


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory) -> Path:
    """A pipeline-shaped CLIP: image_encoder/ (a tiny random CLIPVisionModel, 2 layers so that the penultimate
    hidden states are not the last) and image_processor/ (224 -> 32 px)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("clip")
    CLIPVisionModel(CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     image_size=32, patch_size=8)).save_pretrained(root / "image_encoder")
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        root / "image_processor")
    return root


@pytest.fixture(scope="session")
def wan_pipeline_folder(tmp_path_factory) -> Path:
    """A tiny two-expert WanPipeline folder (T5 encoder, word-level tokenizer, 16-channel Wan VAE, UniPC), as
    diffusers' save_pretrained writes it; read only (a test that changes it changes a copy), so built once."""
    from tests.helpers import architecture, tiny_wan_pipeline

    root = tmp_path_factory.mktemp("pipeline") / "Wan-tiny"
    torch.manual_seed(0)
    tiny_wan_pipeline({**architecture("wan22_a14b_tiny"), "in_channels": 16, "out_channels": 16}, z_dim=16
                      ).save_pretrained(root)
    return root
