"""``RingFSDPStrategy``: parameters, gradients and optimizer state sharded with FSDP2 over the ranks that also
shard the sequence.

Built on Lightning's ``ModelParallelStrategy`` (it launches the processes, builds the optimizer after
``configure_model`` and saves ``torch.distributed.checkpoint`` folders); this strategy builds the
``(dp, ring, ulysses)`` device mesh and hands it to the LightningModule, gives data loading the **data-parallel**
rank and size, and shards the model (``shard_model``, called by ``DiTModule.configure_model``) with ``fully_shard``
per repeated block and at the root, over the same mesh flattened.

Every rank of the world holds 1/world of each parameter (HSDP, ``replicate_degree > 1``: 1/(world / replicate)
within a shard group, the groups replicated). FSDP2's gradient reduce-scatter AVERAGES over all ranks, as DDP's
all-reduce does, and ringdit's loss is normalised so that this average is the one-device gradient (see
``ringdit.parallel.sharded_mean``): the sequence-parallel ranks' partial gradients are summed and the
data-parallel replicas averaged.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from ringdit.errors import ConfigError
from ringdit.parallel import ParallelDims, build_shard_mesh, init_sequence_parallel, set_parallel_dims
from ringdit.training.checkpoint_io import optimizer_state_by_name
from ringdit.atomic import file_mode
from ringdit.weights import SHARDED_METADATA, CheckpointError, is_sharded_checkpoint, safe_torch_load

# The models' outputs (prediction tokens) are only read out-of-place by the losses and samplers, so the in-place
# hazard this warns about cannot happen.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w+\) returned a view tensor")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(setting: str, name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise ConfigError(f"{setting}={name!r} is not a dtype ringdit shards with; use one of {sorted(DTYPES)} or null")
    return DTYPES[name]


class RingFSDPStrategy(ModelParallelStrategy):
    """FSDP2 (``fully_shard``) over all dp x sp ranks, plus the sequence-parallel mesh.

    Args:
        ring_degree, ulysses_degree: the sequence-parallel layout (as for ``RingDDPStrategy``).
        replicate_degree: HSDP: shard within ``world / replicate_degree`` ranks, replicate across
            ``replicate_degree`` groups (1 = shard over the whole world).
        param_dtype: the dtype parameters are gathered and computed in (``bfloat16`` for mixed precision; the
            sharded fp32 master weights and optimizer state stay fp32); null = the parameters' own dtype.
        reduce_dtype: the dtype gradients are reduced in (``float32`` keeps the reduction exact with bf16 compute).
        cpu_offload: keep the sharded parameters, gradients and optimizer state in CPU memory (GPU runs).
        timeout_s: a collective that waits longer ends the run with an error instead of hanging.
    """

    strategy_name = "ring_fsdp"

    def __init__(self, ring_degree: int = 1, ulysses_degree: int = 1, replicate_degree: int = 1,
                 param_dtype: str | None = None, reduce_dtype: str | None = "float32", cpu_offload: bool = False,
                 timeout_s: float | None = None, **kwargs):
        # The degrees (replicate_degree too) were validated at config time (ringdit.config.validate_parallel).
        self.param_dtype = _dtype("trainer.strategy.param_dtype", param_dtype)
        self.reduce_dtype = _dtype("trainer.strategy.reduce_dtype", reduce_dtype)
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        super().__init__(**kwargs)
        self.ring_degree, self.ulysses_degree = ring_degree, ulysses_degree
        self.replicate_degree, self.cpu_offload = replicate_degree, cpu_offload
        self.parallel_dims = ParallelDims()

    # ---- processes and meshes ----------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        super(ModelParallelStrategy, self).setup_environment()  # the accelerator's device
        self._setup_distributed()
        self.parallel_dims = init_sequence_parallel(self.ring_degree, self.ulysses_degree, timeout=self._timeout,
                                                    device_type=self.root_device.type)
        # FSDP shards over every rank of the (dp, ring, ulysses) mesh, in global rank order; HSDP splits that into
        # (replicate, shard) with the shard groups contiguous.
        self._device_mesh = build_shard_mesh(self.world_size, self.replicate_degree, self.root_device.type,
                                             self._timeout)
        self.lightning_module._device_mesh = self._device_mesh
        set_parallel_dims(self.lightning_module, self.parallel_dims)

    @property
    def distributed_sampler_kwargs(self) -> dict:
        dims = self.parallel_dims
        return {"num_replicas": dims.dp_degree, "rank": dims.dp_rank}

    # ---- sharding ----------------------------------------------------------------------------------------------
    def shard_model(self, model: nn.Module) -> nn.Module:
        """``fully_shard`` each repeated block of ``model`` (one all-gather per block), then the root (the rest)."""
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )

        options = {
            "mesh": self.device_mesh,
            "mp_policy": MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype),
            "offload_policy": CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy(),
        }
        for block in repeated_blocks(model):
            fully_shard(block, **options)
        fully_shard(model, **options)
        if hasattr(model, "forward_tokens"):  # DiT training calls it instead of forward: gather the root there too
            register_fsdp_forward_method(model, "forward_tokens")
        return model

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Every rank writes its shards into a temporary folder beside ``filepath``; once all are done, rank 0 moves
        it onto ``filepath``. A kill during the save leaves the previous checkpoint as it was (see
        ``replace_folder``)."""
        path = Path(self.broadcast(str(filepath)))
        tmp = Path(self.broadcast(_temporary_folder(path) if self.is_global_zero else None))
        super().save_checkpoint(checkpoint, tmp, storage_options)
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

        from ringdit.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

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


def _temporary_folder(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.chmod(tmp, 0o777 & ~(0o666 & ~file_mode()))  # as mkdir would (umask applied): mkdtemp's 0700 is private
    return tmp


def replace_folder(new: Path, target: Path) -> None:
    """Put the complete folder ``new`` at ``target``. A directory cannot be renamed over another one atomically, so
    the old one is first renamed aside (``.<name>.old``); ``ringdit.weights.recover_checkpoint`` puts it back if a
    kill falls between the two renames. Every step is a rename: ``target`` is never a partly written folder."""
    old = target.with_name(f".{target.name}.old")
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    if old.is_dir():
        shutil.rmtree(old)
    elif old.exists():
        old.unlink()
    for stale in target.parent.glob(f".{target.name}.*.tmp"):  # left by a save that was killed
        shutil.rmtree(stale, ignore_errors=True)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks FSDP shards one by one: a DiT's ``blocks``; for a diffusers model the modules whose
    class diffusers lists in ``_repeated_blocks`` / ``_no_split_modules``."""
    if isinstance(getattr(model, "blocks", None), nn.ModuleList):
        return list(model.blocks)
    transformer = getattr(model, "transformer", model)
    names = set(getattr(transformer, "_repeated_blocks", None) or getattr(transformer, "_no_split_modules", None) or ())
    blocks = [module for module in transformer.modules() if type(module).__name__ in names]
    if not blocks:
        raise ConfigError(f"trainer.strategy=fsdp: found no repeated blocks to shard in {type(model).__name__} "
                          f"(a DiT's blocks, or diffusers' _repeated_blocks / _no_split_modules)")
    return blocks
