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

from ringdit.errors import require_count, require_number
from ringdit.optimizers import check_optimizer_installed


@dataclass(frozen=True)
class OptimizerSpec:
    optimizer: dict          # conf/optimizer: a _partial_ target that takes the parameters (torch.optim.AdamW ...)
    scheduler: dict | None   # conf/scheduler: a _partial_ target that takes the optimizer; None: a constant lr
    ema_decay: float | None  # the EMA's decay per step, in [0, 1]; null or 0: no EMA

    @property
    def name(self) -> str | None:
        """The optimizer's import path, as errors name it (optimizer=torch.optim.SGD)."""
        return self.optimizer.get("_target_")

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
        if "lr" in optimizer:
            require_number("optimizer.lr", optimizer["lr"], low=0)  # 0 is legitimate: evaluate a start, freeze a run
        for key in ("weight_decay", "momentum"):
            if key in optimizer:
                require_number(f"optimizer.{key}", optimizer[key], low=0)
        for i, beta in enumerate(optimizer.get("betas") or []):
            require_number(f"optimizer.betas[{i}]", beta, low=0, high=1)
        scheduler = OmegaConf.to_container(cfg.scheduler, resolve=True) if cfg.get("scheduler") else None
        if "warmup_steps" in (scheduler or {}):
            require_count("scheduler.warmup_steps", scheduler["warmup_steps"], minimum=0)
        if "total_steps" in (scheduler or {}):
            require_count("scheduler.total_steps", scheduler["total_steps"])
        if "final_lr_fraction" in (scheduler or {}):
            require_number("scheduler.final_lr_fraction", scheduler["final_lr_fraction"], low=0, high=1)
        return cls(optimizer=optimizer, scheduler=scheduler, ema_decay=cfg.ema_decay)
