"""``python -m ringdit.plan experiment=<preset>``: a train.py preset (conf/experiment/) laid out as it would run.

The preset is composed as train.py composes it, and what it sets that the planner reads becomes the planner's own
settings, placed before the command line's (which win): the model, its LoRA, memory options, precision, optimizer,
EMA, distillation, expert, batch, the clips' size and frames (``data.size`` / ``data.frames``), its previews
(``callbacks.sample_grid``) and sampling settings. The layout -- the degrees and ``trainer/strategy`` -- is laid
out afresh, so the plan says whether the preset's own layout is the best; ``ring_degree=2 ...`` on the command line
pins it."""

from __future__ import annotations

import functools

from omegaconf import DictConfig, OmegaConf

from ringdit.commands.cli import command_config, model_preset
from ringdit.common.errors import ConfigError

# the preset's layout, compared with the recommendation (not pinned: the planner lays out every one)
LAYOUT_KEYS = ("dp_degree", "ring_degree", "ulysses_degree")


def _word(key: str, value) -> str:
    """One override ``key=value`` in the command line's syntax (lists and null included)."""
    if value is None:
        return f"{key}=null"
    if isinstance(value, (list, tuple)):
        return f"{key}=[{','.join(str(v) for v in value)}]"
    return f"{key}={value}"


@functools.cache  # composed once per process: expand_experiment and the plan's run line both ask
def preset_overrides(name: str) -> tuple[list[str], dict]:
    """The planner's overrides for train.py's ``experiment=<name>``, and the preset's own layout (its degrees and
    strategy: what the recommendation is compared with)."""
    from hydra.core.hydra_config import HydraConfig

    cfg = command_config("train", [f"experiment={name}"])
    choices = HydraConfig.get().runtime.choices
    if choices.get("data") not in ("text_latents", "datasets"):  # prepared clips; the demos (digits, moving
        # digits) train at their own tiny sizes
        raise ConfigError(f"experiment={name} trains on data={choices.get('data')}, not on prepared clips; the planner "
                          f"lays out the real-model presets (experiment=wan21_14b_lora, flux_dev_lora, ...): give "
                          f"model=... data.size=... instead")
    if cfg.data.get("size") is None:
        raise ConfigError(f"experiment={name} does not say the size of its clips (data.size); pass data.size=[H,W] "
                          f"(and data.frames= for a video model) as prepared")
    words = [f"model={choices['model']}", *_model_differences(cfg, choices["model"])]
    words += [_word(f"data.{key}", OmegaConf.to_object(cfg.data[key]) if OmegaConf.is_config(cfg.data[key])
                    else cfg.data[key]) for key in ("size", "frames", "batch_size")]
    if cfg.data.get("latent") is False:  # the sizes are latent cells (MiniMax-H3's preset), as the planner's data.latent
        words.append("data.latent=false")
    rank = cfg.lora.rank or 0
    words.append(f"lora.rank={rank}")
    if rank:
        words += [_word("lora.alpha", cfg.lora.alpha), _word("lora.dropout", cfg.lora.dropout),
                  # train.py's null on CUDA: the base in bfloat16 (ringdit.costs.setup_from_config)
                  f"lora.base_dtype={cfg.lora.base_dtype or 'bfloat16'}"]
        if cfg.lora.targets:
            words.append(_word("lora.targets", list(cfg.lora.targets)))
    checkpointing = cfg.model.get("activation_checkpointing")
    words += [_word("model.activation_checkpointing", checkpointing if checkpointing is not None else False),
              _word("model.activation_offload", bool(cfg.model.get("activation_offload")))]
    words += [_word("trainer.precision", cfg.trainer.precision), _word("ema_decay", cfg.get("ema_decay"))]
    words.append(f"optimizer={choices['optimizer']}")
    if choices["optimizer"] == "sgd" and cfg.optimizer.get("momentum"):
        words.append(f"optimizer.momentum={cfg.optimizer.momentum}")
    words.append(f"distill={choices.get('distill', 'none')}")
    expert = OmegaConf.select(cfg, "diffusion.expert", default=None)
    if expert not in (None, "both"):
        words.append(f"diffusion.expert={expert}")
    grid = OmegaConf.select(cfg, "callbacks.sample_grid", default=None)
    if grid is not None:  # the previews as the preset draws them
        words += [_word(f"+callbacks.sample_grid.{key}", value) for key, value in grid.items()
                  if key in ("every_n_steps", "max_classes", "per_class", "batch_size", "steps", "cfg_scale")]
    sampling = OmegaConf.select(cfg, "diffusion.sampling", default=None) or {}
    words += [_word(f"+diffusion.sampling.{key}", value) for key, value in sampling.items()
              if value is not None and not OmegaConf.is_config(value)]
    layout = {key: cfg[key] for key in LAYOUT_KEYS} | {"strategy": choices["trainer/strategy"]}
    return words, layout


def _model_differences(cfg: DictConfig, model: str) -> list[str]:
    """``model.<key>=value`` for what the preset changes in ``model=<model>`` (the architecture, e.g. a config
    value; its memory options are given apart)."""
    base = OmegaConf.to_container(OmegaConf.create(model_preset(model)), resolve=True)
    ours = OmegaConf.to_container(cfg.model, resolve=True)
    skip = {"activation_checkpointing", "activation_offload", "pretrained"}
    return [_word(f"model.{key}", value) for key, value in ours.items()
            if key not in skip and not isinstance(value, dict) and base.get(key) != value]


def expand_experiment(argv: list[str]) -> tuple[list[str], str | None]:
    """``argv`` with ``experiment=<name>`` replaced by the preset's planner overrides, placed first so the command
    line's own settings win; and the preset's name (None: no preset)."""
    given = [word for word in argv if word.split("=", 1)[0] == "experiment"]
    if not given:
        return argv, None
    name = given[-1].split("=", 1)[1]
    words, layout = preset_overrides(name)
    ours = {word.split("=", 1)[0].lstrip("+") for word in words}
    # the preset's previews and sampling are added (+); the command line's +key of one of them now overrides it
    rest = [f"+{word}" if word.startswith("+") and not word.startswith("++") and word.split("=", 1)[0][1:] in ours
            else word for word in argv if word.split("=", 1)[0] != "experiment"]
    return [*words, *rest], name


def preset_run_line(name: str, preset: dict, best) -> str:
    """train.py's command for ``experiment=<name>`` on the recommended layout: the preset alone when it is the
    recommendation, else with the degrees and strategy that differ."""
    recommended = {"dp_degree": best.layout.dp_degree, "ring_degree": best.layout.ring_degree,
                   "ulysses_degree": best.layout.ulysses_degree, "strategy": best.layout.strategy}
    differ = [f"trainer/strategy={value}" if key == "strategy" else f"{key}={value}"
              for key, value in recommended.items() if preset[key] != value]
    said = ("the preset's own layout is the recommendation" if not differ else
            f"the preset sets dp={preset['dp_degree']} ring={preset['ring_degree']} "
            f"ulysses={preset['ulysses_degree']} {preset['strategy']}; the recommendation differs")
    return (f"Run it: python train.py experiment={name} {' '.join(differ)}".rstrip()
            + f" model.pretrained=... data.path=... ({said})")
