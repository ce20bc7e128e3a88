"""distill=scm / rcm: sCM's consistency loss in TrigFlow on a flow model (ringdit.training.consistency) -- the change
of variables, the tangent and the consistency direction checked in float64 against Gaussian data's exact
probability-flow ODE; the sCM and rCM updates equal one process's at ring 2 and ring 2 x Ulysses 2; bad settings are
refused in one line before any rank starts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ringdit.checkpoints.weights import read_weights
from ringdit.diffusion.samplers import consistency_times, fewstep_start, student_times
from ringdit.spec.distill import student_times as spec_student_times
from ringdit.training import consistency
from tests.helpers import SGD, TINY, LazyRuns, assert_refused, assert_same_numbers, fail_fast, run

pytestmark = pytest.mark.timeout(600)

# Gaussian data x0 ~ N(MU, SIGMA0^2 I): the flow's optimal velocity and its ODE's flow map are closed forms
MU, SIGMA0 = 0.3, 0.7


def posterior_velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The flow-matching optimum E[e - x0 | x_t] for the Gaussian data (the "teacher")."""
    t = consistency.column(t, x)
    var = (1 - t) ** 2 * SIGMA0 ** 2 + t ** 2
    x0_mean = MU + (1 - t) * SIGMA0 ** 2 / var * (x - (1 - t) * MU)
    return (x - x0_mean) / t


def flow_map_velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A velocity whose clean prediction x_t - t v is the ODE's endpoint from (x_t, t) -- a perfect consistency
    model: the ODE keeps each sample's standardised coordinate, so x0 = MU + SIGMA0 (x_t - (1-t) MU) / std_t."""
    t = consistency.column(t, x)
    endpoint = MU + SIGMA0 * (x - (1 - t) * MU) / ((1 - t) ** 2 * SIGMA0 ** 2 + t ** 2).sqrt()
    return (x - endpoint) / t


@pytest.mark.parametrize("sigma_d", [1.0, 0.5])
def test_the_trigflow_conversion_and_the_consistency_direction_are_exact_on_gaussian_data(sigma_d):
    """Float64, closed forms: (1) the student's consistency function cos(s) x_s - sin(s) sigma_d F is the flow's
    clean prediction x_t - t v; (2) the teacher's F is the TrigFlow ODE's direction (a finite difference of its
    solution); (3) the forward-mode tangent of F equals a central difference; (4) for the exact flow map as student
    and the exact velocity as teacher, sCM's direction g (r = 1) vanishes -- df/ds = 0 along the ODE -- to rounding,
    while a student off the flow map gets a direction of order one."""
    torch.manual_seed(0)
    x_s = torch.randn(5, 1, 4, 4, dtype=torch.float64)
    s = torch.linspace(0.2, 1.4, 5, dtype=torch.float64)
    cos, sin = consistency.column(torch.cos(s), x_s), consistency.column(torch.sin(s), x_s)
    # (1) f = x_t - t v, x_t = x_s / (cos + sigma_d sin)
    F = consistency.trigflow_F(flow_map_velocity, x_s, s, sigma_d)
    x_t, t = x_s / (cos + sigma_d * sin), consistency.flow_time(s, sigma_d)
    assert torch.allclose(cos * x_s - sin * sigma_d * F, x_t - consistency.column(t, x_t) * flow_map_velocity(x_t, t),
                          rtol=0, atol=1e-14)
    # (2) sigma_d F_teacher = dx_s/ds along the teacher's ODE: x_s(s) = D(s) x_t(t(s)) with x_t on the flow ODE;
    # its ODE's solutions are the exact flow map's level sets, so d/ds of D(s) * x_t(t(s)) is checked by a difference
    F_teacher = consistency.trigflow_F(posterior_velocity, x_s, s, sigma_d)
    h = 1e-6

    def along_ode(ds):  # x at s + ds on the same ODE solution: keep the standardised coordinate (Gaussian data)
        t0, t1 = consistency.flow_time(s, sigma_d), consistency.flow_time(s + ds, sigma_d)
        std = lambda tt: ((1 - tt) ** 2 * SIGMA0 ** 2 + tt ** 2).sqrt()  # noqa: E731
        t0c, t1c = consistency.column(t0, x_s), consistency.column(t1, x_s)
        z = (x_t - (1 - t0c) * MU) / std(t0c)
        x_t1 = (1 - t1c) * MU + std(t1c) * z
        return x_t1 * consistency.column(torch.cos(s + ds) + sigma_d * torch.sin(s + ds), x_s)

    x_t = x_s / (cos + sigma_d * sin)
    assert torch.allclose(sigma_d * F_teacher, (along_ode(h) - along_ode(-h)) / (2 * h), rtol=0, atol=1e-8)
    # (3) the tangent: sin cos dF/ds along dx_ds, against a central difference of F
    dx_ds = sigma_d * F_teacher
    F_minus, dF = consistency.trigflow_F_and_tangent(flow_map_velocity, x_s, s, dx_ds, sigma_d)
    assert torch.equal(F_minus, F)
    ahead = consistency.trigflow_F(flow_map_velocity, x_s + h * dx_ds, s + h, sigma_d)
    behind = consistency.trigflow_F(flow_map_velocity, x_s - h * dx_ds, s - h, sigma_d)
    assert torch.allclose(dF, sin * cos * (ahead - behind) / (2 * h), rtol=0, atol=1e-8)
    # (4) g = 0 for the exact consistency model at r = 1 (before normalisation: compare with its size at r = 0)
    g = consistency.consistency_direction(F_minus, dF, F_teacher, x_s, s, 1.0, sigma_d, c=1e-30)
    raw = consistency.consistency_direction(F_minus, dF, F_teacher, x_s, s, 1.0, sigma_d, c=1e30) * 1e30
    assert raw.abs().max() < 1e-12, raw.abs().max()
    off = consistency.consistency_direction(*consistency.trigflow_F_and_tangent(posterior_velocity, x_s, s, dx_ds,
                                                                                sigma_d),
                                            F_teacher, x_s, s, 1.0, sigma_d, c=0.1)
    assert (off.flatten(1).norm(dim=1) > 0.1).all()  # the teacher itself is no consistency model
    assert (g.flatten(1).norm(dim=1) <= 1 + 1e-12).all()  # normalised: ||g|| / (||g|| + c) < 1


