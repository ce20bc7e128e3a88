"""``RingFSDPStrategy``: parameters, gradients and optimizer state sharded with FSDP2 over the ranks that also
shard the sequence.

Built on Lightning's ``ModelParallelStrategy`` (it launches the processes, builds the optimizer after
``configure_model`` and saves ``torch.distributed.checkpoint`` folders). The sequence-parallel mesh, timeouts,
rendezvous watchdog and data-parallel sampler come from ``SequenceParallelStrategy``; this strategy adds FSDP's
shard mesh, shards the model (``shard_model``, called by ``ringdit.models.build.build_model``) with ``fully_shard`` per
repeated block of its plan and at the root, and writes each checkpoint folder beside the old one before renaming it into place.

Every rank of the world holds 1/world of each parameter (HSDP, ``replicate_degree > 1``: 1/(world / replicate)
within a shard group, the groups replicated). FSDP2's gradient reduce-scatter AVERAGES over all ranks, as DDP's
all-reduce does, and this average is the one-device gradient (see ``DiffusionModule.diffusion_loss``): the
sequence-parallel ranks' partial gradients are summed and the data-parallel replicas averaged.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from ringdit.checkpoints.safe_dcp import SafeFileSystemReader, SafeLoadPlanner
from ringdit.common.atomic import disk_full, disk_full_error
from ringdit.checkpoints.location import SHARDED_METADATA, is_sharded_checkpoint, replace_folder, temporary_folder
from ringdit.checkpoints.loading import safe_torch_load
from ringdit.checkpoints.optimizer_state import optimizer_state_by_name
from ringdit.common.dtypes import dtype_named
from ringdit.common.errors import CheckpointError
from ringdit.models import repeated_blocks
from ringdit.models.protocol import KindDefaults
from ringdit.training.parallel_strategy import SequenceParallelStrategy

# The models' outputs (prediction tokens) are only read out-of-place by the losses and samplers, so the in-place
# hazard this warns about cannot happen.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w+\) returned a view tensor")


class RingFSDPStrategy(SequenceParallelStrategy, ModelParallelStrategy):
    """FSDP2 (``fully_shard``) over all dp x sp ranks, plus the sequence-parallel mesh.

    Args (besides ``SequenceParallelStrategy``'s: the ``layout`` -- whose ``replicate_degree`` (HSDP: shard within
    ``world / replicate_degree`` ranks, replicate across the groups) and ``cpu_offload`` (the sharded parameters,
    gradients and optimizer state in CPU memory) say how it shards --, ``timeout_s``, ``rendezvous_timeout_s``):
        param_dtype: the dtype parameters are gathered and computed in (``bfloat16`` for mixed precision; the
            sharded fp32 master weights and optimizer state stay fp32); null = the parameters' own dtype.
        reduce_dtype: the dtype gradients are reduced in (``float32`` keeps the reduction exact with bf16 compute).
    """

    strategy_name = "ring_fsdp"
    layout_strategy = "fsdp"  # how ringdit.parallel.layout.Layout (and the memory estimate) knows it: sharded state

    def __init__(self, param_dtype: str | None = None, reduce_dtype: str | None = "float32", **kwargs):
        self.param_dtype = None if param_dtype is None else dtype_named("trainer.strategy.param_dtype", param_dtype)
        self.reduce_dtype = None if reduce_dtype is None else dtype_named("trainer.strategy.reduce_dtype", reduce_dtype)
        super().__init__(**kwargs)

    @property
    def cpu_offload(self) -> bool:
        """The layout's: the sharded state in CPU memory (what the model build and the optimizer ask)."""
        return self.layout.cpu_offload

    # ---- processes and meshes ----------------------------------------------------------------------------------
    def _init_process_group(self) -> None:
        self._setup_distributed()  # the device, then the default process group (not ModelParallelStrategy's mesh)

    def setup_environment(self) -> None:
        super().setup_environment()
        # FSDP shards over every rank of the (dp, ring, ulysses) mesh, in global rank order; HSDP splits that into
        # (replicate, shard) with the shard groups contiguous.
        self._device_mesh = self.layout.build_shard_mesh(self.root_device.type, timeout=self._timeout)
        self.lightning_module._device_mesh = self._device_mesh

    # ---- sharding ----------------------------------------------------------------------------------------------
    def shard_model(self, model: nn.Module) -> nn.Module:
        """``fully_shard`` ``model`` over this strategy's mesh with its precision and offload settings."""
        return shard_model(model, self.device_mesh, param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype,
                           cpu_offload=self.cpu_offload)

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Every rank writes its shards into a temporary folder beside ``filepath``; once all are done, rank 0 moves
        it onto ``filepath``. A kill during the save leaves the previous checkpoint as it was (see
        ``replace_folder``)."""
        path = Path(self.broadcast(str(filepath)))
        tmp = Path(self.broadcast(temporary_folder(path) if self.is_global_zero else None))
        try:
            super().save_checkpoint(checkpoint, tmp, storage_options)
        except Exception as error:
            if disk_full(error, tmp):
                raise disk_full_error(path, replaced=f"the previous {path.name}") from error
            raise
        self.barrier("checkpoint_written")
        if self.is_global_zero:
            replace_folder(tmp, path)
        self.barrier("checkpoint_renamed")

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded checkpoint (any world size or layout: torch.distributed.checkpoint reshards), or a single-file
        one saved under DDP: every rank reads the file and keeps its shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(str(checkpoint_path)))
        strict = self.lightning_module.strict_loading
        if is_sharded_checkpoint(path):
            return self._load_sharded(path, strict)
        checkpoint = safe_torch_load(path)
        full = StateDictOptions(full_state_dict=True, strict=strict)
        set_model_state_dict(self.model, checkpoint.pop("state_dict"), options=full)
        names = {param: name for name, param in self.model.named_parameters()}
        for optimizer, state in zip(self.optimizers, checkpoint.pop("optimizer_states", [])):
            order = [names[param] for group in optimizer.param_groups for param in group["params"]]
            set_optimizer_state_dict(self.model, optimizer, optimizer_state_by_name(state, order), options=full)
        return checkpoint

    def _load_sharded(self, path: Path, strict: bool) -> dict[str, Any]:
        """Each rank reads its shards of what the checkpoint holds (a LoRA checkpoint: the adapters only, with
        ``strict_loading`` off); the optimizer state is resharded the same way."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        saved = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
        model_state = get_model_state_dict(self.model)
        missing = [key for key in model_state if f"state_dict.{key}" not in saved]
        if strict and missing:
            raise CheckpointError(f"{path} lacks {len(missing)} weights of this model: {missing[:5]}")
        model_state = {key: value for key, value in model_state.items() if key not in missing}
        dcp.load({"state_dict": model_state}, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner())
        set_model_state_dict(self.model, model_state, options=StateDictOptions(strict=False))
        for index, optimizer in enumerate(self.optimizers):
            state = {f"optimizer_{index}": get_optimizer_state_dict(self.model, optimizer)}
            dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner())
            set_optimizer_state_dict(self.model, optimizer, state[f"optimizer_{index}"])
        return safe_torch_load(path / SHARDED_METADATA)



def shard_model(model: nn.Module, mesh, *, param_dtype=None, reduce_dtype=None, cpu_offload: bool = False) -> nn.Module:
    """``fully_shard`` each repeated block of ``model`` (one all-gather per block), then each expert of a two-expert
    model (its embeddings and output layers: gathered only in the steps it runs), then the root (the rest). On a
    model built on the meta device this only plans the shards; ``ringdit.models.materialize`` allocates them."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    options = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    # a two-expert model's experts; the other modules sharded here (DMD2's GAN head) are no kinds and have none
    experts = model.expert_modules if isinstance(model, KindDefaults) else ()
    for unit in (*repeated_blocks(model), *experts):
        fully_shard(unit, **options)
    fully_shard(model, **options)
    return model
