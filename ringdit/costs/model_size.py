"""The model's sizes the estimate reads (``ModelSize``), from the model built on the meta device: its parameters, the
blocks', the architecture's widths, the tokens, and what LoRA and an fp8 base add or cast."""

from __future__ import annotations

import math

import torch
from torch import nn

from ringdit.models import repeated_blocks
from ringdit.models.build import build_model
from ringdit.models.fp8 import block_linears
from ringdit.models.lora import BASE_LAYERS, adapted_modules, lora_enabled, matches_targets, unmatched_targets
from ringdit.parallel import ParallelDims
from ringdit.parallel.layout import Layout
from ringdit.costs.estimate import MemoryEstimate, ModelSize, Setup, estimate_memory


def model_size(config: dict, meta_model: nn.Module, lora: dict | None = None) -> ModelSize | None:
    """The sizes of ``meta_model`` (built from ``config`` on the meta device, without LoRA) and, with ``lora``
    settings, of the adapters they add. Hidden size, heads and MLP width come from the DiT's config or the diffusers
    model's own (its ``architecture``, the transformer's config); None for a model kind that describes neither."""
    architecture = _architecture(config, meta_model)
    if architecture is None:
        return None
    hidden_size, num_heads, mlp_hidden = architecture
    params = list(meta_model.parameters())
    blocks = repeated_blocks(meta_model)
    in_blocks = [sum(p.numel() for p in block.parameters()) for block in blocks]
    joint = bool(meta_model.parallel_plan.joint_attention)
    streams = meta_model.stream_tokens  # {stream: tokens per sample} beside the grid's (reference, control)
    packed = meta_model.parallel_plan.packed  # the streams inside the tokens' tensors: every block's sequence
    packed_tokens = sum(streams.get(name, 0) for name in sequence_streams(meta_model))
    return ModelSize(
        parameters=sum(p.numel() for p in params),
        trainable_parameters=sum(p.numel() for p in params if p.requires_grad),
        largest_parameter=max(p.numel() for p in params),
        root_parameters=sum(p.numel() for p in params) - sum(in_blocks),
        block_parameters=max(in_blocks),
        hidden_size=hidden_size, depth=len(blocks) // max(len(meta_model.expert_modules), 1),
        num_heads=num_heads, mlp_hidden=mlp_hidden,
        tokens=math.prod(meta_model.default_grid) + packed_tokens,
        stream_tokens=tuple(streams.items()),
        text_tokens=meta_model.text_tokens if joint else 0,  # the text the model was built for, glyph text too
        **dict(zip(("lora_parameters", "lora_base_parameters"), lora_parameters(meta_model, lora))),
        **dict(zip(("float8_parameters", "float8_rows", "float8_largest"), float8_parameters(meta_model, lora))),
        untargeted_linear_inputs=untargeted_linear_inputs(meta_model, blocks),
    )


def sequence_streams(meta_model: nn.Module) -> tuple[str, ...]:
    """The streams in the one sequence the model's plan splits, beside the grid's tokens: those its plan packs after
    the tokens (Qwen-Image-Edit's reference) and those its forward packs itself (MiniMax-H3's audio rows: the plan's
    ``forward_packed``)."""
    plan = meta_model.parallel_plan
    return (*(plan.packed.streams if plan.packed is not None else ()), *plan.forward_packed)


def _architecture(config: dict, meta_model: nn.Module) -> tuple[int, int, int] | None:
    """(hidden size D, heads H, MLP width F) of a DiT (its config) or a diffusers transformer (its config)."""
    if all(key in config for key in ("hidden_size", "num_heads")):
        hidden = config["hidden_size"]
        return hidden, config["num_heads"], int(config.get("mlp_ratio", 4.0) * hidden)
    arch = dict(meta_model.architecture or {})
    if not all(key in arch for key in ("num_attention_heads", "attention_head_dim")):
        return None
    heads = arch["num_attention_heads"]
    hidden = heads * arch["attention_head_dim"]
    # Wan: ffn_dim; HunyuanVideo 1.5 and Flux.2: mlp_ratio x D (Flux.2's is 3); Flux and QwenImage: 4 x D
    return hidden, heads, arch.get("ffn_dim") or int(arch.get("mlp_ratio", 4.0) * hidden)


