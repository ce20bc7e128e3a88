"""``ringdit.parallel.layout.Layout``: the one model of a run's layout, read once from the config -- the strategy known by its
class, never its name -- and what the strategy set-up, the memory estimate and the planner take."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from ringdit.common.errors import ConfigError
from ringdit.parallel import init_sequence_parallel
from ringdit.parallel.layout import Layout
from ringdit.training import RingDDPStrategy, RingFSDPStrategy
from ringdit.training.parallel_strategy import build_strategy
from tests.helpers import compose_train


class ShardedDDPNamed(RingFSDPStrategy):
    """A subclass whose name says DDP: what it declares (FSDP's ``layout_strategy``, inherited) decides."""


def test_the_layout_knows_the_strategy_by_its_class(tmp_path):
    ddp_cfg = compose_train([], tmp_path)
    ddp = Layout.from_config(ddp_cfg, training=True)
    assert (ddp.strategy, ddp.shard_degree, ddp.ranks, ddp.world_size) == ("ddp", 1, 1, 1)
    fsdp_cfg = compose_train(["trainer/strategy=fsdp", "dp_degree=2", "ring_degree=2",
                              "trainer.strategy.replicate_degree=2", "trainer.strategy.cpu_offload=true"], tmp_path)
    fsdp = Layout.from_config(fsdp_cfg, training=True)
    assert (fsdp.strategy, fsdp.ranks, fsdp.shard_degree, fsdp.cpu_offload) == ("fsdp", 4, 2, True)
    # the strategy takes the layout whole (it builds the mesh), none of its settings one by one
    for cfg, layout, kind in ((ddp_cfg, ddp, RingDDPStrategy), (fsdp_cfg, fsdp, RingFSDPStrategy)):
        strategy = build_strategy(OmegaConf.to_container(cfg.trainer.strategy, resolve=True), layout)
        assert type(strategy) is kind and strategy.layout is layout
        assert not {"ring_degree", "ulysses_degree", "cfg_parallel", "replicate_degree"} & set(vars(strategy))
    assert strategy.cpu_offload is True and strategy.reduce_dtype is not None
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


def _check_layout_builds_the_mesh(rank, world):
    import torch.distributed as dist

    layout = Layout(dp_degree=2, ring_degree=2, strategy="fsdp", replicate_degree=2, cfg_parallel=True,
                    device_type="cpu")
    dims = layout.build_mesh("cpu")
    expected = init_sequence_parallel(2, 1, cfg_parallel=True)  # the same degrees given one by one
    fields = ("ring_degree", "ulysses_degree", "dp_degree", "rank", "dp_rank", "sp_rank", "ring_rank", "ring_ranks",
              "cfg_rank")
    assert [getattr(dims, f) for f in fields] == [getattr(expected, f) for f in fields]
    assert (dims.dp_degree, dims.sp_degree, dims.data_parallel) == (2, 2, (0, 1))  # a CFG pair shares its samples
    assert dist.get_process_group_ranks(dims.ring_group) == dist.get_process_group_ranks(expected.ring_group)
    assert dist.get_process_group_ranks(dims.cfg_group) == dist.get_process_group_ranks(expected.cfg_group)
    shard = layout.build_shard_mesh("cpu")  # HSDP: 2 replicas of 2-rank shard groups, contiguous
    assert shard.mesh_dim_names == ("replicate", "shard") and shard.mesh.tolist() == [[0, 1], [2, 3]]


def test_the_layout_builds_the_mesh_on_four_ranks():
    """``Layout.build_mesh`` (what the strategies call) gives each rank the ``ParallelDims`` of its degrees."""
    from tests.distributed import run_ranks

    run_ranks(_check_layout_builds_the_mesh, 4)
