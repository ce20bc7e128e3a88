"""``ServeSettings``: the server's own settings (``conf/serve.yaml`` beyond infer.py's), checked before any process
starts: who may call it, where adapters come from, and the bounds every request is held to."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from ringdit.common.errors import ConfigError, require_count

API_KEY_ENV = "RINGDIT_API_KEY"


@dataclass(frozen=True)
class ServeSettings:
    host: str
    port: int
    api_key: str | None           # None: no key (loopback only, unless allow_unauthenticated)
    lora_dir: Path | None         # adapters are loaded from inside this folder only
    max_batch: int
    batch_wait_s: float
    queue_size: int
    max_n: int
    max_steps: int
    max_pixels: int | None        # None: the model's default size's
    max_frames: int | None        # None: the data's frames
    request_timeout_s: float
    keep_files: int

    @classmethod
    def from_config(cls, cfg: DictConfig) -> ServeSettings:
        host = cfg.host
        if not isinstance(host, str) or not host:
            raise ConfigError(f"host={host!r} is not an address to listen on; e.g. host=127.0.0.1")
        port = cfg.port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"port={port!r} is not a TCP port (0..65535; 0 picks a free one)")
        api_key = cfg.api_key if cfg.api_key is not None else os.environ.get(API_KEY_ENV) or None
        if api_key is not None and (not isinstance(api_key, str) or len(api_key) < 8):
            raise ConfigError(f"api_key (or ${API_KEY_ENV}) must be a string of at least 8 characters; a shorter one "
                              f"is guessed quickly (e.g. api_key=$(openssl rand -hex 16))")
        if api_key is None and not is_loopback(host) and not cfg.allow_unauthenticated:
            raise ConfigError(f"host={host} listens beyond this machine and no api_key is set: anyone who reaches it "
                              f"could use the GPUs; set api_key=<secret> (or ${API_KEY_ENV}), listen on host=127.0.0.1, "
                              f"or accept it with allow_unauthenticated=true")
        lora_dir = None
        if cfg.lora_dir:
            lora_dir = Path(str(cfg.lora_dir)).expanduser().resolve()
            if not lora_dir.is_dir():
                raise ConfigError(f"lora_dir={cfg.lora_dir} is not a folder; give the folder that holds the LoRA "
                                  f"adapters (.safetensors) the server may load")
        for key in ("max_batch", "queue_size", "max_n", "max_steps", "keep_files"):
            require_count(key, cfg[key])
        require_count("max_pixels", cfg.max_pixels, optional=True, hint="height x width of a request at most")
        require_count("max_frames", cfg.max_frames, optional=True, hint="video frames of a request at most")
        for key in ("batch_wait_ms", "request_timeout_s"):
            value = cfg[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
                raise ConfigError(f"{key}={value!r} must be a finite number >= 0")
        if cfg.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s={cfg.request_timeout_s} must be > 0 (seconds a job may take)")
        return cls(host=host, port=port, api_key=api_key, lora_dir=lora_dir, max_batch=cfg.max_batch,
                   batch_wait_s=cfg.batch_wait_ms / 1000, queue_size=cfg.queue_size, max_n=cfg.max_n,
                   max_steps=cfg.max_steps, max_pixels=cfg.max_pixels, max_frames=cfg.max_frames,
                   request_timeout_s=float(cfg.request_timeout_s), keep_files=cfg.keep_files)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False
