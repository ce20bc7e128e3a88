"""Backend registry, automatic selection and the config-time checks of attention settings.

The registry is the single source of truth: ``RING_CAPABLE_ATTENTION_BACKENDS`` is computed from the registered
classes (those that implement ``forward_ring_kv_chunk``), ordered by ``priority``; nothing keeps a second list.
``FORWARD_AD_ATTENTION_BACKENDS`` likewise (those that implement ``jvp_ring_kv_chunk``).
"""

from __future__ import annotations

import logging

from ringdit.attention.backend import AttentionBackend, default_device_type

log = logging.getLogger(__name__)

_REGISTRY: dict[str, type[AttentionBackend]] = {}
_INSTANCES: dict[str, AttentionBackend] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: make a backend selectable by its ``name``."""
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)) or not cls.name:
        raise TypeError(f"register_backend expects an AttentionBackend subclass with a name, got {cls!r}")
    if _REGISTRY.get(cls.name, cls) is not cls:
        raise ValueError(f"attention backend {cls.name!r} is already registered by {_REGISTRY[cls.name].__name__}")
    _REGISTRY[cls.name] = cls
    _INSTANCES.pop(cls.name, None)
    return cls


def list_backends() -> tuple[str, ...]:
    """All registered backend names, most preferred first."""
    return tuple(sorted(_REGISTRY, key=lambda name: (_REGISTRY[name].priority, name)))


def _ring_capable_backends() -> tuple[str, ...]:
    """Registered backends whose kernel exposes the LSE (they implement ``forward_ring_kv_chunk``), preferred first."""
    return tuple(name for name in list_backends() if _REGISTRY[name].supports_ring_rotation())


def forward_ad_capable_backends() -> tuple[str, ...]:
    """Registered backends with a forward-mode rule (they implement ``jvp_ring_kv_chunk``), preferred first."""
    return tuple(name for name in list_backends() if _REGISTRY[name].supports_forward_ad())


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; {describe_backends()}")
    return _REGISTRY[name]


def describe_backends(device_type: str | None = None) -> str:
    """One line per registered backend and whether it runs here, for error messages."""
    device_type = device_type or default_device_type()
    parts = []
    for name in list_backends():
        reason = _REGISTRY[name].unavailable_reason(device_type)
        parts.append(f"{name} ({'available' if reason is None else 'unavailable: ' + reason})")
    return f"registered backends on {device_type}: " + ", ".join(parts)


def get_attn_backend(
    name: str | None = None, *, device_type: str | None = None, training: bool = False
) -> AttentionBackend:
    """The backend called ``name``, or (``name=None``) the most preferred available ring-capable one.

    ``training=True`` makes the automatic choice also require ``backward_ring_kv_chunk``. Instances are shared:
    backends hold no state.
    """
    device_type = device_type or default_device_type()
    if name is None:
        name = _first_available_ring_backend(device_type, training)
    cls = backend_class(name)
    reason = cls.unavailable_reason(device_type)
    if reason is not None:
        raise ValueError(
            f"attention backend {name!r} is not available on {device_type}: {reason}. {describe_backends(device_type)}"
        )
    if name not in _INSTANCES:
        _INSTANCES[name] = cls()
    return _INSTANCES[name]


def _first_available_ring_backend(device_type: str, training: bool, forward_ad: bool = False) -> str:
    for name in _ring_capable_backends():
        cls = _REGISTRY[name]
        if (cls.is_available(device_type) and (cls.supports_ring_backward() or not training)
                and (cls.supports_forward_ad() or not forward_ad)):
            return name
    raise ValueError(f"no ring-capable attention backend is available; {describe_backends(device_type)}")


def validate_attention_config(
    attention_backend: str | None,
    *,
    ring_degree: int = 1,
    training: bool = False,
    forward_ad: bool = False,
    device_type: str | None = None,
) -> str:
    """Check the attention settings before any process starts; return the backend name to use.

    - ``ring_degree > 1`` needs a ring-capable backend (a ValueError naming them otherwise); with none named, the
      first available ring-capable backend is chosen and logged.
    - training with ring needs the backend's ``backward_ring_kv_chunk`` too.
    - ``forward_ad`` (a JVP through the model, as consistency distillation takes): the backend needs a forward-mode
      rule (``jvp_ring_kv_chunk``), on every layout; with none named, the first that has one is chosen.
    - the backend must be registered and available on ``device_type``.
    """
    device_type = device_type or default_device_type()
    ring_capable = _ring_capable_backends()
    if attention_backend is not None:
        backend_class(attention_backend)  # unknown names first: that message lists what exists
    if forward_ad and attention_backend is not None and not _REGISTRY[attention_backend].supports_forward_ad():
        raise ValueError(
            f"attention_backend={attention_backend!r} has no forward-mode (JVP) rule (no jvp_ring_kv_chunk), so "
            f"torch.func.jvp cannot run through it; use attention_backend= one of "
            f"({', '.join(forward_ad_capable_backends())})"
        )
    if ring_degree > 1:
        if attention_backend is not None and attention_backend not in ring_capable:
            raise ValueError(
                "Ring Attention requires one of the ring-capable backends "
                f"({', '.join(ring_capable)}), got {attention_backend!r}"
            )
        if attention_backend is None:
            attention_backend = _first_available_ring_backend(device_type, training, forward_ad)
            log.info(
                "Ring Attention requires a ring-capable backend; attention_backend has been automatically set to %s",
                attention_backend,
            )
        if training and not _REGISTRY[attention_backend].supports_ring_backward():
            trainable = [n for n in ring_capable if _REGISTRY[n].supports_ring_backward()]
            raise ValueError(
                f"attention_backend={attention_backend!r} implements ring attention forward only "
                f"(no backward_ring_kv_chunk), so it can sample with ring_degree={ring_degree} but not train; "
                f"use one of ({', '.join(trainable)}) or ring_degree=1"
            )
    elif attention_backend is None:
        attention_backend = _first_available_ring_backend(device_type, training, forward_ad)
    get_attn_backend(attention_backend, device_type=device_type)  # raises with the reason when unavailable
    return attention_backend


def check_ring_capable(backend: AttentionBackend) -> None:
    """The layer-construction check for a layer that will run ring attention (config time already checked it: this
    catches a layer built by hand)."""
    if not backend.supports_ring_rotation():
        raise RuntimeError(
            "Ring Attention requires a backend whose kernel exposes the softmax LSE for the per-hop merge; "
            f"{backend.enum_name()} does not declare support (see AttentionBackend.supports_ring_rotation)."
        )
