"""``build_model``: the one way a model is made ready to train or sample, in torchtitan's order.

build -> parallelize -> load -> LoRA -> EMA -> shard -> compile. The Lightning module, the benchmarks and the tests all
call it; each step sees the model the previous one left:

- **build**: the config's ``_target_`` on the current device (``torch.device("meta")`` around it: shapes only);
- **parallelize**: the model's ``ParallelPlan`` over the mesh ``dims`` with the attention ``backend`` (the layers
  check heads and ring capability here);
- **load**: ``init_from`` (a ringdit checkpoint or export, or a diffusers folder), then the empty prompt's
  embedding of a text-conditioned model;
- **LoRA**: adapters on the loaded weights, everything else frozen;
- **EMA**: a copy of the parallel model, averaged while training (``ema_decay``; None: no EMA);
- **shard**: FSDP2 over the model and its EMA alike (``shard``: the strategy's ``shard_model``);
- **compile**: regional ``torch.compile`` of each repeated block, communication kept eager.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import hydra
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from ringdit.attention import AttentionBackend, USPAttention
from ringdit.checkpoints.fit import load_model_weights
from ringdit.checkpoints.layout import is_sharded_checkpoint
from ringdit.lora import add_lora, lora_enabled
from ringdit.models.parallelize import parallelize, repeated_blocks
from ringdit.parallel import ParallelDims
from ringdit.ema import averaged_copy

Tensor = torch.Tensor


def build_model(
    config: dict,
    *,
    dims: ParallelDims | None = None,
    backend: str | AttentionBackend | None = None,
    init_from: str | None = None,
    init_weights: str = "ema",
    resize_labels: bool = False,
    null_condition: dict[str, Tensor] | None = None,
    lora: dict | None = None,
    ema_decay: float | None = None,
    shard: Callable[[nn.Module], nn.Module] | None = None,
    compile: bool = False,
) -> tuple[nn.Module, AveragedModel | None]:
    """``(model, ema)`` for the model ``config`` (a dict with ``_target_``); the steps are the module docstring's."""
    model = hydra.utils.instantiate(config)
    parallelize(model, model.parallel_plan, dims, backend)
    if torch.empty(0).device.type == "meta":  # a config-time check: nothing to load, nothing runs
        return model, None
    if init_from and Path(init_from).is_dir() and not is_sharded_checkpoint(init_from):  # a diffusers folder
        model.load_pretrained_weights(init_from)
    elif init_from:  # a ringdit .ckpt (a file, or an FSDP run's sharded folder) or a .safetensors export
        load_model_weights(model, init_from, prefer=init_weights, resize_labels=resize_labels)
    if null_condition is not None:  # the condition drop's replacement and the default negative prompt
        model.set_null_condition(null_condition)
    if lora_enabled(lora):  # only the adapters train and are saved; the base comes from init_from
        add_lora(model, **lora)
    ema = averaged_copy(model, ema_decay) if ema_decay is not None else None
    if shard is not None:  # FSDP: the EMA is sharded like the model (its update is a per-shard lerp)
        shard(model)
        if ema is not None:
            shard(ema.module)
    if compile:
        compile_blocks(model)
    return model, ema


def compile_blocks(model: nn.Module) -> None:
    """Regional compilation: one graph per repeated block of the plan, reused by all blocks (what diffusers'
    ``compile_repeated_blocks`` does); the sharded attention paths stay eager, outside the graphs."""
    for layer in model.modules():
        if isinstance(layer, USPAttention):
            layer.keep_communication_eager()
    for block in repeated_blocks(model):
        block.compile()
