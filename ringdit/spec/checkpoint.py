"""Checkpoint inspection before any process is spawned, and ``CheckpointPlan``: where a training run's weights come
from -- a checkpoint it resumes, weights it starts from, LoRA adapters on them.

A weights file is read here as it will be loaded later (EMA or raw weights, a sharded folder's metadata only) and
checked against the model built on the meta device, so that a wrong file costs seconds, not a spawned job; errors
name the setting that named the file.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ringdit.checkpoints.fit import LABEL_TABLE, check_compatible, resize_label_embedding
from ringdit.checkpoints.layout import is_sharded_checkpoint, recover_checkpoint
from ringdit.checkpoints.weights import WEIGHT_CHOICES, read_weights
from ringdit.errors import CheckpointError, ConfigError, require_choice
from ringdit.lora import adapter_state, add_lora, check_lora_settings, lora_enabled
from ringdit.resume import check_resume

if TYPE_CHECKING:
    from ringdit.spec.optimizer import OptimizerSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointPlan:
    ckpt_path: str | None     # the training checkpoint to resume ('last' resolved); None: a new run
    init_from: str | None     # weights to start from; None when ckpt_path resumes them (a LoRA run: the base's)
    init_weights: str         # which weights of a ringdit .ckpt init_from starts from: ema | model
    init_resize_labels: bool  # init_from of another class count: shared classes and the null class kept
    resume_optimizer: bool    # false: ckpt_path resumes weights, EMA, step and data position, not the optimizer
    lora: dict | None         # the LoRA settings when lora.rank > 0; None: every weight trains

    @staticmethod
    def check_settings(cfg: DictConfig) -> None:
        """The settings alone (cheap: before the data is opened); the files are checked in ``from_config``."""
        require_choice("init_weights", cfg.init_weights, WEIGHT_CHOICES)
        check_lora_settings(_lora_settings(cfg))

    @classmethod
    def from_config(cls, cfg: DictConfig, meta_model: nn.Module, *, optimizer: OptimizerSpec,
                    max_steps: int) -> CheckpointPlan:
        """Resolve ``ckpt_path`` and check every file the run will load against ``meta_model`` (the plain model),
        the LoRA targets against its modules, and that a resumed checkpoint can continue this run."""
        lora = _lora_settings(cfg)
        if lora_enabled(lora):
            check_lora(meta_model, lora)
        ckpt_path = resolve_ckpt_path(cfg.ckpt_path, cfg.paths.log_dir, cfg.task_name)
        if ckpt_path and lora_enabled(lora):
            check_lora_checkpoint(ckpt_path)
        elif ckpt_path:
            check_weights_file("ckpt_path", ckpt_path, meta_model, prefer="model")
            check_resume(ckpt_path, max_steps=max_steps, optimizer=optimizer.optimizer_factory(),
                         optimizer_name=optimizer.name, resume_optimizer=cfg.resume_optimizer)
        elif cfg.init_from:  # a resumed run takes its weights from ckpt_path
            check_weights_file("init_from", cfg.init_from, meta_model, prefer=cfg.init_weights,
                               resize_labels=cfg.init_resize_labels)
        return cls(ckpt_path=ckpt_path,
                   init_from=None if ckpt_path and not lora_enabled(lora) else cfg.init_from,  # LoRA resumes adapters
                   init_weights=cfg.init_weights, init_resize_labels=cfg.init_resize_labels,
                   resume_optimizer=cfg.resume_optimizer, lora=lora if lora_enabled(lora) else None)


def _lora_settings(cfg: DictConfig) -> dict | None:
    return OmegaConf.to_container(cfg.lora, resolve=True) if cfg.get("lora") else None


def check_lora(meta_model: nn.Module, lora: dict) -> None:
    """The LoRA settings are valid and ``lora.targets`` match modules of the model (on a meta copy)."""
    with torch.device("meta"):
        add_lora(copy.deepcopy(meta_model), **lora)  # a copy: the weights files are checked against the plain model


def read_weights_file(setting: str, path: str, prefer: str = "ema", load_tensors: bool = True) -> tuple[dict, dict]:
    """``read_weights`` with its errors attributed to the setting that named the file."""
    try:
        return read_weights(path, prefer, load_tensors=load_tensors)
    except CheckpointError as error:
        raise ConfigError(f"{setting}: {error}") from None


def check_weights_file(setting: str, path: str, model: nn.Module, prefer: str = "ema", state: dict | None = None,
                       resize_labels: bool = False) -> None:
    """``path`` exists, is safely readable and fits ``model`` (pass ``state`` if it was read already); for a
    diffusers model, ``path`` may also be a diffusers folder of the same architecture."""
    if state is None and Path(path).expanduser().is_dir() and not is_sharded_checkpoint(path) \
            and hasattr(model, "check_pretrained"):
        model.check_pretrained(str(Path(path).expanduser()))
        return
    if state is None:  # a sharded checkpoint's shapes come from its metadata: nothing is read into memory
        state, _ = read_weights_file(setting, path, prefer, load_tensors=False)
    if resize_labels:
        state = resize_label_embedding(state, model.state_dict()[LABEL_TABLE].shape[0])
    try:
        check_compatible(model, state, source=f"{setting}={path}")
    except CheckpointError as error:
        raise ConfigError(f"{setting}: {error}") from None


def check_lora_checkpoint(ckpt_path: str) -> None:
    """A LoRA run resumes adapter weights: the checkpoint must hold some (its base weights come from init_from)."""
    state, _ = read_weights_file("ckpt_path", ckpt_path, prefer="model", load_tensors=False)
    if not adapter_state(state):
        raise ConfigError(f"ckpt_path={ckpt_path} holds no LoRA adapter weights but lora.rank > 0: resume it without "
                          f"LoRA (lora.rank=0), or start LoRA from its weights with init_from={ckpt_path}")


def resolve_ckpt_path(ckpt_path: str | None, log_dir: str, task_name: str) -> str | None:
    """``last`` -> the newest ``checkpoints/last.ckpt`` of this task's earlier runs; a path must exist."""
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        root = Path(log_dir, task_name)  # runs/<time>/ and multiruns/<time>/<job>/
        for interrupted in [*root.glob("*/*/checkpoints/.last.ckpt.old"), *root.glob("*/*/*/checkpoints/.last.ckpt.old")]:
            recover_checkpoint(interrupted.with_name("last.ckpt"))
        candidates = [*root.glob("*/*/checkpoints/last.ckpt"), *root.glob("*/*/*/checkpoints/last.ckpt")]
        if not candidates:
            raise ConfigError(f"ckpt_path=last: no checkpoints/last.ckpt under {Path(log_dir, task_name)}; "
                              f"pass the checkpoint's path instead")
        newest = max(candidates, key=lambda p: p.stat().st_mtime)
        log.info("ckpt_path=last resolved to %s", newest)
        return str(newest)
    recover_checkpoint(Path(ckpt_path))
    if not Path(ckpt_path).is_file() and not is_sharded_checkpoint(ckpt_path):
        raise ConfigError(f"ckpt_path={ckpt_path!r} does not exist" + (
            " (a folder, but not a sharded checkpoint: it lacks meta.pt or .metadata)" if Path(ckpt_path).is_dir() else ""))
    return ckpt_path


def resolve_sampling_ckpt(ckpt_path: str | None, log_dir: str, train_task: str = "train") -> str:
    """infer.py's ``ckpt_path``: ``last`` (the default) -> the newest training run's ``last.ckpt``; a missing run
    says how to make one."""
    if ckpt_path in (None, "", "last"):
        try:
            return resolve_ckpt_path("last", log_dir, train_task)
        except ConfigError:
            raise ConfigError(f"ckpt_path={ckpt_path or 'last'}: no training run under {Path(log_dir, train_task)} "
                              f"(no checkpoints/last.ckpt); train one with `python train.py`, or pass "
                              f"ckpt_path=PATH to a .ckpt or .safetensors") from None
    return ckpt_path
