"""``TrainerSpec``: Lightning's Trainer settings (the strategy's among them) and the callbacks and loggers a run adds,
with the numbers Lightning would refuse only once training had started (or silently misuse) checked first."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from ringdit.common.errors import ConfigError, require_count, require_number


@dataclass(frozen=True)
class TrainerSpec:
    config: dict                 # conf/trainer, resolved: the Trainer's settings, the strategy's under "strategy"
    callbacks: tuple[dict, ...]  # each callbacks entry's config (with its _target_)
    loggers: tuple[dict, ...]    # each logger entry's config; none: no experiment tracker

    @property
    def max_steps(self) -> int | None:
        return self.config.get("max_steps")

    @staticmethod
    def check_settings(cfg: DictConfig, *, training: bool) -> None:
        """The numbers alone, before anything is resolved or built: ``trainer.max_steps`` first, as other settings
        default to it (the scheduler's total_steps, the validation interval)."""
        if training:
            require_count("trainer.max_steps", cfg.trainer.max_steps)
        trainer = cfg.trainer
        strategy = trainer.get("strategy")
        if isinstance(strategy, DictConfig):
            require_number("trainer.strategy.timeout_s", strategy.get("timeout_s"), low=0, low_open=True,
                           optional=True)
            require_number("trainer.strategy.rendezvous_timeout_s", strategy.get("rendezvous_timeout_s"), low=0,
                           low_open=True, optional=True)
        require_count("trainer.accumulate_grad_batches", trainer.get("accumulate_grad_batches", 1))
        require_number("trainer.gradient_clip_val", trainer.get("gradient_clip_val"), low=0, optional=True)
        require_count("trainer.log_every_n_steps", trainer.get("log_every_n_steps", 1), optional=True)
        interval = trainer.get("val_check_interval")
        if isinstance(interval, float):  # a fraction of an epoch
            require_number("trainer.val_check_interval", interval, low=0, high=1, low_open=True)
        else:  # a number of training batches
            require_count("trainer.val_check_interval", interval, optional=True)
        if training:
            _check_callback_numbers(cfg.get("callbacks") or {})

    @classmethod
    def from_config(cls, cfg: DictConfig, *, training: bool) -> TrainerSpec:
        """Resolved once the layout is known to be valid (the device count defaults to the degrees' product)."""
        return cls(config=OmegaConf.to_container(cfg.trainer, resolve=True),
                   callbacks=group_targets(cfg, "callbacks"),
                   loggers=group_targets(cfg, "logger") if training else ())


def _check_callback_numbers(callbacks: DictConfig) -> None:
    checkpoint = callbacks.get("model_checkpoint") or {}
    if "every_n_train_steps" in checkpoint:
        require_count("callbacks.model_checkpoint.every_n_train_steps", checkpoint.every_n_train_steps, minimum=0,
                      optional=True)
    grid = callbacks.get("sample_grid") or {}
    for key in ("every_n_steps", "per_class", "max_classes"):
        if key in grid:
            require_count(f"callbacks.sample_grid.{key}", grid[key])
    for key in ("batch_size", "fps"):  # null: all at once / the model's own frame rate
        if key in grid:
            require_count(f"callbacks.sample_grid.{key}", grid[key], optional=True)
    if "steps" in grid:
        require_count("callbacks.sample_grid.steps", grid.steps, optional=True)
    if "cfg_scale" in grid:
        require_number("callbacks.sample_grid.cfg_scale", grid.cfg_scale, optional=True)


def group_targets(cfg: DictConfig, group: str) -> tuple[dict, ...]:
    """The entries of a ``callbacks`` / ``logger`` group (resolved); an entry without ``_target_`` is a leftover
    setting."""
    entries = cfg.get(group) or {}
    for name, entry in entries.items():
        if "_target_" not in entry:
            raise ConfigError(f"{group}.{name} has settings ({', '.join(entry)}) but no _target_: its config was "
                              f"removed (e.g. {group}=none with an experiment that tunes it); drop the settings or "
                              f"keep the {group} config")
    return tuple(OmegaConf.to_container(entry, resolve=True) for entry in entries.values())
