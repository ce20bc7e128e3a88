"""A LoRA run's frozen base held in fp8 with per-row scales (``ringdit.models.lora.hold_base_in`` calls
``hold_in_float8`` for ``lora.base_dtype=float8_*``; the 8-bit optimizer is ``ringdit.training.optimizers``').

An fp8 base (``lora.base_dtype=float8_e4m3fn`` or ``float8_e5m2``, musubi-tuner's ``--fp8_base --fp8_scaled``) holds
the frozen Linear weights of the repeated blocks -- nearly all of a model -- in 8 bits with one fp32 scale per output
row (``weight_scale``: the row's largest magnitude maps to fp8's largest value), a quarter of an fp32 base; the other
frozen projections (embeddings, output layer: a few of the weights and the most sensitive) are held in bf16. Each fp8
layer computes by casting its weight up to the activations' dtype and scaling it, one layer at a time
(``ScaledFloat8Linear``). Weights are quantized as they load (``load_float8_weight``, from
``ringdit.models.materialize``), one tensor at a time and per row, so an FSDP rank quantizes its own rows, and never
holds the whole base at full precision. e4m3 keeps 3 mantissa bits (relative rounding <= 2^-4), e5m2 2 bits but a
wider range (rows with outliers); a full fine-tune cannot train fp8 weights, so an fp8 base needs LoRA.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from ringdit.checkpoints.sources import local_part
from ringdit.models.parallelize import repeated_blocks

Tensor = torch.Tensor

FLOAT8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def block_linears(model: nn.Module) -> list[nn.Linear]:
    """The Linear layers of the model's repeated blocks (all of them for a model without a parallel plan)."""
    blocks = repeated_blocks(model) if getattr(model, "parallel_plan", None) is not None else [model]
    return [layer for block in blocks for layer in block.modules() if type(layer) is nn.Linear]


def hold_in_float8(layer: nn.Linear, dtype: torch.dtype) -> None:
    """Hold the frozen ``layer``'s weight in ``dtype`` (fp8) with one fp32 scale per output row (``weight_scale``, a
    frozen parameter, so that FSDP shards it with the weight's rows), its bias in bf16; it computes through
    ``ScaledFloat8Linear``. On the meta device only the dtypes change (``load_float8_weight`` fills it later)."""
    weight = layer.weight.detach()
    layer.weight = nn.Parameter(torch.empty_like(weight, dtype=dtype), requires_grad=False)
    layer.weight_scale = nn.Parameter(torch.empty(weight.shape[0], device=weight.device), requires_grad=False)
    if layer.bias is not None:
        layer.bias = nn.Parameter(layer.bias.detach().to(torch.bfloat16), requires_grad=False)
    if not weight.is_meta:
        load_float8_weight(layer, weight)
    layer.forward = types.MethodType(_forward_float8, layer)


def float8_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """The layers held in fp8, by their weight's name (``blocks.0.attn.qkv.base_layer.weight``)."""
    return {f"{name}.weight": layer for name, layer in model.named_modules() if hasattr(layer, "weight_scale")}


@torch.no_grad()
def load_float8_weight(layer: nn.Linear, rows: Tensor) -> None:
    """Quantize ``rows`` -- the full-precision values of the rows of ``layer.weight`` this rank holds (its FSDP
    shard's rows, or all) -- into the fp8 weight and its per-row scales: each row divided by its largest magnitude
    over fp8's largest value, so that the row spans fp8's range. A zero row keeps scale 1."""
    weight, scale = local_part(layer.weight), local_part(layer.weight_scale)
    if weight.shape[0] != rows.shape[0] or scale.shape[0] != rows.shape[0]:
        raise RuntimeError(f"fp8 weight rows {weight.shape[0]}, scale rows {scale.shape[0]} and values "
                           f"{rows.shape[0]} differ: the weight and its scales must be sharded alike")
    finfo = torch.finfo(weight.dtype)
    rows = rows.float()
    row_scale = rows.abs().amax(dim=1) / finfo.max  # (out,)
    row_scale = torch.where(row_scale > 0, row_scale, torch.ones_like(row_scale))
    weight.copy_((rows / row_scale[:, None]).clamp(finfo.min, finfo.max).to(weight.dtype))
    scale.copy_(row_scale)


class ScaledFloat8Linear(torch.autograd.Function):
    """``x @ (weight x scale).T + bias`` for a frozen fp8 weight: the weight is cast up to ``dtype`` for this layer
    only, in forward and again in backward. Only the fp8 weight and its scales are kept for backward (a plain
    F.linear would keep the cast-up weight: every layer's, a full-precision copy of the base during the step)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
        ctx.save_for_backward(weight, scale)
        ctx.dtype, ctx.input_dtype = dtype, x.dtype
        bias = None if bias is None else bias.to(dtype)
        return nn.functional.linear(x.to(dtype), _scaled(weight, scale, dtype), bias)  # (..., out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        weight, scale = ctx.saved_tensors
        grad_x = grad.to(ctx.dtype) @ _scaled(weight, scale, ctx.dtype)  # (..., in)
        return grad_x.to(ctx.input_dtype), None, None, None, None


def _scaled(weight: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """The weight cast up and scaled in one new tensor (a copy even when FSDP gathered it in ``dtype`` already, so the
    in-place scaling never touches the parameter): one layer's full-precision weight in flight."""
    return weight.to(dtype, copy=True).mul_(scale.to(dtype)[:, None])  # (out, in)


def _forward_float8(self: nn.Linear, x: Tensor) -> Tensor:
    """The fp8 layer computes in the activations' dtype (autocast's under autocast: bf16-mixed)."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    with torch.autocast(device, enabled=False):
        return ScaledFloat8Linear.apply(x, self.weight, self.weight_scale, self.bias, dtype)


def keep_float8_out_of_ddp(module: nn.Module) -> None:
    """DDP broadcasts every parameter from rank 0 when it wraps a model; gloo cannot send fp8 tensors ("Invalid
    scalar type"), and every rank already holds the same fp8 base (read from the same file, or drawn from the same
    seed, and quantized alike), so the fp8 weights are left out of DDP (they are frozen: no gradients to reduce)."""
    from torch.nn.parallel import DistributedDataParallel

    names = [name for name, param in module.named_parameters() if param.dtype in FLOAT8.values()]
    if names:
        ignored = list(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignored + names)
