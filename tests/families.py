"""What every diffusers family's tests check through ``train.py``: the same SGD steps on one process and on a ring of
2, and bad input refused in one line before any rank is spawned (as tests/test_diffusers_training.py does for Wan)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import logged_losses, run


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

    from tests.test_diffusers_training import prepare_train

    with pytest.raises((ValueError, InstantiationException)) as raised:  # what user_errors shows as one line
        prepare_train([*overrides, f"data.cache_dir={tmp_path / 'data'}"], tmp_path / "run")
    assert re.search(message, f"{raised.value} {raised.value.__cause__}"), raised.value
    assert not (tmp_path / "run" / "checkpoints").exists()
