"""distill=dmd2 with the training options a large distillation needs: LoRA students and critics (their adapters
trained, the base frozen) with activation checkpointing, under ring attention and under FSDP, equal one process; a
text model (tiny Wan) on bucketed data (two token counts) at ring 2 equals one process, and resumes exactly (its
regression pairs, the training data's prompts, sampled again); compile=true gives eager's numbers and stops
compiling after the first update."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from torch._dynamo.utils import counters

from ringdit.checkpoints.weights import read_weights
from tests.helpers import distill_losses, SGD, TINY, WAN, LazyRuns, assert_same_numbers, run

pytestmark = pytest.mark.timeout(600)

FP64 = ["trainer.precision=64-true"]
LORA = ["lora.rank=4", "lora.alpha=8", "model.activation_checkpointing=true"]
LAYOUTS = {
    "one": [*FP64, *LORA],
    "ring2": [*FP64, *LORA, "ring_degree=2"],
    "one_fp32": LORA,  # FSDP has no float64 (Lightning's ModelParallelStrategy refuses 64-true), and float32 draws
    "fsdp_ring2": [*LORA, "trainer/strategy=fsdp", "ring_degree=2"],  # other noise than float64: its own reference
}
# float64: a layout only reorders sums (u = 1.1e-16): the losses and weights agree to ~1e-15 (tests/test_distill.py
# measured 1.4e-15 relative at ring 2); rel 1e-10 is 1e5 x that. FSDP in float32 (u = 6e-8): the student's loss is
# a difference of two close predictions divided by a mean, ~100 u relative (tests/test_distill.py measured 9e-7
# under FSDP); rel 1e-4 and weights rel 1e-5 (+ atol 1e-5) are >= 10x that and far below what a wrong gradient moves
# at lr 0.5.
TOLERANCE = {"ring2": ("one", 1e-10, 1e-10, 1e-13), "fsdp_ring2": ("one_fp32", 1e-4, 1e-5, 1e-5)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """2 rCM iterations (sCM's loss through a JVP of the LoRA-adapted, checkpointed student, and DMD2's term with one
    critic update: no warm-up) of plain SGD, per layout (run when read)."""
    root = tmp_path_factory.mktemp("rcm_lora")
    run("train.py", root / "teacher", *TINY)  # 3 steps: the blocks' adaLN-Zero gates leave zero (LoRA needs them)
    teacher = root / "teacher" / "checkpoints" / "last.ckpt"
    common = [*TINY, *SGD, "trainer.max_steps=2", "distill=rcm", f"init_from={teacher}", "distill.critic_steps=1",
              "distill.warmup_steps=0", "distill.dmd_weight=0.5"]
    return LazyRuns(root, LAYOUTS, *common)


@pytest.mark.parametrize("layout", ["ring2", "fsdp_ring2"])
def test_a_lora_distillation_with_checkpointing_equals_one_process(runs, layout):
    """rCM (DMD2's critic and matching term, and sCM's JVP through the adapters and, under FSDP, the sharded weights):
    the student's and the critic's adapters train, their bases and the teacher stay as they started; the losses (the
    sCM loss too) and the student's weights (its EMA too) equal one process's; under DDP the critic's weights as
    well."""
    name, loss_tolerance, rtol, atol = TOLERANCE[layout]
    reference = distill_losses(runs.trained(name), "train/scm_loss")
    parallel = distill_losses(runs.trained(layout), "train/scm_loss")
    assert sorted(reference) == sorted(parallel) == [0, 1]
    for step, values in reference.items():
        assert parallel[step] == pytest.approx(values, rel=loss_tolerance), f"step {step}"
    checkpoint = runs.trained(layout) / "checkpoints" / "last.ckpt"
    for prefer in ("model", "ema"):
        expected = read_weights(runs.trained(name) / "checkpoints" / "last.ckpt", prefer=prefer)[0]
        got = read_weights(checkpoint, prefer=prefer)[0]
        lora_b = [value for key, value in expected.items() if "lora_B" in key]  # B starts at zero
        assert lora_b and max(float(value.abs().max()) for value in lora_b) > 0, "the adapters did not train"
        assert_same_numbers(got, expected, rtol=rtol, atol=atol, where=f"{layout} {prefer}")
    if checkpoint.is_file():  # DDP: the critic's adapters too, and they moved while its base did not
        state = torch.load(checkpoint, weights_only=True)["state_dict"]
        expected = torch.load(runs.trained(name) / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        critic = {key: value for key, value in state.items() if key.startswith("critic.")}
        assert any("lora_B" in key for key in critic)
        assert_same_numbers(critic, {key: expected[key] for key in critic}, rtol=rtol, atol=atol,
                            where=f"{layout} critic")
        moved = [key for key in critic if "lora_B" in key and critic[key].abs().max() > 0]  # B starts at zero
        assert moved, "the critic's adapters did not train"


# tiny Wan on two buckets, 45 and 75 tokens (neither divides into 2 equal shards without padding' tails differing)
BUCKETS = ["data.num_samples=24", "data.buckets=[[3,6,10],[5,6,10]]", "data.bucket_samples=[8,16]",
           "data.batch_size=2", "callbacks.model_checkpoint.every_n_train_steps=1"]
GAN = ["distill.gan_loss=true", "distill.gan_generator_weight=0.5", "distill.gan_critic_weight=0.5"]
REGRESSION = ["distill.regression_loss=true", "distill.regression_pairs=3", "distill.regression_weight=0.5"]


def test_a_bucketed_text_distillation_equals_one_process_at_ring_2_and_resumes_exactly(tmp_path):
    """Every student update reads one bucket (the same on every rank), its samples, critic and matching losses of
    that shape; the GAN head pools a bucket's tokens over the ring; the regression pairs are the training data's
    first prompts of the data's image_size, the teacher sampling 2 guided Euler steps. float64, but diffusers' Wan
    blocks compute norms and residuals in float32: where the layouts' float64 sums differ in the last digit, a float32
    result can round the other way (u = 6e-8). Measured 1.3e-9 relative in the losses and 1.3e-9 in the weights (max
    ~1); rel / atol 1e-6 (16 u) leaves room for another CPU's roundings and is far below what a wrong gradient moves
    (>= 1e-3 at lr 0.5). A resumed run continues bit for bit (the same process count and kernels)."""
    env = {"HF_HUB_OFFLINE": "1"}
    common = [*WAN, *BUCKETS, f"data.cache_dir={tmp_path / 'data'}"]
    run("train.py", tmp_path / "teacher", *common, "trainer.max_steps=1", env=env)
    distill = [*common, *FP64, *GAN, *REGRESSION, "trainer.max_steps=2", "distill=dmd2", "distill.critic_steps=1",
               "diffusion.sampling.steps=2", f"init_from={tmp_path / 'teacher' / 'checkpoints' / 'last.ckpt'}"]
    for name, layout in {"one": [], "ring2": ["ring_degree=2"]}.items():
        run("train.py", tmp_path / name, *distill, *layout, env=env)
    logged = ("train/gan_loss", "train/critic_gan_loss", "train/regression_loss", "train/sample_tokens")
    reference, parallel = distill_losses(tmp_path / "one", *logged), distill_losses(tmp_path / "ring2", *logged)
    assert sorted(reference) == sorted(parallel) == [0, 1]
    assert {values[-1] for values in reference.values()} == {45, 75}  # one update of each bucket (seed 0's draws)
    for step, values in reference.items():
        assert parallel[step] == pytest.approx(values, rel=1e-6), f"step {step}"
    final = torch.load(tmp_path / "one" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert {key.split(".")[0] for key in final} == {"model", "ema", "critic", "gan_head"}
    got = torch.load(tmp_path / "ring2" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert_same_numbers(got, final, rtol=1e-6, atol=1e-6, where="bucketed Wan at ring 2")

    run("train.py", tmp_path / "resumed", *distill, f"ckpt_path={tmp_path / 'one' / 'checkpoints' / 'step_0000001.ckpt'}",
        env=env)
    assert distill_losses(tmp_path / "resumed", *logged)[1] == reference[1]
    resumed = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert_same_numbers(resumed, final, where="resumed")



class GraphCounts(L.Callback):
    """Dynamo's count of compiled graphs after each student update (in this process: ``GRAPHS``)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        GRAPHS.append(counters["stats"]["unique_graphs"])


