"""What every diffusers family's tests check through ``train.py``: the same SGD steps on one process and on a ring of
2, and bad input refused in one line before any rank is spawned (as tests/test_diffusers_training.py does for Wan);
and each family's ``train.py`` overrides for those SGD steps (FLUX2, HUNYUAN, LTX, LTX2, SKYREELS,
MINIMAX; ``family_runs``), which tests/test_fsdp.py and tests/test_lora.py train too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import logged_losses, prepare_train, run


FLUX2 = ["experiment=flux2_tiny", "data.num_samples=16", "data.batch_size=2", "trainer.max_steps=2", "logger=csv",
         "scheduler=constant", "optimizer=sgd", "optimizer.lr=0.5", "trainer.val_check_interval=2",
         "callbacks.model_checkpoint.every_n_train_steps=2", "callbacks.sample_grid.steps=2",
         "data.size=6", "data.text_len=5"]  # 9 image and 5 text tokens: both padded on a ring of 2


HUNYUAN = ["experiment=hunyuan_video15_tiny", "data.num_samples=16", "data.batch_size=2", "trainer.max_steps=3",
           "logger=csv", "scheduler=constant", "optimizer=sgd", "optimizer.lr=0.5",
           "callbacks.model_checkpoint.every_n_train_steps=3", "trainer.val_check_interval=3", "data.size=4"]


LTX = ["model=ltx_video_tiny", "data=synthetic_text_latents", "data.num_samples=32", "data.batch_size=4",
       "trainer.max_steps=2", "logger=csv", "scheduler=constant", "optimizer=sgd", "optimizer.lr=0.5",
       "trainer.val_check_interval=2", "diffusion.objective.shift=3.0", "callbacks.sample_grid.steps=2"]


LTX2 = ["model=ltx2_tiny", "data=synthetic_text_latents", "data.audio=[2,5,2]", "data.num_samples=32",
        "data.batch_size=4", "trainer.max_steps=2", "logger=csv", "scheduler=constant", "optimizer=sgd",
        "optimizer.lr=0.5", "trainer.val_check_interval=2", "callbacks.sample_grid.steps=2"]  # video and audio


SKYREELS = ["model=skyreels_v2_tiny", "data=synthetic_text_latents", "data.num_samples=32", "data.batch_size=4",
            "trainer.max_steps=2", "logger=csv", "scheduler=constant", "optimizer=sgd", "optimizer.lr=0.5",
            "trainer.val_check_interval=2", "diffusion.objective.shift=3.0", "callbacks.sample_grid.steps=2"]


MINIMAX = ["model=minimax_h3_tiny", "data=synthetic_text_latents", "data.audio=[2,3,8]", "data.num_samples=16",
           "data.batch_size=2", "data.frames=3", "data.size=6", "trainer.max_steps=2", "logger=csv",
           "scheduler=constant", "optimizer=sgd", "optimizer.lr=0.5", "trainer.val_check_interval=2",
           "callbacks.sample_grid.steps=2"]  # one packed sequence of text, stereo audio and video rows


def assert_sgd_steps_equal_one_process_and_ring2(tmp_path: Path, overrides: list[str], steps: int,
                                                 synthetic: bool = True) -> None:
    """fp32: a ring reorders sums only (tests/test_diffusers_training.py reasons the tolerance). The runs are left in
    ``tmp_path / "ring1"`` and ``tmp_path / "ring2"``; ``synthetic``: the overrides' data=synthetic_text_latents are
    written once, to ``tmp_path / "data"`` (False: the overrides name their own data, e.g. prepared shards)."""
    data = [f"data.cache_dir={tmp_path / 'data'}"] if synthetic else []
    for name, layout in (("ring1", []), ("ring2", ["ring_degree=2"])):
        run("train.py", tmp_path / name, *overrides, *data, *layout, env={"HF_HUB_OFFLINE": "1"})
    reference, parallel = logged_losses(tmp_path / "ring1"), logged_losses(tmp_path / "ring2")
    assert sorted(reference) == sorted(parallel) == list(range(steps))
    for step in reference:
        assert parallel[step] == pytest.approx(reference[step], rel=1e-5), f"step {step}"


def wan_folder(root: Path) -> Path:
    """A diffusers folder that holds a Wan transformer (its config only): another family's weights."""
    (root / "wan" / "transformer").mkdir(parents=True)
    (root / "wan" / "transformer" / "config.json").write_text('{"_class_name": "WanTransformer3DModel"}')
    return root / "wan"


def assert_refused_before_spawning(tmp_path: Path, overrides: list[str], message: str) -> None:
    """``train.py``'s checks refuse ``overrides`` with ``message`` (a regex), and nothing is written."""
    from hydra.errors import InstantiationException

    with pytest.raises((ValueError, InstantiationException)) as raised:  # what user_errors shows as one line
        prepare_train([*overrides, f"data.cache_dir={tmp_path / 'data'}"], tmp_path / "run")
    assert re.search(message, f"{raised.value} {raised.value.__cause__}"), raised.value
    assert not (tmp_path / "run" / "checkpoints").exists()


def family_runs(family: str) -> tuple[list[str], tuple[int, ...]]:
    """(train.py overrides, the steps they take) of a family's SGD test (its own test module's)."""
    return {"hunyuan_video15": (HUNYUAN, (0, 1, 2)), "ltx_video": (LTX, (0, 1)), "ltx2": (LTX2, (0, 1)),
            "skyreels_v2": (SKYREELS, (0, 1)),
            "minimax_h3": (MINIMAX, (0, 1))}[family]
