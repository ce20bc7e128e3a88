"""Bad input fails fast with a clear message; faults end runs instead of hanging them; killed runs resume exactly;
checkpoints are written atomically and loaded without running code."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from ringdit.checkpoints.loading import safe_torch_load
from ringdit.common.errors import CheckpointError
from ringdit.training.checkpoint_io import AtomicCheckpointIO
from tests.distributed import PRELOAD, run_command_ranks
from tests.faults import save_a_big_checkpoint
from tests.helpers import TINY, assert_refused, fail_fast, in_process, logged_losses, run, write_latents


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, tiny_checkpoint) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("bad")
    truncated = folder / "truncated.ckpt"
    data = tiny_checkpoint.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    text = folder / "notes.ckpt"
    text.write_text("not a checkpoint\n")
    return {"truncated": truncated, "text": text, "tiny": tiny_checkpoint}


BAD_TRAIN_INPUTS = {
    "ring_degree zero": (["ring_degree=0"], r"ring_degree must be a positive integer, got 0"),
    "ring_degree not an integer": (["ring_degree=1.5"], r"ring_degree must be a positive integer, got 1.5"),
    "ulysses_degree negative": (["ulysses_degree=-2"], r"ulysses_degree must be a positive integer, got -2"),
    "world not divisible": (["ring_degree=2", "trainer.devices=3"],
                            r"dp_degree x ring_degree x ulysses_degree = 1 x 2 x 1 = 2 ranks, but trainer.devices x "
                            r"trainer.num_nodes = 3 x 1 = 3 processes; choose degrees whose product is 3"),
    "devices contradict dp_degree": (["ring_degree=2", "trainer.devices=4"],
                                     r"= 1 x 2 x 1 = 2 ranks, but trainer.devices x trainer.num_nodes = 4 x 1 = 4 "
                                     r"processes; set dp_degree=2, or leave trainer.devices unset"),
    "more Ulysses ranks than heads": (["ulysses_degree=8"], r"ulysses_degree=8 is more than the model's "
                                      r"num_heads=4: .*use ulysses_degree=4 with ring_degree multiplied by 2"),
    "strategy cfg_parallel not a bool": (["trainer/strategy=fsdp", "trainer.strategy.cfg_parallel=maybe"],
                                         r"trainer.strategy.cfg_parallel must be true or false, got 'maybe'"),
    "strategy cfg_parallel on one replica": (["trainer.strategy.cfg_parallel=true"],
                                             r"cfg_parallel=true runs the two halves of guidance on two data-parallel"),
    "non-ring backend": (["ring_degree=2", "attention_backend=torch_sdpa"],
                         r"Ring Attention requires one of the ring-capable backends \(torch_flash, flash_attn, math\), "
                         r"got 'torch_sdpa'"),
    "unknown backend": (["attention_backend=flash"], r"unknown attention backend 'flash'.*torch_flash \(available\)"),
    "unavailable backend": (["ring_degree=2", "attention_backend=flash_attn"],
                            r"'flash_attn' is not available on cpu.*torch_flash \(available\)"),
    "missing ckpt_path": (["ckpt_path=/nonexistent/last.ckpt"], r"ckpt_path='/nonexistent/last.ckpt' does not exist"),
    "missing init_from": (["init_from=/nonexistent/w.safetensors"],
                          r"init_from: checkpoint '/nonexistent/w.safetensors' does not exist"),
    "patch does not divide the image": (["model.patch_size=3"],
                                        r"the data's sample shape \[8, 8\] is not divisible by the model's "
                                        r"patch \[3, 3\] \(model.patch_size\)"),
    "hidden not divisible by heads": (["model.num_heads=5"], r"hidden_size=128 is not divisible by num_heads=5"),
    "batch size zero": (["data.batch_size=0"], r"data.batch_size must be a positive integer, got 0"),
    "no steps": (["trainer.max_steps=0"], r"trainer.max_steps must be a positive integer, got 0"),
    "guidance without a null class": (["model.class_dropout_prob=0", "diffusion.sampling.cfg_scale=1.5"],
                                      r"cfg_scale=1.5 needs a model trained with label dropout \(a null class\)"),
    "sampler of another objective": (["diffusion.sampling.sampler=ddim"],
                                     r"sampler='ddim' does not fit the FlowMatching objective"),
    "guidance of more channels than the model has": (
        ["diffusion=ddpm", "diffusion.sampling.guidance_channels=5"],
        r"diffusion\.sampling\.guidance_channels=5 is not a number of the model's \d+ latent channels; use null to "
        r"guide all of them, or 1\.\.\d+ \(3: the original DiT's\)"),
}


@pytest.mark.parametrize("case", list(BAD_TRAIN_INPUTS))
def test_bad_train_input_fails_fast_and_clearly(case, tmp_path):
    overrides, message = BAD_TRAIN_INPUTS[case]
    proc, seconds = fail_fast("train.py", *overrides, f"hydra.run.dir={tmp_path}")
    assert_refused(proc, message, seconds=seconds, run_dir=tmp_path)


@pytest.mark.parametrize(
    ("setting", "file", "message"),
    [
        ("ckpt_path", "truncated", r"ckpt_path: .*truncated.ckpt is not a readable PyTorch checkpoint"),
        ("ckpt_path", "text", r"ckpt_path: .*notes.ckpt is not a readable PyTorch checkpoint"),
        ("init_from", "truncated", r"init_from: .*truncated.ckpt is not a readable PyTorch checkpoint"),
        ("ckpt_path", "tiny", r"ckpt_path: ckpt_path=.*last.ckpt does not fit this model .*shape mismatches, file vs "
                              r"model \(31\): final_layer.adaLN_modulation.1.bias \(64,\) vs \(256,\).*missing keys \(40\)"),
    ],
)
def test_bad_checkpoint_files(setting, file, message, bad_files, tmp_path):
    proc, seconds = fail_fast("train.py", f"{setting}={bad_files[file]}", f"hydra.run.dir={tmp_path}")
    assert_refused(proc, message, seconds=seconds)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["num_samples=0"], r"num_samples must be a positive integer, got 0"),
        (["diffusion.sampling.steps=0"], r"steps must be a positive integer, got 0"),
        (["labels=[12]"], r"labels: class id 12 is out of range; this model has classes 0..9"),
        (["ring_degree=2", "attention_backend=torch_sdpa"], r"Ring Attention requires one of the ring-capable"),
    ],
)
def test_bad_infer_input(overrides, message, tiny_checkpoint, tmp_path):
    proc, seconds = fail_fast("infer.py", f"ckpt_path={tiny_checkpoint}", *overrides, f"hydra.run.dir={tmp_path}")
    assert_refused(proc, message, seconds=seconds)


def test_full_traceback_on_request(tmp_path):
    proc, _ = in_process("train.py", "ring_degree=0", f"hydra.run.dir={tmp_path}", env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr


# ---- faults ---------------------------------------------------------------------------------------------------------

FAULT_BOUND_SECONDS = 120


def test_a_failing_rank_ends_the_run(tmp_path):
    """2 ranks (ring 2, forked as torchrun starts them): rank 1 fails while reading its data (the same exception path
    as a failing step); rank 0 ends too, within the bound, instead of waiting in the next collective."""
    start = time.monotonic()
    proc = run_command_ranks("train.py", (*TINY, "trainer.max_steps=50", "trainer.strategy.timeout_s=30",
                                          "ring_degree=2", "data._target_=tests.faults.FailingDigitsDataModule",
                                          "+data.fail_rank=1", "+data.after=40", f"hydra.run.dir={tmp_path}"),
                             2, {"WANDB_MODE": "offline"}, timeout=FAULT_BOUND_SECONDS)
    assert proc.returncode != 0
    assert "injected data-loading fault after 40 reads" in proc.stderr, proc.stderr[-3000:]
    assert "ended without a report" not in proc.stderr, proc.stderr[-3000:]  # every rank ended by itself
    assert time.monotonic() - start < FAULT_BOUND_SECONDS


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nonfinite_loss(policy, tmp_path):
    explode = ["optimizer=sgd", "optimizer.lr=1e30", "trainer.gradient_clip_val=null", "trainer.max_steps=4",
               "callbacks.model_checkpoint.every_n_train_steps=1", f"nonfinite_loss={policy}"]
    proc, _ = in_process("train.py", *TINY, *explode, f"hydra.run.dir={tmp_path}")
    if policy == "stop":
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "step 1: the loss is inf; training stopped before updating the weights" in proc.stderr
        assert "The last checkpoint written before is kept" in proc.stderr
        kept = safe_torch_load(tmp_path / "checkpoints" / "last.ckpt")
        assert kept["global_step"] == 1
        assert all(torch.isfinite(v).all() for v in kept["state_dict"].values() if v.is_floating_point())
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "skipping this step (nonfinite_loss=skip)" in proc.stderr
        # every later loss is inf too: all skipped, so the weights are still those of step 1
        after_one = safe_torch_load(tmp_path / "checkpoints" / "step_0000001.ckpt")["state_dict"]
        final = safe_torch_load(tmp_path / "checkpoints" / "last.ckpt")
        assert final["global_step"] == 4
        for key, value in after_one.items():
            torch.testing.assert_close(final["state_dict"][key], value, msg=key)


def test_killed_run_resumes_on_the_same_loss_curve(tmp_path):
    common = [*TINY, "trainer.max_steps=8", "callbacks.model_checkpoint.every_n_train_steps=2", "optimizer=adamw",
              "scheduler=warmup_cosine", "scheduler.warmup_steps=2"]
    run("train.py", tmp_path / "straight", *common)

    # SIGKILL (no handler runs, nothing is flushed) after step 5, in a process forked from the test's fork server
    killed = tmp_path / "killed"
    proc = run_command_ranks("train.py", (*common, "+callbacks.kill._target_=tests.faults.SignalAtStep",
                                          "+callbacks.kill.rank=0", "+callbacks.kill.step=5", "+callbacks.kill.sig=SIGKILL",
                                          f"hydra.run.dir={killed}"), 1, {"WANDB_MODE": "offline"}, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert not (killed / "checkpoints" / "step_0000006.ckpt").exists()

    last = killed / "checkpoints" / "last.ckpt"
    saved_step = safe_torch_load(last)["global_step"]  # step 4's: the kill came before step 5's save
    assert saved_step == 4
    run("train.py", tmp_path / "resumed", *common, f"ckpt_path={last}")
    straight, resumed = logged_losses(tmp_path / "straight"), logged_losses(tmp_path / "resumed")
    assert saved_step >= 2 and min(resumed) == saved_step and max(resumed) == 7
    for step, loss in resumed.items():
        assert loss == pytest.approx(straight[step], rel=1e-6, abs=1e-7), f"step {step}"
    final_straight = safe_torch_load(tmp_path / "straight" / "checkpoints" / "last.ckpt")["state_dict"]
    final_resumed = safe_torch_load(tmp_path / "resumed" / "checkpoints" / "last.ckpt")["state_dict"]
    for key, value in final_straight.items():  # model, EMA and its counter
        torch.testing.assert_close(final_resumed[key], value, rtol=1e-5, atol=1e-7, msg=key)

    # early in the run too (Lightning counts a resumed epoch on from the checkpoint's batch)
    run("train.py", tmp_path / "early", *common, f"ckpt_path={tmp_path / 'straight' / 'checkpoints' / 'step_0000002.ckpt'}")
    early = logged_losses(tmp_path / "early")
    assert sorted(early) == [2, 3, 4, 5, 6, 7]
    for step, loss in early.items():
        assert loss == pytest.approx(straight[step], rel=1e-6, abs=1e-7), f"step {step} after resuming at 2"


def test_resume_from_last(tmp_path):
    """``ckpt_path=last`` finds the newest run's last.ckpt under the log dir."""
    logs = tmp_path / "logs"
    first = logs / "train" / "runs" / "first"
    run("train.py", first, *TINY, "trainer.max_steps=2", f"paths.log_dir={logs}")
    run("train.py", logs / "train" / "runs" / "second", *TINY, "trainer.max_steps=3", "ckpt_path=last",
        f"paths.log_dir={logs}")
    assert sorted(logged_losses(logs / "train" / "runs" / "second")) == [2]