def lora_parameters(model: nn.Module, lora: dict | None) -> tuple[int, int]:
    """(the adapters' parameters, the base weights ``lora.base_dtype`` casts): rank x (in + out) for each Linear whose
    name a target selects (``matches_targets``; the model's default ``lora_targets`` when the settings name none),
    and the
    weights and biases of every Linear / Conv layer of the model (``ringdit.models.lora.hold_base_in`` casts them all, adapted
    or not, as they are all frozen); (0, 0) when LoRA is off."""
    if not lora_enabled(lora):
        return 0, 0
    targets = lora.get("targets") or model.lora_targets
    targets = [targets] if isinstance(targets, str) else list(targets)
    adapted = [module for root in adapted_modules(model) for name, module in root.named_modules()
               if isinstance(module, nn.Linear) and matches_targets(name, targets)]
    if not adapted:  # training would refuse them (peft finds no module): a plan without the adapters misleads
        raise unmatched_targets(targets, model, adapted_modules(model))
    return (sum(lora["rank"] * (layer.in_features + layer.out_features) for layer in adapted),
            sum(p.numel() for layer in model.modules() if isinstance(layer, BASE_LAYERS)
                for p in layer.parameters(recurse=False)))


def untargeted_linear_inputs(model: nn.Module, blocks: list[nn.Module]) -> int:
    """Values per token a block's Linears outside the model's default ``lora_targets`` read (the mean over
    ``blocks``): frozen under LoRA they keep nothing for backward, while a full fine-tune keeps each one's input for
    its weight gradient (Wan's feed-forward: D into the up projection, F into the down one). A modulation Linear
    (adaLN's, under a name with ``adaLN`` or ``norm``) reads the conditioning vector, one per sample, not the tokens,
    and is left out."""
    targets = tuple(model.lora_targets or ())
    total = sum(layer.in_features for block in blocks for name, layer in block.named_modules()
                if isinstance(layer, nn.Linear) and not matches_targets(name, targets)
                and "adaLN" not in name and "norm" not in name)
    return total // max(len(blocks), 1)


def float8_parameters(model: nn.Module, lora: dict | None) -> tuple[int, int, int]:
    """(weights, output rows, the largest weight) of the Linear layers of the repeated blocks: what an fp8 base holds
    in fp8 (with one scale per row, ``ringdit.models.fp8.hold_in_float8``); zeros when LoRA is off."""
    if not lora_enabled(lora):
        return 0, 0, 0
    layers = block_linears(model)
    return (sum(layer.weight.numel() for layer in layers), sum(layer.out_features for layer in layers),
            max((layer.weight.numel() for layer in layers), default=0))


def estimate_model_memory(config: dict, layout: Layout = Layout(), *, lora: dict | None = None,
                          meta_model: nn.Module | None = None, **settings) -> MemoryEstimate:
    """The estimate for a built-config (what ``build_model`` takes: ``_target_`` and the data's shape filled in)
    laid out as ``layout`` under ``Setup(**settings)``: what a benchmark prints beside the peak it measures, e.g.
    ``estimate_model_memory(config, Layout(ring_degree=4, strategy="fsdp"), lora={"rank": 64},
    lora_base_dtype="bfloat16")``."""
    setup = Setup(**settings)
    if meta_model is None:
        with torch.device("meta"):
            meta_model, _ = build_model(config, dims=ParallelDims(ulysses_degree=layout.ulysses_degree),
                                        backend="math")
    size = model_size(config, meta_model, lora)
    if size is None:
        raise ValueError(f"cannot estimate the memory of {config.get('_target_')}: it describes no hidden size and "
                         f"heads (a DiT's hidden_size / num_heads, a diffusers config's attention heads)")
    return estimate_memory(size, layout, setup)
