"""``build_model``: the one way a model is made ready to train or sample, in torchtitan's order.

build -> parallelize -> LoRA -> shard -> materialize (load) -> EMA -> compile. The Lightning module, the benchmarks
and the tests all call it; each step sees the model the previous one left:

- **build**: the config's ``_target_`` with its parameters on the meta device (shapes only, whatever the size;
  ``ringdit.models.materialize``);
- **parallelize**: the model's ``ParallelPlan`` over the mesh ``dims`` with the attention ``backend`` (the layers
  check heads and ring capability here);
- **LoRA**: adapters on the frozen base layers; a two-expert model training one expert (``expert``) freezes the
  other;
- **shard**: FSDP2's ``fully_shard`` (``shard``: the strategy's ``shard_model``), still on the meta device;
- **materialize**: each parameter allocated as this rank holds it (its shard under FSDP, whole under DDP) and filled
  from ``init_from`` / ``model.pretrained`` -- a diffusers folder, a ringdit export, checkpoint or sharded checkpoint
  folder, read a slice at a time -- or with its seeded initial value; then the empty prompt's embedding of a
  text-conditioned model. No rank holds more than its share plus one module's full tensors;
- **EMA**: the average of the weights that train (``ema_decay``; None or 0: none), made from the materialized
  (sharded) parameters, sharing the frozen ones;
- **compile**: regional ``torch.compile`` of each repeated block, communication kept eager.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import hydra
import torch
from torch import nn

from ringdit.attention import AttentionBackend, USPAttention
from ringdit.checkpoints.fit import LABEL_TABLE, resize_label_embedding
from ringdit.checkpoints.sources import SafetensorsSource, WeightSource, weights_source
from ringdit.models.ema import ModelAverage
from ringdit.models.lora import add_lora, lora_enabled
from ringdit.models.materialize import materialize, parameters_on_meta
from ringdit.models.parallelize import PlannedAttention, parallelize, repeated_blocks
from ringdit.parallel import ParallelDims

Tensor = torch.Tensor


@dataclass(frozen=True)
class BuildPlan:
    """What a run builds its model from, settled before any rank starts (``TrainSpec.build_plan``, or a module's
    recorded hyper-parameters): ``build`` adds what only the ranks have -- the mesh, the strategy's sharding and
    offload, the data's empty-prompt embedding."""

    config: dict                  # the model config (``_target_``), the data's shape filled in
    backend: str | None = None    # the attention backend (the layout's, resolved)
    init_from: str | None = None  # weights to start from (a checkpoint, an export, a diffusers folder)
    init_weights: str = "ema"     # which weights of a ringdit .ckpt: ema | model
    resize_labels: bool = False   # init_from with another number of classes
    lora: dict | None = None      # the LoRA settings when LoRA trains (rank > 0); None: every weight
    expert: str | None = None     # the one expert of a two-expert model that trains; None: all that can
    ema_decay: float | None = None  # the EMA of the trained weights; None: none (a model that only samples)
    compile: bool = False         # torch.compile each block
    seed: int = 0                 # the initial weights of everything not loaded

    def build(self, *, dims: ParallelDims | None = None, null_condition: dict[str, Tensor] | None = None,
              shard: Callable[[nn.Module], nn.Module] | None = None,
              offload_shards: bool = False) -> tuple[nn.Module, ModelAverage | None]:
        """``(model, ema)``: ``build_model`` with this plan and what the ranks know."""
        return build_model(self.config, dims=dims, backend=self.backend, init_from=self.init_from,
                           init_weights=self.init_weights, resize_labels=self.resize_labels,
                           null_condition=null_condition, lora=self.lora, expert=self.expert,
                           ema_decay=self.ema_decay, shard=shard, offload_shards=offload_shards,
                           compile=self.compile, seed=self.seed)

    def frozen_from(self, init_from: str | None, init_weights: str, *, lora: bool = False) -> BuildPlan:
        """The same model started from other weights, with nothing of this run's training: no expert choice, EMA or
        resized labels (a distillation's teacher; ``lora``: its critic, adapted as this run's model is)."""
        return replace(self, init_from=init_from, init_weights=init_weights, resize_labels=False,
                       lora=self.lora if lora else None, expert=None, ema_decay=None)


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
    expert: str | None = None,
    ema_decay: float | None = None,
    shard: Callable[[nn.Module], nn.Module] | None = None,
    offload_shards: bool = False,
    compile: bool = False,
    seed: int = 0,
) -> tuple[nn.Module, ModelAverage | None]:
    """``(model, ema)`` for the model ``config`` (a dict with ``_target_``); the steps are the module docstring's.
    ``expert``: the one expert of a two-expert model that trains (``high`` / ``low``; None: all that can);
    ``offload_shards``: FSDP's CPU offload (the shards in CPU memory); ``seed``: the initial weights of everything
    not loaded (the same for every rank layout)."""
    device = torch.empty(0).device  # Lightning's device for the model (the rank's GPU), or the CPU
    with parameters_on_meta():
        model = hydra.utils.instantiate(config)
    parallelize(model, model.parallel_plan, dims, backend)
    if device.type == "meta":  # a config-time check: nothing to load, nothing runs
        return model, None
    if lora_enabled(lora):  # only the adapters train and are saved; the base comes from init_from
        add_lora(model, **lora)
    if expert in ("high", "low"):  # the other expert samples, but gets no gradient, optimizer state or EMA
        model.train_only(expert)
    if shard is not None:  # FSDP: each rank will hold 1/world of every parameter
        shard(model)
    source = _weights(model, init_from, init_weights)
    transforms = {LABEL_TABLE: lambda table: resize_label_embedding({LABEL_TABLE: table}, _rows(model))[LABEL_TABLE]} \
        if resize_labels and init_from else None
    materialize(model, device, seed, source, transforms, torch.device("cpu") if offload_shards else None)
    if null_condition is not None:  # the condition drop's replacement and the default negative prompt
        model.set_null_condition(null_condition)
    ema = ModelAverage(model, ema_decay) if ema_decay else None
    if compile:
        compile_blocks(model)
    return model, ema


def _weights(model: nn.Module, init_from: str | None, prefer: str) -> WeightSource | None:
    """Where the weights come from: ``init_from`` (``prefer``: its EMA or raw weights), else the diffusers folder the
    model was configured from (``model.pretrained``), else nowhere (initial values)."""
    if init_from:
        return weights_source(init_from, prefer, model)
    pretrained = getattr(model, "pretrained", None)  # (folder, subfolder)
    if pretrained is None:
        return None
    return SafetensorsSource(pretrained[0], model.pretrained_files(*pretrained, setting="model.pretrained"))


def _rows(model: nn.Module) -> int:
    return model.get_parameter(LABEL_TABLE).shape[0]


def compile_blocks(model: nn.Module, **options) -> None:
    """Regional compilation: one graph per repeated block of the plan, reused by all blocks (what diffusers'
    ``compile_repeated_blocks`` does); the sharded attention paths stay eager, outside the graphs. ``options``:
    ``torch.compile``'s (a test's ``backend="aot_eager"``: Dynamo's graphs and guards without Inductor's codegen).

    Buckets (a token count that changes from step to step) need nothing here: the first new length recompiles each
    graph once with the length symbolic (PyTorch's automatic dynamic shapes), and every later length reuses it."""
    for layer in model.modules():  # USPAttention's exchanges, and the gathered keys of a sharded stream
        if isinstance(layer, (USPAttention, PlannedAttention)):
            layer.keep_communication_eager()
    for block in repeated_blocks(model):
        block.compile(**options)