# ---- checkpoint files -------------------------------------------------------------------------------------------------


class _ExplodingPickle:
    def __reduce__(self):
        raise RuntimeError("disk full (simulated)")


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.ones(3)}, path)
    with pytest.raises(RuntimeError, match="disk full"):
        io.save_checkpoint({"step": 2, "w": torch.zeros(3), "boom": _ExplodingPickle()}, path)
    assert safe_torch_load(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left behind


def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"step": 1}, path)
    # the writer: a process forked from the fork server (torch already imported), killed in the middle of the write
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    writer = context.Process(target=save_a_big_checkpoint, args=(str(path),))
    writer.start()
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".last.ckpt.*.tmp")):  # the write has begun
        assert time.monotonic() < deadline and writer.is_alive()
        time.sleep(0.01)
    time.sleep(0.2)
    writer.kill()
    writer.join()
    assert writer.exitcode == -signal.SIGKILL  # killed, not done
    assert safe_torch_load(path) == {"step": 1}
    AtomicCheckpointIO().save_checkpoint({"step": 3}, path)  # the next save also clears the torn temporary file
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_malicious_pickle_is_refused(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": Payload()}, evil)
    with pytest.raises(CheckpointError, match=r"refusing to load .*evil.ckpt: it contains Python objects"):
        safe_torch_load(evil)
    assert not marker.exists()
    proc, _ = fail_fast("train.py", f"init_from={evil}", f"hydra.run.dir={tmp_path / 'run'}")
    assert_refused(proc, text="refusing to load")
    proc, _ = fail_fast("infer.py", f"ckpt_path={evil}", f"hydra.run.dir={tmp_path / 'infer'}")
    assert_refused(proc, text="refusing to load")
    assert not marker.exists()


def test_latents_that_do_not_fit_the_model(tmp_path):
    import numpy as np


    odd = write_latents(tmp_path, np.zeros((6, 4, 8, 7), np.float32), np.arange(6) % 2)
    proc, seconds = fail_fast("train.py", "data=latents", f"data.path={odd}", f"hydra.run.dir={tmp_path / 'run'}")
    assert_refused(proc, text="the data's sample shape [8, 7] is not divisible by the model's patch [2, 2] "
                              "(model.patch_size)", seconds=seconds)
    (tmp_path / "video").mkdir()
    video = write_latents(tmp_path / "video", np.zeros((6, 4, 2, 8, 8), np.float32), np.arange(6) % 2)
    proc, _ = fail_fast("train.py", "data=latents", f"data.path={video}", f"hydra.run.dir={tmp_path / 'run2'}")
    assert_refused(proc, text="the data gives videos (T, H, W) = [2, 8, 8] but the model is an image model")
