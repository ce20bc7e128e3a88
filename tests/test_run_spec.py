"""The spec builds the run: ``TrainSpec`` yields the model's build plan and the memory estimate's ``Setup``, the
training module is made from the spec (``from_spec``) and builds from the same plan, and the strategy takes the
spec's ``Layout`` whole."""

from __future__ import annotations

import pytest

from ringdit.costs import setup_from_config
from ringdit.spec import TrainSpec
from ringdit.training import DiffusionModule
from ringdit.training.run import prepare
from tests.helpers import compose_train

TINY = ["trainer=cpu", "trainer.max_steps=1", "logger=none", "callbacks=none", "data.batch_size=2"]


@pytest.mark.parametrize("overrides", [
    [],
    ["trainer/strategy=fsdp", "ema_decay=null", "lora.rank=4", "trainer.strategy.param_dtype=bfloat16"],
    ["optimizer=sgd", "optimizer.momentum=0.9", "model.activation_checkpointing=0.5", "trainer.precision=64-true"],
    ["optimizer=adamw8bit", "+model.gradient_checkpointing=true"],
])
def test_the_memory_setup_is_the_spec_s_and_the_run_s(overrides, tmp_path):
    """``TrainSpec.memory`` (from the spec's parts: its optimizer, LoRA plan, trainer and layout) counts what the
    composed config says (``setup_from_config``, for callers with a config alone)."""
    cfg = compose_train([*TINY, *overrides], tmp_path)
    spec = TrainSpec.from_config(cfg)
    assert spec.memory == setup_from_config(cfg, spec.layout)
    if "optimizer=sgd" in overrides:
        assert (spec.memory.optimizer_states, spec.memory.optimizer_8bit, spec.memory.precision) == (1, False, "64-true")
    if "optimizer=adamw8bit" in overrides:
        assert (spec.memory.optimizer_states, spec.memory.optimizer_8bit, spec.memory.checkpoint_fraction) == \
            (2, True, 1.0)


def test_the_module_is_made_from_the_spec_and_builds_its_plan(tmp_path):
    cfg = compose_train([*TINY, "lora.rank=2", "ema_decay=0.5", "seed=3", f"paths.output_dir={tmp_path}"], tmp_path)
    trainer, module, datamodule, ckpt_path = prepare(cfg)
    spec = TrainSpec.from_config(cfg)
    assert type(module) is DiffusionModule and module.build_plan == spec.build_plan
    plan = spec.build_plan
    assert (plan.lora["rank"], plan.ema_decay, plan.seed, plan.backend) == (2, 0.5, 3, spec.layout.attention_backend)
    # the strategy holds the layout the spec checked, which builds the mesh
    assert trainer.strategy.layout == spec.layout
    # a module that only samples (no optimizer: a checkpoint loaded for infer.py) keeps the weights as loaded
    sampling = DiffusionModule(model=plan.config, objective=spec.objective, data=spec.data.info, ema_decay=0.5)
    assert sampling.build_plan.ema_decay is None and sampling.build_plan.expert is None
