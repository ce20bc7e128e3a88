"""Checks of a training checkpoint given as ``ckpt_path=`` (resume), made before any rank is spawned.

Lightning finds these problems only after spawning, as a ``KeyError`` deep in its restore code, or not at all (a run
at its last step exits at once and reports outputs it did not write).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ringdit.checkpoints.location import is_sharded_checkpoint
from ringdit.checkpoints.loading import read_sharded_checkpoint, safe_torch_load, sharded_to_full_checkpoint
from ringdit.common.errors import CheckpointError, ConfigError

TRAINING_STATE = ("state_dict", "optimizer_states", "lr_schedulers", "loops", "global_step")


def check_resume(ckpt_path: str, *, max_steps: int, optimizer: Callable | None, optimizer_name: str,
                 resume_optimizer: bool = True, expert: str | None = None, optimizers: int = 1) -> dict:
    """Raise ``ConfigError`` if ``ckpt_path`` cannot resume this run; return the checkpoint (tensors memory-mapped).

    - a weights-only file (a safetensors export, a bare state dict, a checkpoint saved without optimizer state)
      belongs in ``init_from``;
    - the checkpoint's optimizer state must fit ``optimizer`` (a partial that takes ``params``), unless
      ``resume_optimizer`` is false (weights, EMA, step and data position resume; the optimizer starts afresh);
    - the checkpoint must be before ``max_steps``;
    - a two-expert model's checkpoint must have trained the same ``expert`` (``diffusion.expert``): another one's
      optimizer state holds another set of parameters (unless ``resume_optimizer`` is false).
    """
    if not isinstance(resume_optimizer, bool):
        raise ConfigError(f"resume_optimizer must be true or false, got {resume_optimizer!r}")
    use_init_from = (f"ckpt_path resumes a training checkpoint (a ringdit .ckpt with optimizer state and step); "
                     f"to start from these weights use init_from={ckpt_path}")
    if Path(ckpt_path).suffix == ".safetensors":
        raise ConfigError(f"ckpt_path={ckpt_path} holds weights only; {use_init_from}")
    try:
        if is_sharded_checkpoint(ckpt_path):  # FSDP's folder: shapes and param groups only, nothing big is read
            checkpoint = sharded_to_full_checkpoint(read_sharded_checkpoint(ckpt_path, keys=None, load_tensors=False))
        else:
            checkpoint = safe_torch_load(ckpt_path, mmap=True)
    except CheckpointError as error:
        raise ConfigError(f"ckpt_path: {error}") from None
    missing = [key for key in TRAINING_STATE if not isinstance(checkpoint, dict) or key not in checkpoint]
    if missing and not (not resume_optimizer and missing == ["optimizer_states"]):
        raise ConfigError(f"ckpt_path={ckpt_path} holds weights only (no {', '.join(missing)}); {use_init_from}")
    step = checkpoint["global_step"]
    if step >= max_steps:
        raise ConfigError(f"ckpt_path={ckpt_path} is at step {step} and trainer.max_steps={max_steps}: nothing is "
                          f"left to train; raise trainer.max_steps above {step} to train on")
    trained = (checkpoint.get("hyper_parameters") or {}).get("expert")
    if resume_optimizer and trained != expert:
        raise ConfigError(f"ckpt_path={ckpt_path} trained diffusion.expert={trained} but this run trains "
                          f"diffusion.expert={expert}: its optimizer state is another expert's; resume with "
                          f"diffusion.expert={trained}, or with resume_optimizer=false (weights, EMA, step and data "
                          f"position resume, the optimizer starts afresh)")
    if resume_optimizer and optimizer is not None:
        _check_optimizer(ckpt_path, checkpoint["optimizer_states"], optimizer, optimizer_name, optimizers)
    return checkpoint


def check_resumed_models(ckpt_path: str, hparams: dict, distill: dict | None) -> None:
    """``ckpt_path`` holds the models this run trains: a distillation's (``distill``: the run's ``distill`` settings,
    method and GAN head) holds a student, its critic, maybe a GAN head and two optimizers; a plain run's one model and
    one optimizer. ``hparams``: what the checkpoint's run recorded. A mismatch is no resume (the state dicts do not
    fit): each message says how to resume it, and how to start this run from its weights instead."""
    run = dict(distill or {})
    run_method = run.get("method", "none")
    recorded = hparams.get("distill") or {}
    method = recorded.get("method", "none")
    if method != "none" and run_method == "none":
        teacher, start = recorded.get("teacher"), hparams.get("init_from")
        resume = f"distill={method}" + (f" init_from={start or teacher}" if start or teacher else
                                        " (its teacher: model.pretrained)")
        if teacher and start and teacher != start:  # a distilled student fine-tuned under its own teacher
            resume += f" distill.teacher={teacher}"
        raise ConfigError(f"ckpt_path={ckpt_path} is a distillation checkpoint (distill={method}: a student, its critic "
                          f"and their two optimizers), but this run has distill=none; resume the distillation with "
                          f"{resume}, or train its student on as a plain model, from its weights: init_from={ckpt_path} "
                          f"instead of ckpt_path")
    if method == "none" and run_method != "none":
        raise ConfigError(f"ckpt_path={ckpt_path} is a plain training checkpoint (one model, no critic), but this run "
                          f"has distill={run_method}; distil it as the teacher: init_from={ckpt_path} instead of "
                          f"ckpt_path, or resume its training with distill=none")
    if "none" != method != run_method:  # another method's models (sCM: no critic) and optimizers
        raise ConfigError(f"ckpt_path={ckpt_path} is a distill={method} checkpoint, but this run has "
                          f"distill={run_method} (other models and optimizers); resume it with distill={method}")
    if method != "none" and bool(recorded.get("gan_loss")) != bool(run.get("gan_loss")):
        had = bool(recorded.get("gan_loss"))
        raise ConfigError(f"ckpt_path={ckpt_path} was distilled {'with' if had else 'without'} the GAN head (its "
                          f"weights and optimizer state {'are' if had else 'are not'} in it), but this run has "
                          f"distill.gan_loss={str(not had).lower()}; resume with distill.gan_loss={str(had).lower()}")


def optimizer_signature(optimizer: torch.optim.Optimizer | dict) -> tuple[frozenset, frozenset]:
    """(hyper-parameter names of a param group, names of the per-parameter state) of an optimizer or its
    ``state_dict()``: what loading one optimizer's state into another needs to agree."""
    state = optimizer.state_dict() if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    groups = state.get("param_groups") or [{}]
    per_param = next(iter(state.get("state", {}).values()), {})
    return frozenset(groups[0]) - {"params", "initial_lr"}, frozenset(per_param)


