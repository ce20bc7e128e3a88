"""Checkpoint inspection before any process is spawned, and ``CheckpointPlan``: where a training run's weights come
from -- a checkpoint it resumes, weights it starts from, LoRA adapters on them. ``LoraBase``: where a sampling run
finds the base under an adapter-only LoRA checkpoint.

A weights file is read here as it will be loaded later (EMA or raw weights, a sharded folder's metadata only) and
checked against the model built on the meta device, so that a wrong file costs seconds, not a spawned job; errors
name the setting that named the file.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ringdit.checkpoints.fit import LABEL_TABLE, check_compatible, first_misfit, resize_label_embedding
from ringdit.checkpoints.location import SHARDED_METADATA, is_sharded_checkpoint, recover_checkpoint
from ringdit.checkpoints.loading import safe_torch_load
from ringdit.checkpoints.weights import WEIGHT_CHOICES, read_weights
from ringdit.diffusion.distillation import CRITIC_METHODS
from ringdit.common.errors import CheckpointError, ConfigError, require_choice
from ringdit.models.lora import (adapter_state, add_lora, check_adapter_fits, check_lora_settings, is_adapter_key,
                          is_null_condition_key, lora_enabled)
from ringdit.training.resume import check_resume, check_resumed_models
from ringdit.parallel.layout import device_type
from ringdit.spec.model import ModelSpec, model_class

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
        if cfg.init_resize_labels and lora_enabled(_lora_settings(cfg)):
            raise ConfigError("init_resize_labels=true with lora.rank > 0: the new classes' label rows would stay at "
                              "their random init (LoRA freezes the label table and does not save it); fine-tune "
                              "the new classes without LoRA (lora.rank=0), then add LoRA on that run's weights")

    @classmethod
    def from_config(cls, cfg: DictConfig, meta_model: nn.Module, *, optimizer: OptimizerSpec,
                    max_steps: int, expert: str | None = None) -> CheckpointPlan:
        """Resolve ``ckpt_path`` and check every file the run will load against ``meta_model`` (the plain model),
        the LoRA targets against its modules, and that a resumed checkpoint can continue this run."""
        lora = _lora_settings(cfg)
        if lora_enabled(lora):
            check_lora(meta_model, lora)
        ckpt_path = resolve_ckpt_path(cfg.ckpt_path, cfg.paths.log_dir, cfg.task_name)
        distill = OmegaConf.to_container(cfg.distill, resolve=True) if cfg.get("distill") else None
        if ckpt_path:  # first: a distillation's checkpoint under plain training (or back) fits nothing below
            check_resumed_models(ckpt_path, recorded_hparams(ckpt_path), distill)
        if ckpt_path and lora_enabled(lora):
            check_lora_checkpoint(ckpt_path)
        elif ckpt_path:
            check_weights_file("ckpt_path", ckpt_path, meta_model, prefer="model")
            check_resume(ckpt_path, max_steps=max_steps, optimizer=optimizer.optimizer_factory(),
                         optimizer_name=optimizer.name, resume_optimizer=cfg.resume_optimizer, expert=expert,
                         optimizers=2 if (distill or {}).get("method", "none") in CRITIC_METHODS else 1)
        elif cfg.init_from:  # a resumed run takes its weights from ckpt_path
            check_weights_file("init_from", cfg.init_from, meta_model, prefer=cfg.init_weights,
                               resize_labels=cfg.init_resize_labels)
        return cls(ckpt_path=ckpt_path,
                   init_from=None if ckpt_path and not lora_enabled(lora) else cfg.init_from,  # LoRA resumes adapters
                   init_weights=cfg.init_weights, init_resize_labels=cfg.init_resize_labels,
                   resume_optimizer=cfg.resume_optimizer, lora=lora if lora_enabled(lora) else None)


def _lora_settings(cfg: DictConfig) -> dict | None:
    """The ``lora`` settings, ``base_dtype``'s null resolved for the run's device (``default_base_dtype``) here, so that
    the checkpoint's hyper-parameters record the dtype the base was held in, not "whatever the machine chose"."""
    if not cfg.get("lora"):
        return None
    lora = OmegaConf.to_container(cfg.lora, resolve=True)
    check_lora_settings(lora)  # first: lora_enabled compares the rank (lora.rank=abc)
    if lora_enabled(lora) and lora.get("base_dtype") is None:
        lora["base_dtype"] = default_base_dtype(device_type(cfg.trainer))
    return lora


