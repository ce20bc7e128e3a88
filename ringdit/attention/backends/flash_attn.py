"""``flash_attn``: the flash-attn package (optional, CUDA only; ``pip install 'ringdit[gpu]'``).

flash-attn's functions changed shape across releases (2.0-2.3: ``window_size`` appears; 2.4-2.6: ``alibi_slopes``,
``deterministic``, ``softcap``; 2.7+: ``window_size_left/right``, torch custom ops that fill preallocated
dq/dk/dv; flash-attn 3 on Hopper: module ``flash_attn_interface``, ``is_causal``, no dropout). The adapter therefore
detects what is installed by feature, never by version string:

- forward: the public ``flash_attn_func(q, k, v, softmax_scale=..., return_attn_probs=True)``, whose first two
  results are ``out [B, Sq, H, D]`` and ``softmax_lse [B, H, Sq]`` (fp32) in every release;
- backward: the private ``_flash_attn_backward``, called with keyword arguments matched against its signature and
  preallocated ``dq, dk, dv`` (2.7+ and FA3 only fill those; older releases also return them).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

from ringdit.attention.backend import AttentionBackend, accepts_packed_layout, chunk_kernel_attention

# Values for every backward parameter any release has had, apart from the tensors (plain attention, no dropout).
_BACKWARD_SETTINGS = {
    "dropout_p": 0.0,
    "causal": False,
    "is_causal": False,
    "window_size": (-1, -1),
    "window_size_left": -1,
    "window_size_right": -1,
    "softcap": 0.0,
    "alibi_slopes": None,
    "deterministic": False,
    "rng_state": None,
}


def _parameters(fn: Callable) -> dict[str, inspect.Parameter]:
    # torch.library.custom_op wraps the Python function (flash-attn 2.7+, FA3); its signature lives on _init_fn.
    return dict(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


@dataclass(frozen=True)
class FlashAttnAPI:
    """The two flash-attn entry points the adapter calls, found by feature in an installed module."""

    module_name: str
    forward_fn: Callable
    backward_fn: Callable

    @classmethod
    def from_module(cls, module: ModuleType) -> "FlashAttnAPI":
        missing = [fn for fn in ("flash_attn_func", "_flash_attn_backward") if not hasattr(module, fn)]
        if missing:
            raise ImportError(f"{module.__name__} has no {', '.join(missing)}: not a flash-attn interface ringdit knows")
        return cls(module.__name__, module.flash_attn_func, module._flash_attn_backward)

    def forward(self, q, k, v, softmax_scale: float):
        accepted = _parameters(self.forward_fn)
        kwargs = {"softmax_scale": softmax_scale}
        if "return_attn_probs" in accepted:  # early FA3 betas always return (out, lse)
            kwargs["return_attn_probs"] = True
        out, lse = self.forward_fn(q, k, v, **kwargs)[:2]
        return out, lse

    def backward(self, dout, q, k, v, out, lse, softmax_scale: float):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        tensors = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "softmax_lse": lse, "dq": dq, "dk": dk, "dv": dv}
        kwargs = {}
        for name, param in _parameters(self.backward_fn).items():
            if name in tensors:
                kwargs[name] = tensors[name]
            elif name == "softmax_scale":
                kwargs[name] = softmax_scale
            elif name in _BACKWARD_SETTINGS:
                kwargs[name] = _BACKWARD_SETTINGS[name]
            elif param.default is inspect.Parameter.empty:
                raise TypeError(f"{self.module_name}._flash_attn_backward wants {name!r}, unknown to ringdit's adapter")
        self.backward_fn(**kwargs)
        return dq, dk, dv


@functools.lru_cache(maxsize=1)
def load_flash_attn_api() -> FlashAttnAPI | str:
    """The installed interface (flash-attn 3's ``flash_attn_interface`` first), or why there is none."""
    reasons = []
    for module_name in ("flash_attn_interface", "flash_attn.flash_attn_interface"):
        try:
            return FlashAttnAPI.from_module(importlib.import_module(module_name))
        except ImportError as error:  # also a package built for another torch/CUDA: report, don't crash
            reasons.append(f"{module_name}: {error}")
    return "flash-attn is not installed (pip install 'ringdit[gpu]' on a CUDA machine); " + "; ".join(reasons)


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    priority = 5
    device_types = ("cuda",)
    dtypes = (torch.bfloat16, torch.float16)

    def __init__(self, api: FlashAttnAPI | None = None):
        self._api = api

    @classmethod
    def unavailable_reason(cls, device_type=None):
        reason = super().unavailable_reason(device_type)
        if reason is not None:
            return reason
        api = load_flash_attn_api()
        return api if isinstance(api, str) else None

    @property
    def api(self) -> FlashAttnAPI:
        if self._api is None:
            api = load_flash_attn_api()
            if isinstance(api, str):
                raise RuntimeError(api)
            self._api = api
        return self._api

    def forward(self, q, k, v, *, softmax_scale=None):
        return chunk_kernel_attention(self, q, k, v, softmax_scale)

    @accepts_packed_layout
    def forward_ring_kv_chunk(self, q, k, v, *, softmax_scale=None):
        _check_inputs(q)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        return self.api.forward(q, k, v, scale)

    @accepts_packed_layout
    def backward_ring_kv_chunk(self, dout, q, k, v, out, lse, *, softmax_scale=None):
        _check_inputs(q)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        return self.api.backward(dout, q, k, v, out, lse.contiguous(), scale)


def _check_inputs(q: torch.Tensor) -> None:
    if q.shape[-1] % 8:
        raise ValueError(f"flash_attn needs a head size that is a multiple of 8, got {q.shape[-1]}; use torch_flash")
