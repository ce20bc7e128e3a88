"""Attention: backend registry, ring / Ulysses context parallelism, and the ``USPAttention`` layer.

``RING_CAPABLE_ATTENTION_BACKENDS`` and ``FORWARD_AD_ATTENTION_BACKENDS`` (those with a forward-mode rule, for
``torch.func.jvp``) are computed on access from the registered classes, so a backend registered later
(``@register_backend``) appears in them too.
"""

from ringdit.attention.backend import AttentionBackend
from ringdit.attention.backends.flash_attn import FlashAttnBackend
from ringdit.attention.backends.math_backend import MathBackend
from ringdit.attention.backends.torch_flash import TorchFlashBackend
from ringdit.attention.backends.torch_sdpa import TorchSDPABackend
from ringdit.attention.backend import check_forward_ad_capable
from ringdit.attention.token_layout import Stream, TokenLayout
from ringdit.attention.layer import LocalAttention, USPAttention, local_attention
from ringdit.attention.ring import RingAttentionFunction, merge_attention_chunk, ring_attention
from ringdit.attention.registry import (
    _ring_capable_backends,
    check_ring_capable,
    describe_backends,
    forward_ad_capable_backends,
    get_attn_backend,
    list_backends,
    register_backend,
    validate_attention_config,
)

for _backend in (TorchFlashBackend, TorchSDPABackend, FlashAttnBackend, MathBackend):
    register_backend(_backend)


def __getattr__(name: str):
    if name == "RING_CAPABLE_ATTENTION_BACKENDS":  # the one public path: computed from the registry on access

        return _ring_capable_backends()
    if name == "FORWARD_AD_ATTENTION_BACKENDS":
        return forward_ad_capable_backends()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AttentionBackend",
    "FlashAttnBackend",
    "MathBackend",
    "RING_CAPABLE_ATTENTION_BACKENDS",
    "FORWARD_AD_ATTENTION_BACKENDS",
    "TorchFlashBackend",
    "TorchSDPABackend",
    "USPAttention",
    "RingAttentionFunction",
    "LocalAttention",
    "local_attention",
    "merge_attention_chunk",
    "ring_attention",
    "Stream",
    "TokenLayout",
    "check_forward_ad_capable",
    "check_ring_capable",
    "describe_backends",
    "get_attn_backend",
    "list_backends",
    "register_backend",
    "validate_attention_config",
]