def default_base_dtype(device: str) -> str:
    """``lora.base_dtype=null``: bfloat16 on GPUs, where it halves the frozen base and bf16 matmuls are fast; float32
    on CPUs, whose bf16 matmuls are slow (and where the memory of tiny runs does not matter)."""
    return "bfloat16" if device == "cuda" else "float32"


def check_lora(meta_model: nn.Module, lora: dict) -> nn.Module:
    """The LoRA settings are valid and ``lora.targets`` match modules of the model; returns the adapted meta copy."""
    with torch.device("meta"):
        return add_lora(copy.deepcopy(meta_model), **lora)  # a copy: weights files are checked against the plain model


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
            and model.diffusers_folders:
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


# ---- sampling an adapter-only LoRA checkpoint -------------------------------------------------------------------


@dataclass(frozen=True)
class LoraBase:
    """A LoRA checkpoint holds only the adapters; ``infer.py`` builds the base they were trained on and loads them onto
    it. The base is ``base=`` when given, else what the run recorded: its ``init_from``, else its
    ``model.pretrained``."""

    ckpt_path: str
    settings: dict           # the run's LoRA settings (rank, alpha, targets, base_dtype): the same adapters again
    model: dict              # the model config to build: the run's, with a diffusers base folder as model.pretrained
    init_from: str | None    # a weights file loaded under the adapters; None: the model config's pretrained holds them
    init_weights: str        # ema | model: which weights of a ringdit .ckpt init_from
    described: str           # the base as the user named it, or as the run recorded it, for errors

    @classmethod
    def from_checkpoint(cls, ckpt_path: str, state: dict, info: dict, base: str | None) -> LoraBase | None:
        """The base of ``ckpt_path`` (read as ``state``, ``info``); None when it holds a whole model."""
        settings = info.get("lora")
        if not lora_enabled(settings):
            if state and all(is_adapter_key(key) or is_null_condition_key(key) for key in state):
                raise ConfigError(f"ckpt_path={ckpt_path} holds only LoRA adapter weights, without the LoRA settings "
                                  f"(rank, alpha) of the run that trained them: sample that run's own checkpoint "
                                  f"(checkpoints/last.ckpt) with base= if needed")
            if base:
                raise ConfigError(f"base={base} is the base model under a LoRA adapter, but ckpt_path={ckpt_path} "
                                  f"holds a whole model; drop base=")
            return None
        hparams = recorded_hparams(ckpt_path)
        model = dict(info["model"])
        init_weights = hparams.get("init_weights") or "ema"
        if base:
            described = f"base={base}"
        elif hparams.get("init_from"):
            base = str(hparams["init_from"])
            described = f"the run's init_from={base}"
        elif model.get("pretrained"):  # the base is built from the model config itself
            described = f"the run's model.pretrained={model['pretrained']}"
            return cls(ckpt_path, settings, model, None, init_weights, described)
        else:
            raise ConfigError(f"ckpt_path={ckpt_path} holds only LoRA adapters, and its run recorded no base model "
                              f"(no init_from, no model.pretrained: the adapters were trained on a random init that "
                              f"no file holds); pass base=<the weights they were trained on: a ringdit .ckpt or "
                              f".safetensors export, or a diffusers folder>")
        if Path(base).expanduser().is_dir() and not is_sharded_checkpoint(base):  # a diffusers folder
            if not model_class(model).diffusers_folders:
                raise ConfigError(f"{described} is a folder, but the model of the LoRA adapter in "
                                  f"ckpt_path={ckpt_path} is a DiT, whose weights are a ringdit .ckpt or .safetensors "
                                  f"export; give one of those as base=")
            return cls(ckpt_path, settings, {**model, "pretrained": base}, None, init_weights, described)
        return cls(ckpt_path, settings, model, base, init_weights, described)

    def model_spec(self, ulysses_degree: int) -> tuple[ModelSpec, nn.Module]:
        """The model to sample, and that model built on the meta device; a base folder that does not build (another
        family, a missing folder) is named with the adapter's checkpoint."""
        try:
            return ModelSpec.from_config(self.model, ulysses_degree)
        except ConfigError as error:
            if self.init_from is not None:  # the run's own model config failed, not the base
                raise
            raise ConfigError(f"{self.described}, the base of the LoRA adapter in ckpt_path={self.ckpt_path}, cannot "
                              f"be built: {error}; pass base=<the diffusers folder the adapter was trained on>"
                              ) from None

    def check(self, meta_model: nn.Module, adapter: dict) -> None:
        """The base fits the model the adapter was trained on (names and shapes), and the adapter fits the base:
        before any process starts, naming the first key that does not."""
        fix = "give base= the weights the run fine-tuned (its init_from or model.pretrained): same family and size"
        recorded, built = self.model.get("config"), meta_model.architecture
        if self.init_from is None and recorded and built is not None:  # a diffusers folder: the architecture the
            # run recorded (config_for_data) against the folder's; adapters on attention alone would fit a wider MLP
            differs = [key for key in sorted(recorded)
                       if key in built and _as_json(built[key]) != _as_json(recorded[key])]
            if differs:
                shown = ", ".join(f"{key} {_as_json(built[key])} (trained on {_as_json(recorded[key])})"
                                  for key in differs[:3])
                raise ConfigError(f"{self.described} does not fit the LoRA adapter in ckpt_path={self.ckpt_path}: its "
                                  f"architecture differs: {shown}; {fix}")
        if self.init_from is not None:
            try:
                base, _ = read_weights(self.init_from, prefer=self.init_weights, load_tensors=False)
            except CheckpointError as error:
                raise ConfigError(f"{self.described}, the base of the LoRA adapter in ckpt_path={self.ckpt_path}, "
                                  f"cannot be read: {error}; pass base=PATH to the weights it was trained on") from None
            problem = first_misfit(meta_model.state_dict(), base, "the base", "the model the adapter was trained on")
            if problem is not None:
                raise ConfigError(f"{self.described} does not fit the LoRA adapter in ckpt_path={self.ckpt_path}: "
                                  f"{problem}; {fix}")
        problem = check_adapter_fits(check_lora(meta_model, self.settings), adapter, model_named="the base")
        if problem is not None:
            raise ConfigError(f"{self.described} does not fit the LoRA adapter in ckpt_path={self.ckpt_path}: "
                              f"{problem}; {fix}")


def _as_json(value):
    """A config value as JSON has it (tuples as lists), so a folder's config.json and a recorded config compare."""
    return json.loads(json.dumps(value))


def recorded_hparams(ckpt_path: str) -> dict:
    """The settings a ringdit training checkpoint recorded (Lightning's ``hyper_parameters``: ``init_from``,
    ``init_weights``, ...), from a file or a sharded folder's ``meta.pt``; ``{}`` for an export, or a file that is
    not a readable checkpoint (whoever reads its weights says what is wrong with it)."""
    path = Path(ckpt_path).expanduser()
    if path.suffix == ".safetensors":
        return {}
    try:
        content = safe_torch_load(path / SHARDED_METADATA if is_sharded_checkpoint(path) else path, mmap=True)
    except CheckpointError:
        return {}
    hparams = content.get("hyper_parameters") if isinstance(content, dict) else None
    return hparams if isinstance(hparams, dict) else {}
