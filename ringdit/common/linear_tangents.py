"""Forward-mode AD through linear layers at the cost of two matmuls (output and tangent), not three.

PyTorch's forward-AD formula for ``F.linear`` (through ``addmm``) treats a weight without a tangent as a zero
tangent and multiplies it anyway: ``x_t W^T + x W_t^T + b_t`` with ``W_t = 0`` materialised, so a linear layer's
JVP costs about 3.4 of its forwards on CPU, and 2.1 under this mode (``benchmarks/attention_jvp.py``'s linear rows). A model's
weights carry no tangent when the derivative is taken in its inputs (sCM's tangent in the noisy sample and the
time), and then the tangent is just ``x_t W^T``: ``linear_tangents()`` computes that, and leaves every other call
(a weight or bias with a tangent, an input without one, a weight of a tensor subclass) to PyTorch.

    with torch.no_grad(), fwAD.dual_level(), linear_tangents():
        out, tangent = fwAD.unpack_dual(model(fwAD.make_dual(x, dx), t))
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class linear_tangents(TorchFunctionMode):  # noqa: N801 -- used as a context manager, named like one
    """Inside it, ``F.linear`` of an input with a forward-mode tangent and a plain weight (and bias) without one
    returns ``(x W^T + b, x_t W^T)`` as a dual tensor; the values are those of PyTorch's own formula."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = _linear_arguments(*args, **kwargs)
            primal, tangent = fwAD.unpack_dual(x)
            if tangent is not None and _constant(weight) and (bias is None or _constant(bias)):
                # nested calls run without this mode (TorchFunctionMode disables itself inside its handler)
                return fwAD.make_dual(F.linear(primal, weight, bias), F.linear(tangent, weight))
        return func(*args, **kwargs)


def _linear_arguments(input, weight, bias=None):  # noqa: A002 -- F.linear's own parameter names
    return input, weight, bias


def _constant(parameter: torch.Tensor) -> bool:
    """A plain tensor without a forward-mode tangent (subclasses: fp8 weights, DTensors, keep PyTorch's path)."""
    return type(parameter) in _PLAIN and fwAD.unpack_dual(parameter).tangent is None