def _check_optimizer(ckpt_path: str, saved_states: list, optimizer: Callable, optimizer_name: str,
                     optimizers: int = 1) -> None:
    """``optimizers``: how many the run has (a distillation: the student's and the critic's)."""
    probe = torch.nn.Parameter(torch.zeros(1))
    try:
        fresh = optimizer(params=[probe])
        probe.grad = torch.zeros(1)
        fresh.step()  # creates the per-parameter state (moments, momentum buffers)
    except Exception:  # an optimizer that cannot step alone (LBFGS needs a closure): nothing to compare with
        return
    groups, state = optimizer_signature(fresh)
    if len(saved_states) != optimizers:
        # (a distillation's checkpoint under plain training, or back, is refused before: check_resumed_models)
        raise ConfigError(f"ckpt_path={ckpt_path} holds {len(saved_states)} optimizer states, this run has "
                          f"{optimizers}; resume with resume_optimizer=false to start a fresh optimizer")
    signatures = [optimizer_signature(saved) for saved in saved_states]
    for saved_groups, saved_state in signatures:
        if saved_groups == groups and not (saved_state and state and saved_state != state):
            continue
        differ = sorted(saved_groups ^ groups) or sorted(saved_state ^ state)
        raise ConfigError(
            f"ckpt_path={ckpt_path} was trained with another optimizer than optimizer={optimizer_name} (their "
            f"settings differ in {', '.join(differ)}); resume with the optimizer it was trained with, or set "
            f"resume_optimizer=false to keep its weights, EMA, step and data position with a fresh optimizer"
        )
