"""distill=dmd2: DMD2 iterations (critic updates, then a student update) equal one process's under ring, Ulysses and
FSDP; a resumed distillation continues exactly; bad settings are refused before spawning; infer.py samples the
student with its recorded few-step grid, unguided."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ringdit.checkpoints.weights import read_weights
from tests.helpers import distill_losses, SGD, TINY, LazyRuns, assert_refused, assert_same_numbers, fail_fast, run

pytestmark = pytest.mark.timeout(600)

FP64 = ["trainer.precision=64-true"]
MOMENTUM = [*SGD, "optimizer.momentum=0.9"]  # SGD shows a wrongly scaled gradient; momentum makes resume need state
# the GAN head, weighted so that it moves the numbers as much as the other losses do (a wrong head gradient shows)
GAN = ["distill.gan_loss=true", "distill.gan_generator_weight=0.5", "distill.gan_critic_weight=0.5"]
REGRESSION = ["distill.regression_loss=true", "distill.regression_pairs=4", "distill.regression_weight=0.5"]
# (reference, layout, the losses' and the weights' relative tolerance)
LAYOUTS = {
    "one": FP64,
    "ring2": [*FP64, "ring_degree=2"],
    "ring2_ulysses2": [*FP64, "ring_degree=2", "ulysses_degree=2"],
    "one_fp32": [],  # FSDP has no float64 (Lightning's ModelParallelStrategy refuses 64-true)
    "fsdp_ring2_ulysses2": ["trainer/strategy=fsdp", "ring_degree=2", "ulysses_degree=2"],
    "gan_one": [*FP64, *GAN],
    "gan_ring2": [*FP64, *GAN, "ring_degree=2"],
    "gan_ring3": [*FP64, *GAN, "ring_degree=3"],  # 16 tokens in shards of 6: the last shard's 2 padded tokens
    "gan_one_fp32": GAN,
    "regression_one": [*FP64, *REGRESSION],
    # pseudo-Huber on 3 of the 4 pairs a update (a fresh draw, the same on both ranks and on resume)
    "regression_ring2": [*FP64, *REGRESSION, "ring_degree=2", "distill.regression_distance=pseudo_huber",
                         "distill.regression_batch=3"],
    "regression_one_huber": [*FP64, *REGRESSION, "distill.regression_distance=pseudo_huber",
                             "distill.regression_batch=3"],
    "gan_fsdp_ring2_ulysses2": [*GAN, "trainer/strategy=fsdp", "ring_degree=2", "ulysses_degree=2"],
}
# float64: a layout only reorders sums, each rounded at u = 1.1e-16, so the weights (max ~3) and the losses agree
# to ~1e-15 (measured at ring 2: 2e-16 in the weights, 1.4e-15 relative in the losses); rel 1e-10 is 1e5 x that.
# float32 (u = 6e-8): the student's loss is 0.5 mean(grad^2) of grad = p_fake - p_real, a difference of two close
# predictions divided by a mean, so its relative rounding is ~100 u: measured 9e-7 (FSDP) and 8e-6 (ring 2); the
# weights within 4.4e-7 (max ~3). rel 1e-4 and 1e-5 (+ atol 1e-5) are >= 10x that, and still far below what a
# wrongly scaled or reduced gradient moves (SGD at lr 0.5: >= 1e-3).
TOLERANCE = {"one": (1e-10, 1e-10, 1e-13), "one_fp32": (1e-4, 1e-5, 1e-5), "gan_one": (1e-10, 1e-10, 1e-13),
             "gan_one_fp32": (1e-4, 1e-5, 1e-5), "regression_one_huber": (1e-10, 1e-10, 1e-13)}
REFERENCE = {"ring2": "one", "ring2_ulysses2": "one", "fsdp_ring2_ulysses2": "one_fp32", "gan_ring2": "gan_one",
             "gan_ring3": "gan_one", "gan_fsdp_ring2_ulysses2": "gan_one_fp32",
             "regression_ring2": "regression_one_huber"}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("teacher")
    run("train.py", run_dir, *TINY)
    return run_dir / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, teacher):
    """3 DMD2 iterations of 2 critic updates and a student update each, SGD with momentum, per layout (each run
    when first read)."""
    common = [*TINY, *MOMENTUM, "distill=dmd2", f"init_from={teacher}", "distill.critic_steps=2"]
    return LazyRuns(tmp_path_factory.mktemp("dmd2"), LAYOUTS, *common)


def state(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


@pytest.mark.parametrize("layout", ["ring2", pytest.param("ring2_ulysses2", marks=pytest.mark.slow),
                                    "fsdp_ring2_ulysses2"])
def test_dmd2_iterations_equal_one_process(runs, layout):
    name = REFERENCE[layout]
    loss_tolerance, rtol, atol = TOLERANCE[name]
    reference, parallel = distill_losses(runs.trained(name)), distill_losses(runs.trained(layout))
    assert sorted(reference) == sorted(parallel) == [0, 1, 2]
    for step, (student, critic) in reference.items():
        assert parallel[step][0] == pytest.approx(student, rel=loss_tolerance), f"student loss, step {step}"
        assert parallel[step][1] == pytest.approx(critic, rel=loss_tolerance), f"critic loss, step {step}"
    assert reference[2][0] != pytest.approx(reference[0][0], rel=1e-3)  # the updates did change the models
    checkpoint = runs.trained(layout) / "checkpoints" / "last.ckpt"
    for prefer in ("model", "ema"):  # the student and its EMA (a sharded folder under FSDP)
        expected = read_weights(runs.trained(name) / "checkpoints" / "last.ckpt", prefer=prefer)[0]
        assert_same_numbers(read_weights(checkpoint, prefer=prefer)[0], expected, rtol=rtol, atol=atol,
                            where=f"{layout} {prefer}")
    if checkpoint.is_file():  # DDP: the critic too (FSDP: its losses above)
        expected = {k: v for k, v in state(runs.trained(name)).items() if k.startswith("critic.")}
        assert expected and all(v.dtype == torch.float64 for v in expected.values() if v.is_floating_point())
        got = {k: v for k, v in state(runs.trained(layout)).items() if k.startswith("critic.")}
        assert_same_numbers(got, expected, rtol=rtol, atol=atol, where=f"{layout} critic")


def test_the_checkpoint_holds_student_and_critic_not_the_teacher(runs, teacher):
    checkpoint = torch.load(runs.trained("one") / "checkpoints" / "last.ckpt", weights_only=False)
    assert {key.split(".")[0] for key in checkpoint["state_dict"]} == {"model", "ema", "critic"}
    assert len(checkpoint["optimizer_states"]) == 2 and checkpoint["global_step"] == 3  # student steps
    sampling = checkpoint["hyper_parameters"]["sampling"]
    assert sampling["sampler"] == "fewstep" and sampling["cfg_scale"] == 1.0
    assert sampling["steps"] == 4 and sampling["times"] == [1.0, 0.75, 0.5, 0.25]
    start = read_weights(teacher, prefer="ema")[0]
    for name in ("model", "critic"):  # both started from the teacher's EMA weights and moved
        moved = max((checkpoint["state_dict"][f"{name}.{key}"].double() - value.double()).abs().max().item()
                    for key, value in start.items())
        assert moved > 1e-4, name


def test_a_resumed_distillation_continues_exactly(runs, teacher, tmp_path):
    """Student, EMA, critic and both optimizers come back from step 2's checkpoint (momentum: the optimizer state
    matters); the third step then equals the uninterrupted run's, bit for bit."""
    first = runs.trained("one")
    resumed = tmp_path / "resumed"
    run("train.py", resumed, *TINY, *MOMENTUM, *FP64, "distill=dmd2", f"init_from={teacher}", "distill.critic_steps=2",
        f"ckpt_path={first / 'checkpoints' / 'step_0000002.ckpt'}")
    assert distill_losses(resumed)[2] == distill_losses(first)[2]
    assert_same_numbers(state(resumed), state(first), where="resumed")


