"""Experiment loggers as Hydra targets. wandb goes offline by itself when it cannot reach its server; the CSV logger
appends to the metrics of the run it resumes instead of deleting them."""

from __future__ import annotations

import csv
import logging
import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

log = logging.getLogger(__name__)


def _base_url() -> str:
    return os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"


def _wandb_api_key(base_url: str | None = None) -> str | None:
    """The credentials wandb itself would use: ``WANDB_API_KEY`` (or an identity token file), else the netrc entry
    of the server (``NETRC`` or ~/.netrc, as ``wandb login`` writes it)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return os.environ.get("WANDB_API_KEY") or "identity-token"
    base_url = base_url or _base_url()
    try:
        from wandb.sdk.lib.wbauth import wbnetrc  # wandb's own lookup (netrc path, host aliases)

        return wbnetrc.read_netrc_auth(host=base_url)
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - a malformed entry: wandb would refuse it too
        return None
    try:
        import netrc

        entry = netrc.netrc(os.environ.get("NETRC")).authenticators(urlsplit(base_url).hostname or "")
        return entry[2] if entry else None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return None


def _reachable(url: str, timeout: float = 5.0) -> bool:
    """A TCP connection to the server opens within ``timeout`` seconds (wandb.init would wait far longer)."""
    parts = urlsplit(url if "//" in url else f"https://{url}")
    port = parts.port or (80 if parts.scheme == "http" else 443)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def wandb_logger(save_dir: str, project: str = "ringdit", name: str | None = None, mode: str = "auto",
                 init_timeout_s: float = 30.0, **kwargs) -> WandbLogger:
    """A WandbLogger whose run folder lives under ``save_dir`` (the Hydra output dir).

    ``mode="auto"`` logs online when an API key is set and the server answers, else offline (upload later with
    ``wandb sync <save_dir>/wandb/offline-run-*``). ``mode="online"`` without a key is a settings error (refused
    before spawning); with a key but no answer from the server (``WANDB_BASE_URL``) within a few seconds it logs
    offline with a warning, and ``init_timeout_s`` bounds wandb's own start. ``WANDB_MODE`` wins over ``mode``.
    """
    if mode not in ("auto", "online", "offline", "disabled"):
        raise ValueError(f"logger.mode must be auto, online, offline or disabled, got {mode!r}")
    if isinstance(init_timeout_s, bool) or not isinstance(init_timeout_s, (int, float)) or not init_timeout_s > 0:
        raise ValueError(f"logger.wandb.init_timeout_s must be a positive number of seconds, got {init_timeout_s!r}")
    mode = os.environ.get("WANDB_MODE") or mode
    base_url = _base_url()
    if mode == "online" and _wandb_api_key(base_url) is None:
        raise ValueError(f"logger.wandb.mode=online needs a W&B API key for {base_url}: set WANDB_API_KEY or run "
                         f"`wandb login`, or use logger.wandb.mode=auto (online when possible) or offline")
    if mode in ("auto", "online"):
        has_key = _wandb_api_key(base_url) is not None
        online = has_key and _reachable(base_url, timeout=min(5.0, init_timeout_s))
        if mode == "online" and not online:
            log.warning("wandb: cannot reach %s; logging offline to %s/wandb instead (upload later with "
                        "`wandb sync`)", base_url, save_dir)
        elif not online:
            log.info("wandb: %s, logging offline to %s/wandb (upload later with `wandb sync`)",
                     "no connection to " + base_url if has_key else "no API key", save_dir)
        mode = "online" if online else "offline"
    if mode == "online":  # reachable now; still bound the handshake, e.g. a proxy that accepts and never answers
        import wandb

        kwargs.setdefault("settings", wandb.Settings(init_timeout=init_timeout_s))
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    if mode == "disabled":
        kwargs["mode"] = "disabled"
    return WandbLogger(save_dir=save_dir, project=project, name=name, offline=mode == "offline", **kwargs)


class _AppendingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:
        """Keep an existing ``metrics.csv`` (Lightning's writer deletes it) and continue its columns."""
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                self.metrics_keys = sorted(next(csv.reader(file), []))


class AppendingCSVLogger(CSVLogger):
    """``CSVLogger`` whose ``metrics.csv`` keeps the rows already there: a run resumed in its own folder
    (``ckpt_path=<run>/checkpoints/last.ckpt hydra.run.dir=<run>``) continues the loss curve instead of erasing it.
    Any other launch into a folder with a run in it is refused before it starts (``ringdit.commands.run_folder``)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment
