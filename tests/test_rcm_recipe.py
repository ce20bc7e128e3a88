"""rCM's recipe details beside its loss (docs/distillation.md, consistency distillation): the critic's own learning
rate (``distill.critic_lr``; rCM: a fifth of the student's) and its refusal."""

from __future__ import annotations

import numpy as np
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


def test_the_captioned_moving_digits_rcm_preset_composes_and_trains(tmp_path):
    """experiment=captioned_moving_digits_rcm distils a (one-update, one-layer) captioned moving digits teacher: one
    rCM update past the warm-up (the critic's update, the sCM loss, the DMD term and the regression onto the
    teacher's pairs for the data's prompts, all finite), a student checkpoint infer.py samples in 2 steps unguided."""
    import csv

    tiny = ["data.num_videos=32", "model.config.num_layers=1", "model.config.ffn_dim=32", "logger=csv",
            "callbacks.sample_grid.steps=2", "callbacks.sample_grid.per_class=1", "callbacks.sample_grid.max_classes=2"]
    env = {"HF_HUB_OFFLINE": "1"}
    run("train.py", tmp_path / "teacher", "experiment=captioned_moving_digits", *tiny, "trainer.max_steps=1", env=env)
    teacher = tmp_path / "teacher" / "checkpoints" / "last.ckpt"
    student = tmp_path / "student"
    run("train.py", student, "experiment=captioned_moving_digits_rcm", *tiny, f"init_from={teacher}",
        "trainer.max_steps=1", "distill.warmup_steps=0", "distill.critic_steps=1", "distill.regression_pairs=2",
        "data.batch_size=4", env=env)
    with open(student / "csv" / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("train/loss")]
    logged = {name: float(rows[-1][name]) for name in ("train/loss", "train/scm_loss", "train/dmd_loss",
                                                       "train/regression_loss", "train/critic_loss")
              if rows[-1].get(name)}
    assert len(logged) == 5 and all(torch.isfinite(torch.tensor(v)) for v in logged.values()), rows[-1]
    checkpoint = torch.load(student / "checkpoints" / "last.ckpt", weights_only=False)
    assert {key.split(".")[0] for key in checkpoint["state_dict"]} == {"model", "ema", "critic"}
    sampling = checkpoint["hyper_parameters"]["sampling"]
    assert (sampling["sampler"], sampling["steps"], sampling["cfg_scale"]) == ("fewstep", 2, 1.0)
    assert sampling["times"] == [0.9876543209876543, 0.5]
    run("infer.py", tmp_path / "infer", f"ckpt_path={student / 'checkpoints' / 'last.ckpt'}", "num_samples=2",
        "prompts=['a 3 moving left']", env=env)
    assert np.load(tmp_path / "infer" / "samples.npz")["images"].shape == (2, 5, 12, 12, 1)
