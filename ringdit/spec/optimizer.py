"""``OptimizerSpec``: how a training run updates its weights -- the optimizer and learning-rate schedule (Hydra
``_partial_`` targets, swappable from the command line) and the EMA of the weights.

Their numbers are checked here, before anything is built: torch and Lightning would refuse them only once training
had started (after spawning), or accept them and quietly do something else (a negative lr climbs the loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import hydra
from omegaconf import DictConfig, OmegaConf

from ringdit.common.errors import ConfigError, require_count, require_number
from ringdit.training.optimizers import check_optimizer_installed, optimizer_states
from ringdit.spec.setting_types import check_setting_types

# ringdit's optimizers that pass their settings on (``**settings``) to another class: theirs are that class's
FORWARDED = {"ringdit.training.optimizers.adamw8bit": "torchao.optim.AdamW8bit"}


@dataclass(frozen=True)
class OptimizerSpec:
    optimizer: dict          # conf/optimizer: a _partial_ target that takes the parameters (torch.optim.AdamW ...)
    scheduler: dict | None   # conf/scheduler: a _partial_ target that takes the optimizer; None: a constant lr
    ema_decay: float | None  # the EMA's decay per step, in [0, 1]; null or 0: no EMA

    @property
    def name(self) -> str | None:
        """The optimizer's import path, as errors name it (optimizer=torch.optim.SGD)."""
        return self.optimizer.get("_target_")

    @property
    def states(self) -> tuple[int, bool]:
        """(states per trainable parameter, whether 8-bit): what the memory estimate counts; an optimizer ringdit
        does not know is counted as AdamW (two fp32 states)."""
        return optimizer_states(self.optimizer) or (2, False)

    def optimizer_factory(self) -> Callable | None:
        """``params -> optimizer``: the optimizer partial (instantiated on call: the import comes when needed)."""
        return hydra.utils.instantiate(self.optimizer) if self.optimizer else None

    def scheduler_factory(self) -> Callable | None:
        return hydra.utils.instantiate(self.scheduler) if self.scheduler else None  # scheduler=constant: none

    @classmethod
    def from_config(cls, cfg: DictConfig) -> OptimizerSpec:
        require_number("ema_decay", cfg.ema_decay, low=0, high=1, optional=True)
        optimizer = OmegaConf.to_container(cfg.optimizer, resolve=True) if cfg.get("optimizer") else {}
        check_optimizer_installed(optimizer.get("_target_"))  # optimizer=adamw8bit without torchao
        check_optimizer_settings(optimizer)
        if "lr" in optimizer:
            require_number("optimizer.lr", optimizer["lr"], low=0)  # 0 is legitimate: evaluate a start, freeze a run
        for key in ("weight_decay", "momentum", "eps"):
            if key in optimizer:
                require_number(f"optimizer.{key}", optimizer[key], low=0)
        if "dampening" in optimizer:
            require_number("optimizer.dampening", optimizer["dampening"], low=0, high=1)
        if "block_size" in optimizer:
            require_count("optimizer.block_size", optimizer["block_size"], hint="values per fp32 scale of the "
                          "8-bit states, e.g. optimizer.block_size=256")
        if "betas" in optimizer:
            check_betas(optimizer["betas"])
        if optimizer.get("nesterov") and not (optimizer.get("momentum") and not optimizer.get("dampening")):
            raise ConfigError(f"optimizer.nesterov=true needs momentum and no dampening (torch's SGD), but "
                              f"optimizer.momentum={optimizer.get('momentum', 0)} and optimizer.dampening="
                              f"{optimizer.get('dampening', 0)}; set optimizer.momentum=0.9 (and dampening 0), or "
                              f"nesterov=false")
        scheduler = OmegaConf.to_container(cfg.scheduler, resolve=True) if cfg.get("scheduler") else None
        if "warmup_steps" in (scheduler or {}):
            require_count("scheduler.warmup_steps", scheduler["warmup_steps"], minimum=0)
        if "total_steps" in (scheduler or {}):
            require_count("scheduler.total_steps", scheduler["total_steps"])
        if "final_lr_fraction" in (scheduler or {}):
            require_number("scheduler.final_lr_fraction", scheduler["final_lr_fraction"], low=0, high=1)
        return cls(optimizer=optimizer, scheduler=scheduler, ema_decay=cfg.ema_decay)


def check_optimizer_settings(optimizer: dict) -> None:
    """Every ``optimizer.*`` key is a parameter of the optimizer, of the kind it declares (``fused`` true / false /
    null, ``block_size`` a whole number): torch would refuse an unknown key, or a ``nesterov=maybe``, only in the
    ranks, and take ``fused=maybe`` as true."""
    import inspect

    target = optimizer.get("_target_")
    if not target:
        return
    try:
        cls = hydra.utils.get_object(FORWARDED.get(target, target))
    except Exception as error:  # noqa: BLE001 - an import path that does not import
        raise ConfigError(f"optimizer._target_={target} does not import ({str(error).splitlines()[0]}); pick "
                          f"optimizer=adamw, adamw8bit or sgd") from None
    settings = {key: value for key, value in optimizer.items() if key not in ("_target_", "_partial_")}
    parameters = inspect.signature(cls).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        known = [name for name in parameters if name != "params"]
        for key in settings:
            if key not in parameters or key == "params":
                raise ConfigError(f"optimizer.{key} is not a setting of {FORWARDED.get(target, target)}; drop it, or "
                                  f"use one of {', '.join(known)}")
    check_setting_types("optimizer", settings, cls)


def check_betas(betas) -> None:
    """Adam's two moment decays, each in [0, 1): torch refuses 1 (it never forgets a gradient) only in the ranks."""
    example = "e.g. optimizer.betas=[0.9,0.99]"
    if not isinstance(betas, (list, tuple)) or len(betas) != 2:
        raise ConfigError(f"optimizer.betas={betas!r} must be two numbers in [0, 1), the moments' decays, {example}")
    for i, beta in enumerate(betas):
        require_number(f"optimizer.betas[{i}]", beta, low=0, high=1)
        if beta == 1:
            raise ConfigError(f"optimizer.betas[{i}] must be in [0, 1), got 1: a decay of 1 never forgets a gradient "
                              f"(torch refuses it); {example}")
