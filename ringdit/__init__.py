"""ringdit: context-parallel Diffusion Transformers."""

import logging

from ringdit.common.errors import ConfigError

__version__ = "0.1.0"

# torchao (the 8-bit optimizer's library) is imported by diffusers and transformers whenever it is installed, and
# says at every import that its CUDA extensions do not load here and that a torch.compile registration is
# deprecated: nothing a ringdit user can act on, printed before every command's own output. Errors still show.
for _noisy in ("torchao", "diffusers.quantizers.torchao.torchao_quantizer", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)


# ---- the Python API: the code the commands run, from a notebook or a script (one-process runs in the caller's
# process; a layout of several ranks starts them as the command does) ----------------------------------------------


def config(command: str = "train", overrides=(), run_dir=None):
    """The settings of ``command`` (train, infer, serve, export, prepare, plan ...) with ``overrides`` (a list of
    strings), as its command line composes them (``ringdit.commands.cli.command_config``). A mistake raises
    ``ringdit.common.errors.ConfigError`` with the command line's one line (the setting, the value, the fix)."""
    # start-up time: `import ringdit` runs before every ringdit module; hydra and the configs load on use
    from ringdit.commands.cli import command_config

    return command_config(command, overrides, run_dir)


def train(cfg):
    """``python train.py``: train or fine-tune with ``cfg`` (``config("train", [...])``); returns the run folder."""
    # start-up time: `import ringdit` runs before every ringdit module; torch and Lightning load on use
    from ringdit.training.run import train as run

    return run(_settings_of(cfg, "train"))


def sample(cfg):
    """``python infer.py``: sample with ``cfg`` (``config("infer", [...])``); returns the run folder."""
    # start-up time: `import ringdit` runs before every ringdit module; torch and Lightning load on use
    from ringdit.commands.sample import sample as run

    return run(_settings_of(cfg, "infer"))


def serve(cfg) -> int:
    """``python -m ringdit.serve``: serve with ``cfg`` (``config("serve", [...])``) until drained; its exit code."""
    # start-up time: `import ringdit` runs before every ringdit module; torch and Lightning load on use
    from ringdit.serve import serve as run

    return run(_settings_of(cfg, "serve"))


def load(ckpt_path, *, device=None, weights: str = "ema", base=None, vae=None, text_encoder=None, size=None,
         frames=None):
    """A resident sampler of ``ckpt_path`` (a training checkpoint, a .safetensors export, a diffusers pipeline folder
    or a LoRA checkpoint), loaded once in this process with its text encoder and VAE; call it many times:
    ``pipe(prompts=[...])`` or ``pipe(labels=[...])`` with ``steps=``, ``cfg_scale=``, ``size=``, ``frames=``,
    ``seed=``, ``output=`` (``ringdit.sampling.resident``); ``size`` / ``frames``: the calls' default. One process; a
    layout of several ranks is the commands' job. A mistake raises ``ringdit.common.errors.ConfigError``: one line
    naming the argument and the fix."""
    from ringdit.sampling.resident import load as resident  # torch and the model code: not at ``import ringdit``

    return resident(ckpt_path, device=device, weights=weights, base=base, vae=vae, text_encoder=text_encoder,
                    size=size, frames=frames)


def _settings_of(cfg, command: str):
    """``cfg`` if it is ``config(command, ...)``'s kind of settings: a config holding every setting
    ``conf/<command>.yaml`` defines itself; else a ``ConfigError`` naming what was passed and what to pass."""
    from omegaconf import DictConfig, OmegaConf

    # start-up time: `import ringdit` runs before every ringdit module; hydra and the configs load on use
    from ringdit.commands.cli import CONF_DIR

    fix = f"pass ringdit.config({command!r}, [...])"
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"ringdit.{_RUNS[command]} takes the settings of {command}, got {type(cfg).__name__} "
                          f"{cfg!r:.60}; {fix}")
    own = set(OmegaConf.load(CONF_DIR / f"{command}.yaml")) - {"defaults", "hydra"}
    missing = sorted(own - set(cfg))
    if missing:
        raise ConfigError(f"ringdit.{_RUNS[command]} takes the settings of {command}, but the config passed has no "
                          f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} (another command's?); {fix}")
    return cfg


_RUNS = {"train": "train", "infer": "sample", "serve": "serve"}
