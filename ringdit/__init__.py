"""ringdit: context-parallel Diffusion Transformers."""

import logging

__version__ = "0.1.0"

# torchao (the 8-bit optimizer's library) is imported by diffusers and transformers whenever it is installed, and
# says at every import that its CUDA extensions do not load here and that a torch.compile registration is
# deprecated: nothing a ringdit user can act on, printed before every command's own output. Errors still show.
for _noisy in ("torchao", "diffusers.quantizers.torchao.torchao_quantizer", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)


# ---- the Python API: the code the commands run, from a notebook or a script (one-process runs in the caller's
# process; a layout of several ranks starts them as the command does) ----------------------------------------------


def config(command: str = "train", overrides=(), run_dir=None):
    """The settings of ``command`` (train, infer, serve, export, prepare, plan ...) with ``overrides``, as its command
    line composes them (``ringdit.cli.command_config``)."""
    from ringdit.cli import command_config

    return command_config(command, overrides, run_dir)


def train(cfg):
    """``python train.py``: train or fine-tune with ``cfg`` (``config("train", [...])``); returns the run folder."""
    from ringdit.training.run import train as run

    return run(cfg)


def sample(cfg):
    """``python infer.py``: sample with ``cfg`` (``config("infer", [...])``); returns the run folder."""
    from ringdit.inference import sample as run

    return run(cfg)


def serve(cfg) -> int:
    """``python -m ringdit.serve``: serve with ``cfg`` (``config("serve", [...])``) until drained; its exit code."""
    from ringdit.serve import serve as run

    return run(cfg)