GRAPHS: list[int] = []


def test_a_compiled_distillation_equals_eager_and_compiles_in_its_first_update(tmp_path, monkeypatch):
    """compile=true compiles the student's, the critic's and the teacher's blocks; each runs in its own modes (the
    student with and without gradients, the critic frozen for the GAN loss's input gradient, the teacher without), so
    the first update compiles a graph per mode (8, measured) and the later ones reuse them; the losses and weights
    equal eager's. aot_eager (Dynamo's graphs and guards, what decides a recompilation, without Inductor's codegen,
    whose numbers tests/test_compile.py checks): float64, measured exact; rel 1e-10 for safety. The recompile limit is
    raised so that a graph per update would show here instead of falling back to eager."""
    import ringdit.models.build

    monkeypatch.setattr(ringdit.models.build, "compile_blocks",
                        functools.partial(ringdit.models.build.compile_blocks, backend="aot_eager"))
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 64)
    run("train.py", tmp_path / "teacher", *TINY)
    common = [*TINY, *SGD, *FP64, "trainer.max_steps=3", "distill=dmd2", "distill.critic_steps=2",
              f"init_from={tmp_path / 'teacher' / 'checkpoints' / 'last.ckpt'}", "distill.gan_loss=true",
              "distill.gan_critic_weight=0.5"]
    run("train.py", tmp_path / "eager", *common)
    torch._dynamo.reset()
    counters.clear()
    GRAPHS.clear()
    run("train.py", tmp_path / "compiled", *common, "compile=true",
        "+callbacks.graphs._target_=tests.test_distill_combos.GraphCounts")
    assert len(GRAPHS) == 3 and GRAPHS[0] > 0
    assert GRAPHS[-1] == GRAPHS[0], f"graphs compiled after each update: {GRAPHS}"
    eager, compiled = distill_losses(tmp_path / "eager", "train/gan_loss"), distill_losses(tmp_path / "compiled", "train/gan_loss")
    assert sorted(compiled) == [0, 1, 2]
    for step, values in eager.items():
        assert compiled[step] == pytest.approx(values, rel=1e-10), f"step {step}"
    state = {name: torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
             for name in ("eager", "compiled")}
    assert_same_numbers(state["compiled"], state["eager"], rtol=1e-10, atol=1e-12, where="compiled")
