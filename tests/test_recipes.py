"""The real-model recipes (conf/experiment/<model>_<task>.yaml): each composes, its header's planner command builds
the model on the meta device at the recipe's real shapes and recommends the layout the recipe sets (so the memory it
quotes is the planner's), and its tiny twin -- the same settings on the family's tiny architecture and synthetic
latents, on one process -- trains a few steps."""

from __future__ import annotations

import contextlib
import io
import re
import shlex

import pytest
from hydra import compose, initialize_config_dir

from ringdit.cli import CONF_DIR, register_resolvers
from tests.helpers import fail_fast

# recipe -> its tiny twin: the family's tiny architecture and synthetic latents it reads (one process, CPU)
IMAGES = ["data.frames=0", "data.channels=1"]
TWINS = {
    "wan21_1_3b_lora": ["model=wan_tiny"],
    "wan21_1_3b_full": ["model=wan_tiny"],
    "wan21_14b_lora": ["model=wan_tiny"],
    "wan21_14b_full": ["model=wan_tiny"],
    "wan22_ti2v_5b_lora": ["model=wan22_ti2v_tiny", "data.image=true"],
    "wan22_a14b_t2v_lora": ["model=wan22_a14b_tiny"],
    "wan22_a14b_i2v_lora": ["model=wan22_i2v_a14b_tiny", "data.image=true"],
    "hunyuan_video15_t2v_lora": ["model=hunyuan_video15_tiny"],
    "hunyuan_video15_i2v_lora": ["model=hunyuan_video15_i2v_tiny", "data.image=true", "data.image_dim=12"],
    "ltx_video_lora": ["model=ltx_video_tiny"],
    "skyreels_v2_lora": ["model=skyreels_v2_tiny"],
    "flux_dev_lora": ["model=flux_tiny", *IMAGES, "data.text_dim=32", "data.pooled_dim=32",
                      "model.config.guidance_embeds=true"],  # FLUX.1-dev is guidance-distilled, the tiny one not
    "flux2_lora": ["model=flux2_tiny", *IMAGES, "data.text_dim=32", "lora.base_dtype=null"],
    "qwenimage_lora": ["model=qwenimage_tiny", "data.frames=0", "data.channels=4", "data.text_dim=16"],
}


def recipe_header(name: str) -> tuple[list[str], dict]:
    """The planner command a recipe's header quotes, and the layout it says the planner recommends."""
    text = (CONF_DIR / "experiment" / f"{name}.yaml").read_text()
    command = re.search(r"# Layout: `python -m ringdit\.plan ([^`]+)` recommends (dp=\d+ ring=\d+ ulysses=\d+ \w+)",
                        text)
    assert command, f"{name}.yaml quotes no planner command"
    return shlex.split(command.group(1)), dict(pair.split("=") for pair in command.group(2).split()[:3]) | {
        "strategy": command.group(2).split()[3]}


def test_every_real_model_has_a_recipe_with_sources():
    assert sorted(TWINS) == sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")
                                   if "Sources of the settings" in p.read_text())


@pytest.mark.parametrize("name", sorted(TWINS))
def test_a_recipe_is_laid_out_as_the_planner_recommends(name, capsys):
    """The header's planner command recommends the layout the recipe sets, and the model builds at real shapes."""
    from ringdit.plan import main as plan

    arguments, quoted = recipe_header(name)
    assert plan(arguments) == 0
    printed = capsys.readouterr().out
    recommended = re.search(r"^Recommended: dp=(\d+) ring=(\d+) ulysses=(\d+) (\w+)", printed, re.M)
    assert recommended, printed[-2000:]
    dp, ring, ulysses, strategy = recommended.groups()
    assert {"dp": dp, "ring": ring, "ulysses": ulysses, "strategy": strategy} == quoted
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={name}"])
    assert (cfg.dp_degree, cfg.ring_degree, cfg.ulysses_degree) == (int(dp), int(ring), int(ulysses))
    assert cfg.trainer.strategy._target_.lower().endswith(f"{strategy}strategy")


@pytest.mark.parametrize("name", sorted(TWINS))
def test_a_recipes_tiny_twin_trains(name, tmp_path):
    """The recipe's optimizer, schedule, time sampling, LoRA and sampler settings on its tiny architecture: two
    optimizer steps on one CPU process (activation checkpointing kept where the recipe sets it)."""
    with contextlib.redirect_stdout(io.StringIO()):
        proc, _ = fail_fast("train.py", f"experiment={name}", "data=synthetic_text_latents", *TWINS[name],
                            "data.num_samples=8", "trainer=cpu",
                            "dp_degree=1", "ring_degree=1", "ulysses_degree=1", "trainer.max_steps=2", "logger=csv",
                            "callbacks=none", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "csv" / "metrics.csv").read_text().count("\n") >= 2
