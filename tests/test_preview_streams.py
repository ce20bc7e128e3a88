"""A preview's cost counts every token of its samples' sequence as the planner does (``python -m ringdit.plan``):
Qwen-Image-Edit's reference image, packed after the image's tokens (``Family.stream_tokens``), with the image's; Wan
VACE's control video where the planner counts it (its VACE blocks, in the model's depth)."""

from __future__ import annotations

import re

import pytest

from ringdit.commands.cli import command_config
from ringdit.common.errors import ConfigError
from ringdit.plan.shapes import planned_model
from ringdit.spec import TrainSpec

# 8 x 8 latents (synthetic data; the planner's data.latent=false sizes): Qwen-Image-Edit's 4 x 4 image tokens and as
# many of its reference; Wan VACE's 3 x 4 x 4 video tokens, its control as many through the VACE blocks
MODELS = {"qwenimage_edit": (["model=qwenimage_edit_tiny", "data.size=8"],
                             ["data.frames=0", "data.channels=4", "data.text_dim=16", "data.reference=true"], 32),
          "wan_vace": (["model=wan_vace_tiny", "data.size=8", "data.frames=3"], ["data.control=72"], 48)}


@pytest.mark.parametrize("name", MODELS)
def test_a_preview_counts_the_tokens_the_planner_counts(name, tmp_path):
    """A preview of a million samples a row in one forward is refused naming its tokens per sample: the planner's for
    the same model and shape (the edit model's twice its image's); with the micro-batch it advises, the run's
    settings pass."""
    model, data, tokens = MODELS[name]
    plan = [word.replace("data.size=8", "data.size=[8,8]") for word in model]  # the planner's [H, W]
    size, line = planned_model(command_config("plan", [*plan, "data.latent=false"], run_dir="unused"))
    assert size.tokens == tokens, line
    train = ["data=synthetic_text_latents", *model, *data, "trainer=cpu", "dp_degree=1",
             "callbacks.sample_grid.per_class=1000000", f"hydra.run.dir={tmp_path}"]
    with pytest.raises(ConfigError, match=rf"callbacks.sample_grid.batch_size=null: a preview forward of \d+ rows x "
                                          rf"{tokens} tokens needs") as refusal:
        TrainSpec.from_config(command_config("train", train, run_dir=tmp_path))
    fits = re.search(r"set callbacks.sample_grid.batch_size=(\d+)", str(refusal.value)).group(1)
    TrainSpec.from_config(command_config("train", [*train, f"callbacks.sample_grid.batch_size={fits}"],
                                         run_dir=tmp_path))
