"""rCM's recipe details beside its loss (docs/distillation.md, consistency distillation): the critic's own learning
rate (``distill.critic_lr``; rCM: a fifth of the student's) and its refusal."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import SGD, TINY, assert_refused, fail_fast, run

pytestmark = pytest.mark.timeout(600)

FP64 = ["trainer.precision=64-true"]
# one rCM update from the teacher: no warm-up, so the critic updates once (its first update, before the student
# moves, sees the same samples whatever the critic's rate) and then the student
ONE_UPDATE = [*FP64, *SGD, "distill=rcm", "distill.warmup_steps=0", "distill.critic_steps=1", "trainer.max_steps=1",
              "distill.steps=1"]


def critic_of(run_dir) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    return {k[len("critic."):]: v for k, v in state.items() if k.startswith("critic.")}


def test_the_critic_learns_at_its_own_rate(tiny_checkpoint, tmp_path):
    """Plain SGD moves a weight by -lr x its gradient: at distill.critic_lr = optimizer.lr / 5 the critic's first
    update is a fifth of the one at the optimizer's rate, weight by weight (float64: to ~1e-12 of the step)."""
    from ringdit.checkpoints.weights import read_weights

    teacher = read_weights(tiny_checkpoint, prefer="ema")[0]
    run("train.py", tmp_path / "same", *TINY, *ONE_UPDATE, f"init_from={tiny_checkpoint}")
    run("train.py", tmp_path / "fifth", *TINY, *ONE_UPDATE, f"init_from={tiny_checkpoint}", "distill.critic_lr=0.1")
    same, fifth = critic_of(tmp_path / "same"), critic_of(tmp_path / "fifth")
    moved = 0
    for name, start in teacher.items():
        full, small = same[name] - start.double(), fifth[name] - start.double()
        scale = full.abs().max().item()
        torch.testing.assert_close(small, full / 5, rtol=0, atol=1e-12 * max(scale, 1e-12), msg=name)
        moved = max(moved, scale)
    assert moved > 1e-6  # the critic did learn


def test_a_bad_critic_lr_is_refused_and_the_advice_trains(tiny_checkpoint, tmp_path):
    proc, seconds = fail_fast("train.py", *TINY, f"init_from={tiny_checkpoint}", "distill=rcm",
                              "distill.critic_lr=-1", f"hydra.run.dir={tmp_path / 'refused'}")
    assert_refused(proc, text="distill.critic_lr=-1 must be a finite number > 0 (the critic's learning rate; rCM: "
                   "a fifth of the student's, e.g. distill.critic_lr=4e-5 beside optimizer.lr=2e-4), or null for "
                   "the optimizer's", seconds=seconds, run_dir=tmp_path / "refused")
    run("train.py", tmp_path / "advice", *TINY, f"init_from={tiny_checkpoint}", "distill=rcm", "distill.critic_lr=4e-5",
        "optimizer.lr=2e-4", "distill.warmup_steps=0", "distill.critic_steps=1", "trainer.max_steps=1")
    assert (tmp_path / "advice" / "checkpoints" / "last.ckpt").exists()
