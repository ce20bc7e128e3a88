"""Experiment loggers as Hydra targets. wandb goes offline by itself when it cannot reach its server."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from lightning.pytorch.loggers import WandbLogger

log = logging.getLogger(__name__)


def _wandb_api_key() -> str | None:
    if os.environ.get("WANDB_API_KEY"):
        return os.environ["WANDB_API_KEY"]
    try:
        import netrc

        entry = netrc.netrc().authenticators("api.wandb.ai")
        return entry[2] if entry else None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return None


def _reachable(host: str, port: int = 443, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wandb_logger(save_dir: str, project: str = "ringdit", name: str | None = None, mode: str = "auto",
                 **kwargs) -> WandbLogger:
    """A WandbLogger whose run folder lives under ``save_dir`` (the Hydra output dir).

    ``mode="auto"`` logs online when an API key is set and the server answers, else offline (upload later with
    ``wandb sync <save_dir>/wandb/offline-run-*``). ``WANDB_MODE`` in the environment wins over ``mode``.
    """
    if mode not in ("auto", "online", "offline", "disabled"):
        raise ValueError(f"logger.mode must be auto, online, offline or disabled, got {mode!r}")
    mode = os.environ.get("WANDB_MODE") or mode
    if mode == "auto":
        online = _wandb_api_key() is not None and _reachable(os.environ.get("WANDB_HOST", "api.wandb.ai"))
        mode = "online" if online else "offline"
        if not online:
            log.info("wandb: no API key or no connection, logging offline to %s/wandb "
                     "(upload later with `wandb sync`)", save_dir)
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    if mode == "disabled":
        kwargs["mode"] = "disabled"
    return WandbLogger(save_dir=save_dir, project=project, name=name, offline=mode == "offline", **kwargs)
