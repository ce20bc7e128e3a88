"""Distillation and the memory toolkit under bad input and faults (issue 53): settings of the wrong kind or out of
range refused in one line before any rank starts, each refusal's advice followed to a run that trains; a checkpoint
of a distillation resumed as plain training (and back) refused with advice that works; one rank SIGKILLed while a
distillation checkpoint is written leaves the previous one intact, and the run resumed from it equals the
uninterrupted one bit for bit."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.distributed import run_command_ranks
from ringdit.checkpoints.weights import read_weights
from ringdit.spec import TrainSpec
from tests.helpers import TINY, assert_refused, assert_same_numbers, compose_train, distill_losses, fail_fast, run

pytestmark = pytest.mark.timeout(600)

DISTILL = ["distill=dmd2", "distill.critic_steps=1"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("teacher")
    run("train.py", run_dir, *TINY)
    return run_dir / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, teacher) -> Path:
    """2 student updates, a checkpoint after each, the teacher guided at distill.cfg_scale=1.5 (what the guidance
    refusal advises)."""
    run_dir = tmp_path_factory.mktemp("distilled")
    run("train.py", run_dir, *TINY, *DISTILL, f"init_from={teacher}", "trainer.max_steps=2",
        "callbacks.model_checkpoint.every_n_train_steps=1", "distill.cfg_scale=1.5")
    return run_dir / "checkpoints"


def refused(tmp_path, *overrides: str, text: str) -> str:
    proc, seconds = fail_fast("train.py", *TINY, *overrides, f"hydra.run.dir={tmp_path / 'refused'}")
    return assert_refused(proc, text=text, seconds=seconds, run_dir=tmp_path / "refused")


# ---- the teacher's guidance --------------------------------------------------------------------------------------


GUIDANCE = "is not a teacher's guidance scale: give a number in [1, 100] (1: the teacher unguided; DMD2 guides with " \
           "1.75 to 8), e.g. distill.cfg_scale=1.5"


@pytest.mark.parametrize("overrides, given", [
    (["distill.cfg_scale=-2"], "distill.cfg_scale=-2 "),
    (["distill.cfg_scale=0.5"], "distill.cfg_scale=0.5 "),
    (["distill.cfg_scale=101"], "distill.cfg_scale=101 "),
    (["distill.cfg_scale=1e300"], "distill.cfg_scale=1e+300 "),
    (["distill.cfg_scale=abc"], "distill.cfg_scale='abc' "),
    (["distill.cfg_scale=true"], "distill.cfg_scale=True "),
    (["diffusion.sampling.cfg_scale=-2"], "distill.cfg_scale=null takes the run's diffusion.sampling.cfg_scale=-2, "
                                          "which "),
])
def test_a_teacher_guidance_out_of_range_is_refused_and_the_advice_trains(teacher, distilled, tmp_path, overrides,
                                                                          given):
    """A negative scale guides away from the condition, below 1 mixes in the unconditional prediction, far above 100
    only the rounding changes: refused, also where distill.cfg_scale=null takes the run's own; the advice
    (distill.cfg_scale=1.5) is what the ``distilled`` fixture trained with."""
    refused(tmp_path, *DISTILL, f"init_from={teacher}", *overrides, text=given + GUIDANCE)
    assert torch.load(distilled / "last.ckpt", weights_only=True)["hyper_parameters"]["distill"]["cfg_scale"] == 1.5


def test_a_student_of_too_many_steps_is_refused(teacher, tmp_path):
    """Each update simulates up to distill.steps student steps: 100000 never finished its first update."""
    refused(tmp_path, *DISTILL, f"init_from={teacher}", "distill.steps=100000",
            text="distill.steps=100000 is not a few-step student: each student and critic update runs up to that many "
                 "student forwards (backward simulation); distil at most 100 steps (DMD2: 1 to 4), e.g. "
                 "distill.steps=4")


# ---- a distillation checkpoint resumed as plain training, and back -------------------------------------------------


def test_a_distillation_checkpoint_resumed_without_distill_is_refused_and_both_advices_train(teacher, distilled,
                                                                                               tmp_path):
    """The issue's path: distill=none (also with resume_optimizer=false, the old advice, which ended in "Unexpected
    key(s) in state_dict: critic.*") is refused; both ways the message gives train: the distillation resumed, and its
    student trained on as a plain model from its weights (the student's EMA, no critic)."""
    checkpoint = distilled / "step_0000001.ckpt"
    message = (f"ckpt_path={checkpoint} is a distillation checkpoint (distill=dmd2: a student, its critic and their "
               f"two optimizers), but this run has distill=none; resume the distillation with distill=dmd2 "
               f"init_from={teacher}, or train its student on as a plain model, from its weights: "
               f"init_from={checkpoint} instead of ckpt_path")
    for extra in ([], ["resume_optimizer=false"]):
        refused(tmp_path, f"ckpt_path={checkpoint}", *extra, text=message)
    run("train.py", tmp_path / "resumed", *TINY, "distill=dmd2", f"init_from={teacher}", f"ckpt_path={checkpoint}",
        "distill.critic_steps=1", "distill.cfg_scale=1.5", "trainer.max_steps=2")
    assert sorted(distill_losses(tmp_path / "resumed")) == [1]
    run("train.py", tmp_path / "plain", *TINY, f"init_from={checkpoint}", "trainer.max_steps=1")
    plain = torch.load(tmp_path / "plain" / "checkpoints" / "last.ckpt", weights_only=True)
    assert {key.split(".")[0] for key in plain["state_dict"]} == {"model", "ema"} and plain["global_step"] == 1


def test_a_plain_checkpoint_resumed_as_a_distillation_is_refused_and_both_advices_train(teacher, tmp_path):
    checkpoint = teacher.with_name("step_0000002.ckpt")
    refused(tmp_path, *DISTILL, f"init_from={teacher}", f"ckpt_path={checkpoint}", "resume_optimizer=false",
            text=f"ckpt_path={checkpoint} is a plain training checkpoint (one model, no critic), but this run has "
                 f"distill=dmd2; distil it as the teacher: init_from={checkpoint} instead of ckpt_path, or resume its "
                 f"training with distill=none")
    run("train.py", tmp_path / "distil", *TINY, *DISTILL, f"init_from={checkpoint}", "trainer.max_steps=1")
    run("train.py", tmp_path / "resume", *TINY, f"ckpt_path={checkpoint}")
    assert torch.load(tmp_path / "distil" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 1


def test_a_distillation_resumed_with_another_gan_head_setting_is_refused_and_the_advice_trains(teacher, distilled,
                                                                                               tmp_path):
    checkpoint = distilled / "step_0000001.ckpt"
    common = [*DISTILL, f"init_from={teacher}", f"ckpt_path={checkpoint}", "trainer.max_steps=2"]
    refused(tmp_path, *common, "distill.gan_loss=true",
            text=f"ckpt_path={checkpoint} was distilled without the GAN head (its weights and optimizer state are not "
                 f"in it), but this run has distill.gan_loss=true; resume with distill.gan_loss=false")
    run("train.py", tmp_path / "resumed", *TINY, *common, "distill.gan_loss=false")


# ---- settings of the wrong kind: the type the code declares --------------------------------------------------------


BAD_KINDS = {  # overrides -> the refusal; its advice (the last "e.g. X=Y") is then checked to pass
    "activation_offload=maybe": (["model.activation_offload=maybe"],
                                 "model.activation_offload='maybe' must be true or false, e.g. "
                                 "model.activation_offload=false"),
    "activation_offload=1": (["model.activation_offload=1"], "model.activation_offload=1 must be true or false"),
    "activation_offload=''": (["model.activation_offload=''"], "model.activation_offload='' must be true or false"),
    "activation_offload=null": (["model.activation_offload=null"],
                                "model.activation_offload=null must be true or false"),
    "learn_sigma=maybe": (["model.learn_sigma=maybe"], "model.learn_sigma='maybe' must be true or false, e.g. "
                                                       "model.learn_sigma=true"),
    "fused=maybe": (["optimizer.fused=maybe"], "optimizer.fused='maybe' must be true, false or null, e.g. "
                                               "optimizer.fused=null"),
    "amsgrad=maybe": (["+optimizer.amsgrad=maybe"], "optimizer.amsgrad='maybe' must be true or false, e.g. "
                                                    "optimizer.amsgrad=false"),
    "eps=abc": (["+optimizer.eps=abc"], "optimizer.eps='abc' must be a number, e.g. optimizer.eps=1e-08"),
    "unknown key": (["+optimizer.foo=1"], "optimizer.foo is not a setting of torch.optim.AdamW; drop it, or use one "
                                          "of lr, betas, eps, weight_decay, amsgrad"),
    "sgd nesterov=maybe": (["optimizer=sgd", "+optimizer.nesterov=maybe"],
                           "optimizer.nesterov='maybe' must be true or false, e.g. optimizer.nesterov=false"),
    "adamw8bit bf16_stochastic_round=maybe": (["optimizer=adamw8bit", "+optimizer.bf16_stochastic_round=maybe"],
                                              "optimizer.bf16_stochastic_round='maybe' must be true or false, e.g. "
                                              "optimizer.bf16_stochastic_round=false"),
    "adamw8bit block_size=abc": (["optimizer=adamw8bit", "optimizer.block_size=abc"],
                                 "optimizer.block_size='abc' must be a whole number, e.g. optimizer.block_size=256"),
}


@pytest.mark.parametrize("case", list(BAD_KINDS))
def test_a_setting_of_the_wrong_kind_is_refused_and_the_advice_passes(case, tmp_path):
    """One check for every setting a model class or an optimizer declares (its annotations, else its defaults'
    types): a string is not a boolean, however truthy. The advised value passes every check of train.py (what it
    checks before spawning the ranks: ``TrainSpec``)."""
    overrides, text = BAD_KINDS[case]
    line = refused(tmp_path, *overrides, text=text)
    if ", e.g. " in line:
        advice = line.rsplit(", e.g. ", 1)[1]
        key = advice.split("=", 1)[0]
        fixed = [o for o in overrides if o.lstrip("+").split("=", 1)[0] != key]
        cfg = compose_train([*TINY, *fixed, ("+" if f"+{key}=" in " ".join(overrides) else "") + advice],
                            tmp_path / "advised")
        cfg.paths.output_dir = str(tmp_path / "advised")  # as a run's Hydra sets it (compose alone does not)
        TrainSpec.from_config(cfg)  # every check train.py makes before it spawns a rank


def test_a_new_boolean_setting_is_checked_by_its_annotation():
    """The declared kinds come from the code: a new parameter is covered without a list of names to keep."""
    from ringdit.common.errors import ConfigError
    from ringdit.spec.setting_types import check_setting_types, declared_types

    class Model:
        def __init__(self, offload_more: bool = False, share: bool | float | str = 0.5, name: str = "x", width=4):
            pass

    assert declared_types(Model) == {"offload_more": (bool,), "width": (int,)}
    check_setting_types("model", {"offload_more": True, "share": "every_2", "name": 3, "width": 8}, Model)
    with pytest.raises(ConfigError, match=r"^model.offload_more='yes' must be true or false, e.g. "
                                          r"model.offload_more=false$"):
        check_setting_types("model", {"offload_more": "yes"}, Model)
    with pytest.raises(ConfigError, match=r"^model.width=4.5 must be a whole number, e.g. model.width=4$"):
        check_setting_types("model", {"width": 4.5}, Model)


OUT_OF_RANGE = {
    "betas of one": (["optimizer.betas=[0.9]"], "optimizer.betas=[0.9] must be two numbers in [0, 1), the moments' "
                                                "decays, e.g. optimizer.betas=[0.9,0.99]"),
    "betas of three": (["optimizer.betas=[0.9,0.9,0.9]"], "optimizer.betas=[0.9, 0.9, 0.9] must be two numbers"),
    "beta of 1": (["optimizer.betas=[1,0.9]"], "optimizer.betas[0] must be in [0, 1), got 1: a decay of 1 never "
                                              "forgets a gradient (torch refuses it); e.g. optimizer.betas=[0.9,0.99]"),
    "negative eps": (["+optimizer.eps=-1"], "optimizer.eps must be in [0, inf], got -1"),
    "nesterov without momentum": (["optimizer=sgd", "+optimizer.nesterov=true"],
                                  "optimizer.nesterov=true needs momentum and no dampening (torch's SGD), but "
                                  "optimizer.momentum=0.0 and optimizer.dampening=0; set optimizer.momentum=0.9"),
    "negative dampening": (["optimizer=sgd", "+optimizer.dampening=-1"],
                           "optimizer.dampening must be in [0, 1], got -1"),
    "block_size=0": (["optimizer=adamw8bit", "optimizer.block_size=0"],
                     "optimizer.block_size must be a positive integer, got 0"),
    "lora.rank=abc": (["lora.rank=abc"], "lora.rank must be an integer >= 0, got 'abc'"),
}


@pytest.mark.parametrize("case", list(OUT_OF_RANGE))
def test_an_optimizer_or_lora_setting_torch_would_refuse_in_the_ranks_is_refused_before(case, tmp_path):
    overrides, text = OUT_OF_RANGE[case]
    refused(tmp_path, *overrides, text=text)


def test_the_nesterov_advice_trains(tmp_path):
    run("train.py", tmp_path, *TINY, "optimizer=sgd", "+optimizer.nesterov=true", "optimizer.momentum=0.9",
        "trainer.max_steps=1")


# ---- SIGKILL of a rank while a distillation checkpoint is written --------------------------------------------------


class KillWhileSaving(L.Callback):
    """On global rank ``rank``, when step ``step``'s ``file`` is being written, half of this rank's bytes of it reach
    the disk and the process gets SIGKILL (no handler runs): a kill in the middle of the write. DDP: rank 0 writes the
    file through the run's atomic writer (``AtomicCheckpointIO``: ``torch.save`` into a temporary file, then a rename);
    FSDP: every rank writes its shards into a temporary folder (``torch.distributed.checkpoint.save``) that rank 0
    renames once all are done. Only this rank's process, forked for the test, has its writer wrapped."""

    def __init__(self, rank: int, step: int, file: str = "last.ckpt"):
        self.rank, self.step, self.file = rank, step, file

    def setup(self, trainer, pl_module, stage) -> None:
        if trainer.global_rank != self.rank:
            return
        import torch.distributed.checkpoint as dcp

        def tear(files) -> None:
            if trainer.global_step == self.step:
                for written in files:
                    with open(written, "r+b") as handle:
                        handle.truncate(os.path.getsize(written) // 2)
                        os.fsync(handle.fileno())
                os.kill(os.getpid(), signal.SIGKILL)

        save, dcp_save = torch.save, dcp.save

        def torn_save(obj, path, *args, **kwargs):
            save(obj, path, *args, **kwargs)
            if isinstance(path, (str, os.PathLike)) and Path(path).name.startswith(f".{self.file}."):
                tear([path])  # (a BytesIO: an object broadcast between the ranks)

        def torn_dcp_save(state, *args, checkpoint_id=None, **kwargs):
            result = dcp_save(state, *args, checkpoint_id=checkpoint_id, **kwargs)
            if Path(checkpoint_id).name.startswith(f".{self.file}."):  # this rank's shard files
                tear(sorted(Path(checkpoint_id).glob(f"__{trainer.global_rank}_*.distcp")))
            return result

        torch.save, dcp.save = torn_save, torn_dcp_save


@pytest.mark.parametrize("strategy, rank", [("ddp", 0), pytest.param("fsdp", 1, marks=pytest.mark.slow)])
def test_sigkill_of_a_rank_while_a_distillation_checkpoint_is_written(teacher, tmp_path, strategy, rank):
    """2 ranks (ring 2) distil 4 student updates with a checkpoint every 2, AdamW (its state matters on resume); one
    rank is killed half-way through writing step 4's last.ckpt (DDP: rank 0, the writer; FSDP: rank 1, one of the
    shards' writers). last.ckpt is still step 2's, whole and equal to the uninterrupted run's step-2 checkpoint; the
    other rank ends instead of waiting; the run resumed from it gives the uninterrupted run's losses and final weights
    (student, EMA; under DDP the critic too) bit for bit: the same ranks and kernels repeat the same arithmetic."""
    common = [*TINY, *DISTILL, f"init_from={teacher}", "ring_degree=2", "trainer.max_steps=4", "optimizer=adamw",
              f"trainer/strategy={strategy}", "callbacks.model_checkpoint.every_n_train_steps=2",
              "trainer.strategy.timeout_s=60"]
    run("train.py", tmp_path / "straight", *common)
    killed = tmp_path / "killed"
    proc = run_command_ranks("train.py", (*common, f"hydra.run.dir={killed}",
                                          "+callbacks.kill._target_=tests.test_distill_faults.KillWhileSaving",
                                          f"+callbacks.kill.rank={rank}", "+callbacks.kill.step=4"),
                             2, {"WANDB_MODE": "offline"}, timeout=240)
    assert proc.returncode != 0, proc.stderr[-3000:]  # both ranks ended (each reported, or was killed)
    checkpoints = killed / "checkpoints"
    assert list(checkpoints.glob(".last.ckpt.*"))  # the torn write, never renamed onto last.ckpt
    last, expected = checkpoints / "last.ckpt", tmp_path / "straight" / "checkpoints" / "step_0000002.ckpt"
    for prefer in ("model", "ema"):
        assert_same_numbers(read_weights(last, prefer=prefer)[0], read_weights(expected, prefer=prefer)[0],
                            where=f"the kept last.ckpt's {prefer}")
    if strategy == "ddp":
        kept = torch.load(last, weights_only=True)
        assert kept["global_step"] == 2 and {key.split(".")[0] for key in kept["state_dict"]} == {"model", "ema",
                                                                                                   "critic"}
        assert_same_numbers(kept["state_dict"], torch.load(expected, weights_only=True)["state_dict"],
                            where="the kept last.ckpt")

    run("train.py", tmp_path / "resumed", *common, f"ckpt_path={last}")
    straight, resumed = distill_losses(tmp_path / "straight"), distill_losses(tmp_path / "resumed")
    assert sorted(resumed) == [2, 3] and all(resumed[step] == straight[step] for step in resumed)
    final = {name: tmp_path / name / "checkpoints" / "last.ckpt" for name in ("straight", "resumed")}
    for prefer in ("model", "ema"):
        assert_same_numbers(read_weights(final["resumed"], prefer=prefer)[0],
                            read_weights(final["straight"], prefer=prefer)[0], where=f"resumed {prefer}")
    if strategy == "ddp":
        assert_same_numbers(torch.load(final["resumed"], weights_only=True)["state_dict"],
                            torch.load(final["straight"], weights_only=True)["state_dict"], where="resumed")