def test_infer_samples_the_student_with_its_few_steps(runs, tmp_path, monkeypatch):
    """infer.py reads the student's sampler and grid from its checkpoint: 4 unguided evaluations per batch at model
    times 1000, 750, 500, 250; ``steps=2`` takes even times instead."""
    from ringdit.models import DiT

    seen = []
    forward = DiT.forward

    def counting(self, x, t, *args, **kwargs):
        seen.append((x.shape[0], sorted(set(t.tolist()))))
        return forward(self, x, t, *args, **kwargs)

    monkeypatch.setattr(DiT, "forward", counting)
    checkpoint = runs.trained("one") / "checkpoints" / "last.ckpt"
    run("infer.py", tmp_path / "four", f"ckpt_path={checkpoint}", "num_samples=6", "batch_size=6", "labels=[1,7]")
    assert seen == [(6, [1000.0]), (6, [750.0]), (6, [500.0]), (6, [250.0])]  # 6 samples: no guidance's 2x batch
    images = np.load(tmp_path / "four" / "samples.npz")["images"]
    assert images.shape == (6, 8, 8, 1)
    seen.clear()
    run("infer.py", tmp_path / "two", f"ckpt_path={checkpoint}", "num_samples=6", "batch_size=6",
        "diffusion.sampling.steps=2")
    assert [times for _, times in seen] == [[1000.0], [500.0]]


