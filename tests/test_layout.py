"""``ringdit.parallel.layout.Layout``: the one model of a run's layout, read once from the config -- the strategy known by its
class, never its name -- and what the strategy set-up, the memory estimate and the planner take."""

from __future__ import annotations

import pytest

from ringdit.common.errors import ConfigError
from ringdit.parallel.layout import Layout
from ringdit.training import RingDDPStrategy, RingFSDPStrategy
from tests.helpers import compose_train


class ShardedDDPNamed(RingFSDPStrategy):
    """A subclass whose name says DDP: what it declares (FSDP's ``layout_strategy``, inherited) decides."""


def test_the_layout_knows_the_strategy_by_its_class(tmp_path):
    from ringdit.training.run import strategy_layout

    ddp = Layout.from_config(compose_train([], tmp_path), training=True)
    assert (ddp.strategy, ddp.shard_degree, ddp.ranks, ddp.world_size) == ("ddp", 1, 1, 1)
    assert strategy_layout(ddp) == {"ring_degree": 1, "ulysses_degree": 1, "cfg_parallel": False}
    fsdp = Layout.from_config(compose_train(["trainer/strategy=fsdp", "dp_degree=2", "ring_degree=2",
                                             "trainer.strategy.replicate_degree=2", "trainer.strategy.cpu_offload=true"],
                                            tmp_path), training=True)
    assert (fsdp.strategy, fsdp.ranks, fsdp.shard_degree, fsdp.cpu_offload) == ("fsdp", 4, 2, True)
    assert strategy_layout(fsdp) == {"ring_degree": 2, "ulysses_degree": 1, "cfg_parallel": False,
                                     "replicate_degree": 2, "cpu_offload": True}
    subclass = Layout.from_config(compose_train(["trainer/strategy=fsdp",
                                                 f"trainer.strategy._target_={__name__}.ShardedDDPNamed"], tmp_path),
                                  training=True)
    assert subclass.strategy == "fsdp"
    assert (RingDDPStrategy.layout_strategy, RingFSDPStrategy.layout_strategy) == ("ddp", "fsdp")


@pytest.mark.parametrize("target, message", [
    ("torch.nn.Linear", "trainer.strategy._target_='torch.nn.Linear' is not a ringdit strategy (it declares no "
                        "layout_strategy of ddp | fsdp): use trainer/strategy=ddp (ringdit.training.RingDDPStrategy) "
                        "or trainer/strategy=fsdp (ringdit.training.RingFSDPStrategy), or a subclass of one of them"),
    ("lightning.pytorch.strategies.DDPStrategy", "'lightning.pytorch.strategies.DDPStrategy' is not a ringdit strategy"),
    ("ringdit.training.NoSuchStrategy", "trainer.strategy._target_='ringdit.training.NoSuchStrategy' cannot be imported"),
])
def test_an_unknown_strategy_class_is_refused_in_one_line(target, message, tmp_path):
    with pytest.raises(ConfigError) as error:
        Layout.from_config(compose_train([f"trainer.strategy._target_={target}"], tmp_path), training=True)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_planned_layout_is_built_from_its_degrees():
    layout = Layout(dp_degree=2, ring_degree=4, strategy="fsdp", replicate_degree=2)
    assert (layout.ranks, layout.devices, layout.num_nodes, layout.sp_degree, layout.shard_degree) == (8, 8, 1, 4, 4)
    assert Layout(dp_degree=4, num_nodes=2).devices == 2
    with pytest.raises(ValueError, match="strategy must be one of ddp | fsdp, got 'zero'"):
        Layout(strategy="zero")