def test_training_times_are_the_flow_logit_normal():
    """tan(s) = exp(tau) / sigma_d makes the flow time sigmoid(tau), whatever sigma_d; the warm-up's r."""
    for sigma_d in (1.0, 0.5):
        s = consistency.training_times([torch.Generator().manual_seed(i) for i in range(4)], -0.8, 1.6, sigma_d)
        tau = torch.cat([-0.8 + 1.6 * torch.randn(1, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
                         for i in range(4)])
        assert torch.allclose(consistency.flow_time(s, sigma_d), torch.sigmoid(tau), rtol=0, atol=1e-15)
    assert [consistency.tangent_weight(step, 4) for step in (0, 2, 4, 9)] == [0.0, 0.5, 1.0, 1.0]
    assert consistency.tangent_weight(0, 0) == 1.0


def test_the_warmup_blends_the_teacher_term_as_rcm_does():
    """rCM's g during the warm-up, written out in float64: -cos(s) sqrt(1 - r^2 sin^2(s)) (F^- - F_teacher) - r (sin
    cos x_s + sin cos dF/ds) (sigma_d = 1), normalised; at r = 0 only the teacher term, at r = 1 sCM's cos^2(s)."""
    torch.manual_seed(1)
    x_s, F_minus, F_teacher, dF = torch.randn(4, 4, 1, 3, 3, dtype=torch.float64).unbind(0)
    s = torch.tensor([0.1, 0.7, 1.2, 1.55], dtype=torch.float64)
    for r in (0.0, 0.3, 1.0):
        g = consistency.consistency_direction(F_minus, dF, F_teacher, x_s, s, r, 1.0, c=0.1)
        rows = []
        for i, si in enumerate(s.tolist()):
            c, n = math.cos(si), math.sin(si)
            raw = -c * math.sqrt(1 - r * r * n * n) * (F_minus[i] - F_teacher[i]) - r * (n * c * x_s[i] + dF[i])
            rows.append(raw / (raw.norm() + 0.1))
        assert torch.allclose(g, torch.stack(rows), rtol=0, atol=1e-15), r
        if r == 1.0:  # the paper's cos^2(s)
            cos = consistency.column(torch.cos(s), x_s)
            paper = -cos * cos * (F_minus - F_teacher) - (consistency.column(torch.sin(s), x_s) * cos * x_s + dF)
            assert torch.allclose(g, paper / consistency.column(paper.flatten(1).norm(dim=1) + 0.1, paper),
                                  rtol=0, atol=1e-15)


def test_a_consistency_student_samples_on_rcms_grid():
    """distill.times=null under scm / rcm is rCM's TrigFlow grid (s = arctan(80), 1.3, 1.0, 0.6) as flow times; a
    recorded consistency grid sampled with another step count keeps to it; the first input is TrigFlow's x_s = noise
    on the flow's path (the noise itself at t = 1, DMD2's start)."""
    for steps in (1, 2, 3, 4):
        s = [math.atan(80.0), 1.3, 1.0, 0.6][:steps]
        expected = [math.tan(si) / (1 + math.tan(si)) for si in s]  # t = sigma_d tan(s) / (1 + sigma_d tan(s))
        assert consistency_times(steps) == pytest.approx(expected, rel=0, abs=1e-15)
        assert spec_student_times(steps, None, "rcm") == consistency_times(steps)
        assert student_times(steps, consistency_times(2)) == consistency_times(steps)
    assert spec_student_times(2, None, "dmd2") == [1.0, 0.5] and student_times(2, [1.0, 0.75, 0.5, 0.25]) == [1.0, 0.5]
    noise = torch.randn(3, 1, 2, 2, dtype=torch.float64)
    assert torch.equal(fewstep_start(noise, 1.0), noise)
    t0 = consistency_times(1)[0]
    x_s_scale = torch.tensor(math.atan(80.0), dtype=torch.float64)
    D = torch.cos(x_s_scale) + torch.sin(x_s_scale)  # x_t = x_s / D with x_s = noise
    assert torch.allclose(fewstep_start(noise, t0), noise / D, rtol=1e-15, atol=0)


FP64 = ["trainer.precision=64-true"]
MOMENTUM = [*SGD, "optimizer.momentum=0.9"]  # SGD shows a wrongly scaled gradient; momentum makes resume need state
# sCM: the teacher guided at CFG 2 (so the first update, at r = 0, already moves the student, which starts as the
# unguided teacher), the tangent's weight r = 0, 0.5, 1 over the 3 updates; rCM: r = 0 at the first update (sCM
# alone), then the critic's 2 updates and the DMD term at weight 0.5 (so that a wrong DMD gradient shows)
SCM = ["distill=scm", "distill.cfg_scale=2.0", "distill.warmup_steps=2"]
RCM = ["distill=rcm", "distill.warmup_steps=1", "distill.critic_steps=2", "distill.dmd_weight=0.5",
       "distill.first_step_share=0.75"]  # the digits preset's share of first-step updates
LAYOUTS = {
    "scm_one": [*FP64, *SCM],
    "scm_ring2": [*FP64, *SCM, "ring_degree=2"],
    "scm_ring2_ulysses2": [*FP64, *SCM, "ring_degree=2", "ulysses_degree=2"],
    "rcm_one": [*FP64, *RCM],
    "rcm_ring2": [*FP64, *RCM, "ring_degree=2"],
    "rcm_ring2_ulysses2": [*FP64, *RCM, "ring_degree=2", "ulysses_degree=2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_checkpoint):
    """3 student updates per layout, SGD with momentum, from conftest's tiny teacher (each run when first read)."""
    return LazyRuns(tmp_path_factory.mktemp("consistency"), LAYOUTS, *TINY, *MOMENTUM, f"init_from={tiny_checkpoint}")


def state(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


@pytest.mark.parametrize("layout", ["scm_ring2", "scm_ring2_ulysses2", "rcm_ring2",
                                    pytest.param("rcm_ring2_ulysses2", marks=pytest.mark.slow)])
def test_consistency_updates_equal_one_process(runs, layout):
    """float64: a layout only reorders sums (each rounded at 1.1e-16) -- in the model, its JVP's tangent (attention's
    blockwise forward-mode rule, merged over ring hops) and the critic's -- so the losses agree to ~1e-15 relative and
    the weights (max ~3) to ~1e-15; rel 1e-10 is 1e5 x that, far below what a wrong tangent or gradient moves."""
    reference = layout.split("_")[0] + "_one"
    names = ("train/scm_loss",) + (("train/dmd_loss",) if layout.startswith("rcm") else ())
    ref, got = (distill_losses_of(runs.trained(name), names) for name in (reference, layout))
    assert sorted(ref) == sorted(got) == [0, 1, 2]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-10, nan_ok=True), f"step {step}"
    assert ref[2][0] != pytest.approx(ref[0][0], rel=1e-3)  # the updates did change the student
    assert all(value > 0 for value in ref[2][:2])  # the consistency loss is not trivially 0
    for prefer in ("model", "ema"):
        expected = read_weights(runs.trained(reference) / "checkpoints" / "last.ckpt", prefer=prefer)[0]
        assert_same_numbers(read_weights(runs.trained(layout) / "checkpoints" / "last.ckpt", prefer=prefer)[0],
                            expected, rtol=1e-10, atol=1e-13, where=f"{layout} {prefer}")
    critic = {k: v for k, v in state(runs.trained(reference)).items() if k.startswith("critic.")}
    assert bool(critic) == layout.startswith("rcm")  # sCM trains no critic
    if critic:
        got_critic = {k: v for k, v in state(runs.trained(layout)).items() if k.startswith("critic.")}
        assert_same_numbers(got_critic, critic, rtol=1e-10, atol=1e-13, where=f"{layout} critic")


def distill_losses_of(run_dir: Path, names: tuple[str, ...]) -> dict[int, tuple[float, ...]]:
    """(the student's loss, the sCM loss[, the DMD term]) per student step; the DMD term is nan before the warm-up
    ends (not logged)."""
    import csv

    with open(run_dir / "csv" / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("train/loss")]
    return {int(row["step"]): tuple(float(row.get(name) or "nan") for name in ("train/loss", *names)) for row in rows}


def test_the_checkpoints_hold_the_models_each_method_trains(runs, tiny_checkpoint):
    """sCM: the student and its EMA, one optimizer; rCM: and the critic, two optimizers; both sample with the
    few-step sampler, unguided; the student moved from the teacher."""
    for method, models, optimizers in (("scm", {"model", "ema"}, 1), ("rcm", {"model", "ema", "critic"}, 2)):
        checkpoint = torch.load(runs.trained(f"{method}_one") / "checkpoints" / "last.ckpt", weights_only=False)
        assert {key.split(".")[0] for key in checkpoint["state_dict"]} == models
        assert len(checkpoint["optimizer_states"]) == optimizers and checkpoint["global_step"] == 3
        sampling = checkpoint["hyper_parameters"]["sampling"]
        assert sampling["sampler"] == "fewstep" and sampling["cfg_scale"] == 1.0
        assert sampling["times"] == consistency_times(2)  # rCM's grid
        start = read_weights(tiny_checkpoint, prefer="ema")[0]
        moved = max((checkpoint["state_dict"][f"model.{k}"].double() - v.double()).abs().max().item()
                    for k, v in start.items())
        assert moved > 1e-4, method


def test_a_resumed_rcm_distillation_continues_exactly(runs, tiny_checkpoint, tmp_path):
    """Student, EMA, critic and both optimizers come back from step 2's checkpoint (the tangent's warm-up and the DMD
    term's start follow the step); the third update equals the uninterrupted run's, bit for bit."""
    first = runs.trained("rcm_one")
    resumed = tmp_path / "resumed"
    run("train.py", resumed, *TINY, *MOMENTUM, *LAYOUTS["rcm_one"], f"init_from={tiny_checkpoint}",
        f"ckpt_path={first / 'checkpoints' / 'step_0000002.ckpt'}")
    names = ("train/scm_loss", "train/dmd_loss", "train/critic_loss")
    assert distill_losses_of(resumed, names)[2] == distill_losses_of(first, names)[2]
    assert_same_numbers(state(resumed), state(first), where="resumed")


BAD = {
    "not flow-matching": (["distill=scm", "diffusion=ddpm"],
                          "distill=scm distils flow-matching models (converted to TrigFlow through the flow's "
                          "straight path), but diffusion.objective is DDPM; distil a teacher trained with "
                          "diffusion=flow"),
    "no forward mode": (["distill=rcm", "attention_backend=torch_sdpa"],
                        "attention_backend='torch_sdpa' has no forward-mode (JVP) rule (no jvp_ring_kv_chunk), so "
                        "torch.func.jvp cannot run through it; use attention_backend= one of (torch_flash, math)"),
    "no forward mode under ring": (["distill=scm", "attention_backend=torch_sdpa", "ring_degree=2"],
                                   "attention_backend='torch_sdpa' has no forward-mode (JVP) rule"),
    "fp16": (["distill=scm", "trainer.precision=16-mixed"],
             "trainer.precision=16-mixed with distill=scm: the JVP's tangent dF/dt leaves fp16's range"),
    "zero steps": (["distill=rcm", "distill.steps=0"], "distill.steps must be a positive integer, got 0"),
    "warmup": (["distill=scm", "distill.warmup_steps=-1"],
               "distill.warmup_steps=-1 must be an integer >= 0 (student updates over which the tangent's weight r "
               "rises from 0 to 1; 0: r = 1 from the start; rCM: 1000), with distill=scm"),
    "tangent c": (["distill=scm", "distill.tangent_c=0"],
                  "distill.tangent_c=0 must be a finite number > 0 (the tangent normalisation g / (||g|| + c); "
                  "sCM: 0.1), with distill=scm"),
    "sigma_data": (["distill=rcm", "distill.sigma_data=-1"], "distill.sigma_data=-1 must be a finite number > 0"),
    "p_std": (["distill=scm", "distill.p_std=0"], "distill.p_std=0 must be a finite number > 0"),
    "p_mean": (["distill=scm", "distill.p_mean=nan"], "distill.p_mean=nan must be a finite number"),
    "dmd weight": (["distill=rcm", "distill.dmd_weight=0"],
                   "distill.dmd_weight=0 must be a finite number > 0 (the DMD term's weight; rCM: 0.01); for no DMD "
                   "term use distill=scm"),
    "first step share": (["distill=rcm", "distill.first_step_share=1.5"],
                         "distill.first_step_share=1.5 must be a number in [0, 1] (the share of updates whose backward "
                         "simulation trains the student's first step, e.g. 0.75"),
    "gan head without a critic": (["distill=scm", "+distill.gan_loss=true"],
                                  "distill.gan_loss=true with distill=scm: the GAN head reads the critic"),
}
# the advice each refusal gives, followed: the run then trains (fp16's: 32-true; the backend's: one it names)
ADVICE = {"no forward mode": ["distill=rcm", "attention_backend=math"], "fp16": ["distill=scm",
                                                                                 "trainer.precision=32-true"],
          "dmd weight": ["distill=scm"], "first step share": ["distill=rcm", "distill.first_step_share=0.75"], "gan head without a critic": ["distill=rcm", "distill.gan_loss=true"]}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_consistency_settings_are_refused_before_spawning(case, tiny_checkpoint, tmp_path):
    overrides, message = BAD[case]
    proc, seconds = fail_fast("train.py", *TINY, f"init_from={tiny_checkpoint}", *overrides,
                              f"hydra.run.dir={tmp_path}")
    assert_refused(proc, text=message, seconds=seconds, run_dir=tmp_path)


@pytest.mark.parametrize("case", list(ADVICE))
def test_the_refusals_advice_trains(case, tiny_checkpoint, tmp_path):
    run("train.py", tmp_path, *TINY, "trainer.max_steps=1", f"init_from={tiny_checkpoint}", *ADVICE[case],
        "distill.warmup_steps=0", "distill.critic_steps=1" if "distill=rcm" in ADVICE[case] else "distill.steps=1")
    assert distill_losses_of(tmp_path, ("train/scm_loss",))[0][1] > 0


def test_the_memory_estimate_counts_the_models_each_method_holds():
    """sCM: the student trains, the teacher is frozen (no critic); rCM: the student and the critic train, as DMD2's."""
    from ringdit.costs import Setup

    counts = {method: (Setup(distill=method).trained_models, Setup(distill=method).frozen_models)
              for method in ("none", "dmd2", "scm", "rcm")}
    assert counts == {"none": (1, 0), "dmd2": (2, 1), "scm": (1, 1), "rcm": (2, 1)}


def test_a_checkpoint_of_one_method_resumed_with_another_is_refused(runs, tiny_checkpoint, tmp_path):
    """sCM's checkpoint holds no critic and one optimizer: resumed as rCM (or back) is refused in one line, and its
    advice (the method it was trained with) resumes."""
    checkpoint = runs.trained("scm_one") / "checkpoints" / "step_0000002.ckpt"
    proc, seconds = fail_fast("train.py", *TINY, f"init_from={tiny_checkpoint}", "distill=rcm",
                              f"ckpt_path={checkpoint}", f"hydra.run.dir={tmp_path / 'refused'}")
    assert_refused(proc, text=f"ckpt_path={checkpoint} is a distill=scm checkpoint, but this run has distill=rcm "
                   f"(other models and optimizers); resume it with distill=scm", seconds=seconds,
                   run_dir=tmp_path / "refused")
    run("train.py", tmp_path / "resumed", *TINY, *MOMENTUM, *LAYOUTS["scm_one"], f"init_from={tiny_checkpoint}",
        f"ckpt_path={checkpoint}")
    names = ("train/scm_loss",)
    assert distill_losses_of(tmp_path / "resumed", names)[2] == distill_losses_of(runs.trained("scm_one"), names)[2]


@pytest.mark.parametrize("method", ["dmd2", "rcm"])
def test_a_distilled_student_fine_tuned_starts_from_itself_under_its_new_teacher(runs, tiny_checkpoint, tmp_path,
                                                                                 method):
    """Fine-tuning a distilled student on new data (init_from=<the student>, distill.teacher=<a teacher fine-tuned on
    it>): the student (and its EMA) start from the student's weights, the critic and the frozen teacher from the
    teacher's, bit for bit."""
    from tests.helpers import prepare_train

    student = runs.trained("scm_one") / "checkpoints" / "last.ckpt"
    module = prepare_train([*TINY, f"distill={method}", f"init_from={student}",
                            f"distill.teacher={tiny_checkpoint}", "data.classes=[0,1]", "logger=none"], tmp_path)[1]
    module.configure_model()
    expected = {"student": read_weights(student, prefer="ema")[0], "teacher": read_weights(tiny_checkpoint,
                                                                                         prefer="ema")[0]}
    assert any(not torch.equal(expected["student"][k], v) for k, v in expected["teacher"].items())
    for name, model, source in (("student", module.model, "student"), ("ema", module.ema.module, "student"),
                                ("critic", module.critic, "teacher"), ("teacher", module.teacher, "teacher")):
        weights = model.state_dict()
        # (the student's file is float64, the model float32 until Lightning's precision converts it, as it loads)
        assert all(torch.equal(weights[k], v.to(weights[k].dtype)) for k, v in expected[source].items()), name


@pytest.mark.parametrize("case", ["no student", "not a path", "bad classes"])
def test_bad_fine_tuning_settings_are_refused_before_spawning(case, tiny_checkpoint, tmp_path):
    """distill.teacher without init_from (the student to fine-tune), a teacher that is no file name, and data.classes
    that are not digits: one line each, before any rank starts (the advices' run: the test above)."""
    overrides, text = {
        "no student": ([f"distill.teacher={tiny_checkpoint}"],
                       f"distill.teacher={tiny_checkpoint} is the teacher, and the student starts from init_from, "
                       f"which is not given: init_from=<the student to fine-tune>"),
        "not a path": ([f"init_from={tiny_checkpoint}", "distill.teacher=3"],
                       "distill.teacher=3 must be the teacher's weights file"),
        "bad classes": ([f"init_from={tiny_checkpoint}", "data.classes=[0,10]"],
                        "data.classes=[0, 10] must be distinct digits from 0 to 9"),
    }[case]
    proc, seconds = fail_fast("train.py", *TINY, "distill=dmd2", *overrides, f"hydra.run.dir={tmp_path}")
    assert_refused(proc, text=text, seconds=seconds, run_dir=tmp_path)


def test_the_first_step_share_sets_how_often_the_first_step_trains():
    """``distill.first_step_share``: the first step drawn with that probability, the later ones alike in the rest;
    null keeps DMD2's even draw (the same draw as before the setting: its documented students are unchanged)."""
    from ringdit.common.seeding import Stream, generator
    from ringdit.training.distillation_module import trained_step

    def counts(steps, share, draws=4000):
        found = [trained_step(steps, share, generator(Stream.DISTILL, 0, step, 0, 3)) for step in range(draws)]
        return [found.count(i) / draws for i in range(steps)]

    first, second = counts(2, 0.75)
    assert abs(first - 0.75) < 0.02 and abs(second - 0.25) < 0.02
    shares = counts(4, 0.4)
    assert abs(shares[0] - 0.4) < 0.02 and all(abs(share - 0.2) < 0.02 for share in shares[1:])
    assert counts(3, 1.0) == [1.0, 0.0, 0.0] and counts(1, 0.0) == [1.0]
    assert counts(3, 0.0)[0] == 0.0
    for step in range(50):
        assert trained_step(4, None, generator(Stream.DISTILL, 0, step, 0, 3)) == int(
            torch.randint(4, (1,), generator=generator(Stream.DISTILL, 0, step, 0, 3)))