def test_cfg_parallel_on_an_unguided_student_is_refused_before_spawning(runs, tmp_path):
    """CFG parallel splits guidance's two halves over a pair of ranks; a student samples unguided, so the pair would
    compute the same samples twice: refused in one line, with the fix (and again when cfg_scale=1 is asked for)."""
    checkpoint = runs.trained("one") / "checkpoints" / "last.ckpt"
    proc, seconds = fail_fast("infer.py", f"ckpt_path={checkpoint}", "dp_degree=2", "cfg_parallel=true",
                              f"hydra.run.dir={tmp_path}")
    assert_refused(proc, text="cfg_parallel=true splits classifier-free guidance's two halves over two data-parallel "
                   "ranks, but this run samples unguided (diffusion.sampling.cfg_scale=1, as a distilled student's "
                   "few steps do), so each pair would compute the same samples twice; set cfg_parallel=false",
                   seconds=seconds, run_dir=tmp_path)


BAD = {
    "no teacher": ([], "distill=dmd2 needs a teacher: init_from="),
    "steps < 1": (["distill.steps=0"], "distill.steps must be a positive integer, got 0"),
    "times not decreasing": (["distill.steps=3", "distill.times=[1.0,0.5,0.7]"], "must decrease strictly"),
    "times outside (0, 1]": (["distill.steps=2", "distill.times=[1.5,0.5]"], "must decrease strictly and lie in"),
    "zero time": (["distill.steps=2", "distill.times=[1.0,0.0]"], "lie in (0, 1]"),
    "times of another count": (["distill.steps=4", "distill.times=[1.0,0.5]"], "is not a list of distill.steps=4"),
    "ddpm": (["diffusion=ddpm"], "distils flow-matching models, but diffusion.objective is DDPM"),
    "gan_loss not a bool": (["distill.gan_loss=3"], "distill.gan_loss must be true or false, got 3"),
    "gan generator weight": (["distill.gan_loss=true", "distill.gan_generator_weight=-1"],
                             "distill.gan_generator_weight=-1 must be a finite number >= 0 (DMD2: 3e-3); or "
                             "distill.gan_loss=false"),
    "gan critic weight": (["distill.gan_loss=true", "distill.gan_critic_weight=0"],
                          "distill.gan_critic_weight=0 must be a finite number > 0"),
    "gan block type": (["distill.gan_loss=true", "distill.gan_block=middle"],
                       "distill.gan_block must be a block index"),
    "gan block range": (["distill.gan_loss=true", "distill.gan_block=2"],
                        "distill.gan_block=2 is not a block of this model (2 repeated blocks); give an index in "
                        "[-2, 1]"),
    "regression weight": (["distill.regression_loss=true", "distill.regression_weight=0"],
                          "distill.regression_weight=0 must be a finite number > 0 (DMD: 0.25)"),
    "regression pairs": (["distill.regression_loss=true", "distill.regression_pairs=0"],
                         "distill.regression_pairs must be a positive integer, got 0"),
    "regression batch": (["distill.regression_loss=true", "distill.regression_batch=0"],
                         "distill.regression_batch must be a positive integer, got 0"),
    "regression batch above the pairs": (["distill.regression_loss=true", "distill.regression_pairs=4",
                                          "distill.regression_batch=8"],
                                         "distill.regression_batch=8 is more than the 4 pairs (distill.regression_pairs);"
                                         " set distill.regression_batch at most 4"),
    "regression distance": (["distill.regression_loss=true", "distill.regression_distance=lpips"],
                            "distill.regression_distance='lpips' must be mse or pseudo_huber"),
    "critic_steps": (["distill.critic_steps=0"], "distill.critic_steps must be a positive integer"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_distillation_settings_are_refused_before_spawning(case, teacher, tmp_path):
    overrides, message = BAD[case]
    teacher_setting = [] if case == "no teacher" else [f"init_from={teacher}"]
    proc, seconds = fail_fast("train.py", *TINY, "distill=dmd2", *teacher_setting, *overrides,
                              f"hydra.run.dir={tmp_path}")
    assert_refused(proc, text=message, seconds=seconds, run_dir=tmp_path)


def test_a_teacher_of_another_architecture_is_refused(teacher, tmp_path):
    proc, seconds = fail_fast("train.py", *TINY, "model.hidden_size=64", "distill=dmd2", f"init_from={teacher}",
                              f"hydra.run.dir={tmp_path}")
    assert_refused(proc, text="does not fit this model", seconds=seconds, run_dir=tmp_path)


# tiny Flux as tests/test_diffusers_training.py trains it (joint attention: text and image tokens in one sequence)
FLUX = ["experiment=flux_tiny", "data.num_samples=32", "data.batch_size=4", "logger=csv", "scheduler=constant",
        *SGD, "trainer.val_check_interval=3"]
# float64 (one iteration): Flux computes in float64 throughout, and ring 2 agrees with one process to 1.8e-16 in the
# losses and 1.1e-16 in the weights (max ~1), so rel / atol 1e-12 is >= 5000x that, far below what the update moves
# the student (>= 5e-3). (Tiny Wan at ring 2: tests/test_distill_combos.py, on bucketed data.)
FLUX_TOLERANCE = 1e-12


@pytest.fixture(scope="module")
def flux_distill(tmp_path_factory) -> SimpleNamespace:
    """A tiny Flux ``teacher`` (1 step) and the ``settings`` of one distillation iteration from it: one critic update
    and a student update, the GAN head and the regression loss on pairs for the training data's prompts (the teacher
    sampling 2 guided Euler steps)."""
    root = tmp_path_factory.mktemp("flux_distill")
    common = [*FLUX, f"data.cache_dir={root / 'data'}"]
    run("train.py", root / "teacher", *common, "trainer.max_steps=1", env={"HF_HUB_OFFLINE": "1"})
    teacher = root / "teacher" / "checkpoints" / "last.ckpt"
    return SimpleNamespace(teacher=teacher, settings=[*common, "trainer.max_steps=1", "distill=dmd2",
                                                      "distill.critic_steps=1", *GAN, *REGRESSION,
                                                      "diffusion.sampling.steps=2", f"init_from={teacher}"])


def test_a_flux_distillation_equals_one_process_at_ring_2(flux_distill, tmp_path):
    """Tiny Flux (diffusers' transformer, text-conditioned; its joint attention shards text and image tokens in one
    sequence), the teacher guided at the preset's CFG away from the empty prompt, the GAN head reading a block from
    diffusers' block registry, the regression loss on pairs the teacher sampled for the training data's prompts: one
    iteration, ring 2 against one process, in float64. A GAN head that pools only its own rank's tokens fails it
    (2.5e-4 in the losses, measured in float32)."""
    distill = [*flux_distill.settings, *FP64]
    for name, layout in {"one": [], "ring2": ["ring_degree=2"]}.items():
        run("train.py", tmp_path / name, *distill, *layout, env={"HF_HUB_OFFLINE": "1"})
    logged = ("train/gan_loss", "train/critic_gan_loss", "train/regression_loss")
    reference, parallel = distill_losses(tmp_path / "one", *logged), distill_losses(tmp_path / "ring2", *logged)
    assert sorted(reference) == sorted(parallel) == [0]
    assert parallel[0] == pytest.approx(reference[0], rel=FLUX_TOLERANCE)
    assert reference[0][4] > 1e-3  # the student's 1-step outputs are not the teacher's samples yet
    student = state(tmp_path / "one")
    assert {key.split(".")[0] for key in student} == {"model", "ema", "critic", "gan_head"}
    assert all(v.dtype == torch.float64 for v in student.values() if v.is_floating_point())
    start = read_weights(flux_distill.teacher, prefer="ema")[0]
    moved = max((student[f"model.{key}"] - value).abs().max().item() for key, value in start.items()
                if value.is_floating_point())
    assert moved > 1e-3  # the student's update moved it (by far more than the tolerance)
    assert_same_numbers(state(tmp_path / "ring2"), student, rtol=FLUX_TOLERANCE, atol=FLUX_TOLERANCE, where="flux")


def test_a_flux_distillation_under_fsdp_and_ulysses_equals_one_process(flux_distill, tmp_path):
    """FSDP (student, critic and GAN head sharded and trained, the teacher sharded and frozen) at ring 2 x Ulysses 2
    against one process, in float32 (Lightning's FSDP has no float64): the losses and the student's weights and EMA.
    float32 (u = 6e-8): the tolerances of the DiT's FSDP comparison above (``TOLERANCE["one_fp32"]``: its student
    loss, a difference of close predictions over their mean, is ~100 u relative); measured here 4.8e-7 relative in
    the losses (the regression loss's) and 3e-8 in the weights (max ~1): >= 200x inside them."""
    for name, layout in {"one": [], "fsdp": ["trainer/strategy=fsdp", "ring_degree=2", "ulysses_degree=2"]}.items():
        run("train.py", tmp_path / name, *flux_distill.settings, *layout, env={"HF_HUB_OFFLINE": "1"})
    logged = ("train/gan_loss", "train/critic_gan_loss", "train/regression_loss")
    reference, sharded = distill_losses(tmp_path / "one", *logged), distill_losses(tmp_path / "fsdp", *logged)
    assert sorted(reference) == sorted(sharded) == [0]
    loss_tolerance, rtol, atol = TOLERANCE["one_fp32"]
    assert sharded[0] == pytest.approx(reference[0], rel=loss_tolerance)
    for prefer in ("model", "ema"):
        expected = read_weights(tmp_path / "one" / "checkpoints" / "last.ckpt", prefer=prefer)[0]
        got = read_weights(tmp_path / "fsdp" / "checkpoints" / "last.ckpt", prefer=prefer)[0]
        assert_same_numbers(got, expected, rtol=rtol, atol=atol, where=f"flux fsdp {prefer}")


@pytest.mark.parametrize("expert", [None, "high"])
def test_a_two_expert_teacher_is_refused_with_the_reason(tmp_path, expert):
    """Wan 2.2 A14B's two experts (tiny): not one student per expert, and the message says why and what instead."""
    chosen = [] if expert is None else [f"diffusion.expert={expert}"]
    proc, seconds = fail_fast("train.py", "experiment=wan_tiny", "model=wan22_a14b_tiny", f"data.cache_dir={tmp_path}",
                              "data.num_samples=16", "distill=dmd2", *chosen, f"hydra.run.dir={tmp_path / 'run'}")
    line = assert_refused(proc, seconds=seconds, run_dir=tmp_path / "run")
    assert f"model.boundary_ratio=0.875, diffusion.expert={expert or 'both'}) is refused" in line
    for reason in ("noise levels on both sides of the boundary", "the low expert's steps start from the high expert's "
                   "student", "distil a one-transformer model instead (Wan 2.2 TI2V-5B: model=wan22_ti2v"):
        assert reason in line


@pytest.mark.parametrize("layout", ["gan_ring2", pytest.param("gan_ring3", marks=pytest.mark.slow),
                                    pytest.param("gan_fsdp_ring2_ulysses2", marks=pytest.mark.slow)])
def test_dmd2_with_the_gan_head_equals_one_process(runs, layout):
    """The head reads token shards and pools them over the group (ring 3: a shard with padded tokens): losses (the
    student's, the critic's with its GAN term, both GAN losses) and every weight (student, EMA, critic, head) equal one
    process's, in float64 (FSDP, sharding the head too: float32, its losses and student weights)."""
    gan = ("train/gan_loss", "train/critic_gan_loss")
    name = REFERENCE[layout]
    loss_tolerance, rtol, atol = TOLERANCE[name]
    reference, parallel = distill_losses(runs.trained(name), *gan), distill_losses(runs.trained(layout), *gan)
    assert sorted(reference) == sorted(parallel) == [0, 1, 2]
    for step, values in reference.items():
        assert parallel[step] == pytest.approx(values, rel=loss_tolerance), f"step {step}"
    # the head changes the run: its losses are logged and the student differs from the run without it
    assert reference[0][0] != pytest.approx(distill_losses(runs.trained("one"))[0][0], rel=1e-6)
    if not (runs.trained(layout) / "checkpoints" / "last.ckpt").is_file():  # FSDP: a sharded folder
        for prefer in ("model", "ema"):
            expected = read_weights(runs.trained(name) / "checkpoints" / "last.ckpt", prefer=prefer)[0]
            got = read_weights(runs.trained(layout) / "checkpoints" / "last.ckpt", prefer=prefer)[0]
            assert_same_numbers(got, expected, rtol=rtol, atol=atol, where=f"{layout} {prefer}")
        return
    expected, got = state(runs.trained(name)), state(runs.trained(layout))
    assert {key.split(".")[0] for key in expected} == {"model", "ema", "critic", "gan_head"}
    assert_same_numbers(got, expected, rtol=rtol, atol=atol, where=f"{layout} with the GAN head")


def test_a_resumed_distillation_with_the_gan_head_continues_exactly(runs, teacher, tmp_path):
    """The head's weights and its optimizer state (the critic's optimizer) come back from the checkpoint."""
    first = runs.trained("gan_one")
    checkpoint = torch.load(first / "checkpoints" / "last.ckpt", weights_only=False)
    assert len(checkpoint["optimizer_states"]) == 2
    resumed = tmp_path / "resumed"
    run("train.py", resumed, *TINY, *MOMENTUM, *FP64, *GAN, "distill=dmd2", f"init_from={teacher}",
        "distill.critic_steps=2", f"ckpt_path={first / 'checkpoints' / 'step_0000002.ckpt'}")
    gan = ("train/gan_loss", "train/critic_gan_loss")
    assert distill_losses(resumed, *gan)[2] == distill_losses(first, *gan)[2]
    assert_same_numbers(state(resumed), state(first), where="resumed with the GAN head")


def test_dmd2_with_the_regression_loss_equals_one_process(runs):
    """The teacher's pairs (sampled once, on every rank of the group) and the student's 1-step outputs from their
    noises: ring 2 equals one process in float64 (pseudo-Huber); mse and pseudo-Huber train differently."""
    regression = ("train/regression_loss",)
    loss_tolerance, rtol, atol = TOLERANCE["regression_one_huber"]
    reference = distill_losses(runs.trained("regression_one_huber"), *regression)
    parallel = distill_losses(runs.trained("regression_ring2"), *regression)
    assert sorted(reference) == sorted(parallel) == [0, 1, 2]
    for step, values in reference.items():
        assert parallel[step] == pytest.approx(values, rel=loss_tolerance), f"step {step}"
    mse = distill_losses(runs.trained("regression_one"), *regression)
    assert mse[0][2] > 0 and mse[0][2] != pytest.approx(reference[0][2], rel=1e-3)
    assert reference[0][0] != pytest.approx(distill_losses(runs.trained("one"))[0][0], rel=1e-6)  # it moves the student
    assert_same_numbers(state(runs.trained("regression_ring2")), state(runs.trained("regression_one_huber")),
                        rtol=rtol, atol=atol, where="ring 2 with the regression loss")


def test_a_resumed_distillation_with_the_regression_loss_continues_exactly(runs, teacher, tmp_path):
    """The teacher's pairs are not saved: a resumed run samples the same ones again."""
    first = runs.trained("regression_one_huber")
    resumed = tmp_path / "resumed"
    run("train.py", resumed, *TINY, *MOMENTUM, *FP64, *REGRESSION, "distill.regression_distance=pseudo_huber",
        "distill.regression_batch=3", "distill=dmd2", f"init_from={teacher}", "distill.critic_steps=2",
        f"ckpt_path={first / 'checkpoints' / 'step_0000002.ckpt'}")
    assert distill_losses(resumed, "train/regression_loss")[2] == distill_losses(first, "train/regression_loss")[2]
    assert_same_numbers(state(resumed), state(first), where="resumed with the regression loss")


class PairsOnlyModel(torch.nn.Module):
    """A student whose velocity is zero: its 1-step output is its input, so the regression's distance is the
    pairs' own (what the test computes by hand); it records which conditions it was called with."""

    def forward(self, x, model_time, condition):
        self.seen = condition
        return torch.zeros_like(x)

    def with_condition_frames(self, output, condition):
        return output


def regression_student(batch: int | None, pairs: int = 6) -> SimpleNamespace:
    from ringdit.diffusion.objectives import FlowMatching

    g = torch.Generator().manual_seed(0)
    noise, samples = torch.randn(pairs, 1, 2, 2, generator=g), torch.randn(pairs, 1, 2, 2, generator=g)
    return SimpleNamespace(teacher_pairs=(noise, torch.arange(pairs), samples), model=PairsOnlyModel(),
                           objective=FlowMatching(), device=torch.device("cpu"), hparams=SimpleNamespace(seed=7),
                           distill={"times": [1.0], "regression_distance": "mse", "regression_batch": batch})


def test_the_regression_takes_a_fresh_draw_of_its_pairs_each_update():
    """``distill.regression_batch``: each update's loss is the distance over that many of the pairs, a draw that
    changes with the update (and is the same for the same update: every rank, a resumed run); null: all pairs."""
    from ringdit.training.distillation_module import DistillationModule

    student = regression_student(batch=None)
    noise, labels, samples = student.teacher_pairs
    every = DistillationModule.regression_loss(student, 0)
    assert every == pytest.approx((noise - samples).square().mean().item(), rel=1e-6)
    student = regression_student(batch=2)
    draws = []
    for step in range(4):
        loss = DistillationModule.regression_loss(student, step)
        picked = student.model.seen  # the labels are the pairs' indices
        assert picked.shape == (2,) and len(set(picked.tolist())) == 2
        assert loss == pytest.approx((noise[picked] - samples[picked]).square().mean().item(), rel=1e-6)
        assert torch.equal(DistillationModule.regression_loss(student, step), loss)  # the same update, the same draw
        draws.append(tuple(sorted(picked.tolist())))
    assert len(set(draws)) > 1
