"""Launching: settings refused before anything is spawned (one line, exit code 2), Hydra's own mistakes reported the
same way, launches that cannot work ended quickly, preemption (SIGTERM) that keeps the work, memory estimates."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig

from ringdit.commands.cli import register_resolvers, user_errors
from tests.helpers import (
    CONF, FAST_FAIL_SECONDS, REPO, TINY, assert_refused, children_of, fail_fast, in_process, launch, logged_losses,
    prepare_train, run,
)


def compose_run(config_name: str, overrides: list[str], run_dir: Path):
    """The config ``python <config_name>.py overrides`` would run with, composed in this process."""
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name, overrides=[*overrides, f"hydra.run.dir={run_dir}"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    cfg.paths.output_dir = str(run_dir)
    return cfg


def refused(prepare, cfg, capsys) -> str:
    """Run ``prepare`` as train.py / infer.py do; it must exit with code 2 and one line; return that line."""
    with pytest.raises(SystemExit) as exit_info, user_errors():
        prepare(cfg)
    captured = capsys.readouterr()
    line = assert_refused(SimpleNamespace(returncode=exit_info.value.code, stderr=captured.err, stdout=captured.out))
    assert len(captured.err.strip().splitlines()) == 2  # the error and the HYDRA_FULL_ERROR hint
    return line


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("tiny")
    run("train.py", run_dir, *TINY, "trainer.max_steps=1")
    return run_dir / "checkpoints" / "last.ckpt"


# ---- settings that were checked only once training had started, or accepted silently -------------------------------

BAD_SETTINGS = {
    "lr negative": (["optimizer.lr=-1"], r"optimizer.lr must be in \[0, inf\], got -1"),
    "lr NaN": (["optimizer.lr=nan"], r"optimizer.lr must be a finite number, got nan"),
    "warmup negative": (["scheduler.warmup_steps=-3"], r"scheduler.warmup_steps must be an integer >= 0, got -3"),
    "num_workers negative": (["data.num_workers=-1"], r"data.num_workers must be an integer >= 0, got -1"),
    "timeout zero": (["trainer.strategy.timeout_s=0"], r"trainer.strategy.timeout_s must be in \(0, inf\], got 0"),
    "timeout NaN": (["trainer.strategy.timeout_s=nan"], r"trainer.strategy.timeout_s must be a finite number"),
    "grid per_class zero": (["callbacks.sample_grid.per_class=0"],
                            r"callbacks.sample_grid.per_class must be a positive integer, got 0"),
    "grid steps zero": (["callbacks.sample_grid.steps=0"], r"callbacks.sample_grid.steps must be a positive integer"),
    "grid every_n_steps zero": (["callbacks.sample_grid.every_n_steps=0"], r"every_n_steps must be a positive"),
    "grid cfg_scale NaN": (["callbacks.sample_grid.cfg_scale=nan"], r"callbacks.sample_grid.cfg_scale must be a finite"),
    "dp_degree fraction": (["dp_degree=1.5"], r"dp_degree must be a positive integer, got 1.5"),
    "accumulate zero": (["trainer.accumulate_grad_batches=0"], r"accumulate_grad_batches must be a positive integer"),
    "cfg_scale NaN": (["diffusion.sampling.cfg_scale=nan"], r"diffusion.sampling.cfg_scale must be a finite number"),
    "cfg_scale inf": (["diffusion.sampling.cfg_scale=inf"], r"diffusion.sampling.cfg_scale must be a finite number"),
    "ema_decay above 1": (["ema_decay=2"], r"ema_decay must be in \[0, 1\], got 2"),
    "clip negative": (["trainer.gradient_clip_val=-1"], r"trainer.gradient_clip_val must be in \[0, inf\], got -1"),
    "val interval zero": (["trainer.val_check_interval=0"], r"trainer.val_check_interval must be a positive integer"),
    "val fraction above 1": (["trainer.val_check_interval=1.5"], r"trainer.val_check_interval must be in \(0, 1\]"),
    "checkpoint interval negative": (["callbacks.model_checkpoint.every_n_train_steps=-1"],
                                     r"every_n_train_steps must be an integer >= 0, got -1"),
    "nonfinite_loss unknown": (["nonfinite_loss=foo"], r"nonfinite_loss must be 'stop' or 'skip', got 'foo'"),
    "weight decay negative": (["optimizer.weight_decay=-0.1"], r"optimizer.weight_decay must be in \[0, inf\]"),
    "beta above 1": (["optimizer.betas=[0.9,1.5]"], r"optimizer.betas\[1\] must be in \[0, 1\], got 1.5"),
    "val_fraction above 1": (["data.val_fraction=2"], r"data.val_fraction must be in \[0, 1\], got 2"),
    "depth zero": (["model.depth=0"], r"model.depth must be a positive integer, got 0"),
    "label dropout above 1": (["model.class_dropout_prob=1.5"], r"model.class_dropout_prob must be in \[0, 1\], got 1.5"),
    "log interval zero": (["trainer.log_every_n_steps=0"], r"trainer.log_every_n_steps must be a positive integer"),
    "rendezvous timeout zero": (["trainer.strategy.rendezvous_timeout_s=0"],
                                r"trainer.strategy.rendezvous_timeout_s must be in \(0, inf\], got 0"),
    # the strategies trust the degrees: they are checked here, once
    "replicate_degree zero": (["trainer/strategy=fsdp", "trainer.strategy.replicate_degree=0"],
                              r"trainer.strategy.replicate_degree must be a positive integer, got 0"),
    "replicate_degree not dividing": (["trainer/strategy=fsdp", "ring_degree=2", "trainer.strategy.replicate_degree=3"],
                                      r"trainer.strategy.replicate_degree=3 does not divide the world size 2"),
}


@pytest.mark.parametrize("case", list(BAD_SETTINGS))
def test_bad_training_setting_is_refused_before_spawning(case, tmp_path, capsys):
    import train

    overrides, message = BAD_SETTINGS[case]
    line = refused(train.prepare, compose_run("train", overrides, tmp_path), capsys)
    assert re.search(message, line), line


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["labels=[1.7]"], r"labels: 1.7 is not a class id \(a whole number\)"),
        (["diffusion.sampling.cfg_scale=nan"], r"cfg_scale must be a finite number, got nan"),
        (["diffusion.sampling.cfg_scale=-inf"], r"cfg_scale must be a finite number, got -inf"),
        (["model.guidance=abc"], r"model.guidance must be a finite number, got 'abc'"),
        (["dp_degree=1.5"], r"dp_degree must be a positive integer, got 1.5"),
        (["dp_degree=2", "num_samples=1"], r"num_samples=1 is fewer than the 2 data-parallel ranks \(dp_degree=2\)"),
        (["cfg_parallel=true"], r"cfg_parallel=true runs the two halves of guidance on two data-parallel replicas, "
                                r"so it needs an even number of them, got 1"),
    ],
)
def test_bad_infer_setting_is_refused(overrides, message, tiny_checkpoint, tmp_path, capsys):
    import infer

    line = refused(infer.prepare, compose_run("infer", [f"ckpt_path={tiny_checkpoint}", *overrides], tmp_path), capsys)
    assert re.search(message, line), line


def test_settings_errors_exit_2_from_the_command_line(tmp_path):
    """The wiring: the same checks, run by the script itself, before Lightning spawns anything."""
    proc, seconds = launch("train.py", "trainer.accumulate_grad_batches=0", "ring_degree=2",
                           f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2 and "trainer.accumulate_grad_batches must be a positive integer, got 0" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 2 and seconds < FAST_FAIL_SECONDS


# ---- Hydra's own mistakes ---------------------------------------------------------------------------------------------

HYDRA_MISTAKES = [
    ("train", ["ring_degre=2"], r"no setting named 'ring_degre'; did you mean ring_degree\?"),
    ("train", ["trainer.strategy.timout_s=5"], r"did you mean trainer.strategy.timeout_s\?"),
    ("train", ["model=foo"], r"model=foo: no such option \(options: cogvideox15, cogvideox15_tiny, dit, dit_b, dit_digits, dit_l"),
    ("train", ["ring_degree=["], r"could not parse an override"),
    ("train", ["callbacks=none", "callbacks.sample_grid.steps=2"],
     r"callbacks.sample_grid.steps is not a setting of the configs selected here"),
    ("infer", ["ckpt_path=x", "num_sample=3"], r"no setting named 'num_sample'; did you mean num_samples\?"),
    ("infer", ["ckpt_path=x", "trainer=tpu"], r"trainer=tpu: no such option; did you mean trainer=gpu\? \(options: cpu"),
]


@pytest.mark.parametrize(("config_name", "overrides", "message"), HYDRA_MISTAKES)
def test_hydra_mistakes_in_one_line(config_name, overrides, message, tmp_path):
    from ringdit.commands.cli import hydra_error_message

    with pytest.raises(Exception) as error:
        compose_run(config_name, overrides, tmp_path)
    line = hydra_error_message(error.value, config_name, in_task=False)
    assert line is not None and "\n" not in line and re.search(message, line), (line, str(error.value))


@pytest.mark.parametrize(
    ("script", "overrides", "message"),
    [
        ("train.py", ["ring_degre=2"], r"no setting named 'ring_degre'; did you mean ring_degree\?"),
        ("train.py", ["hydra.run.dir=/proc/no/such/dir"], r"cannot create the run folder \(/proc/no.*writable folder"),
        ("train.py", ["seed=???"], r"seed is required .*pass seed=\.\.\."),
    ],
)
def test_hydra_mistakes_exit_2_from_the_command_line(script, overrides, message, tmp_path):
    run_dir = [] if any(o.startswith("hydra.run.dir") for o in overrides) else [f"hydra.run.dir={tmp_path}"]
    proc, _ = fail_fast(script, *overrides, *run_dir)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and re.search(message, lines[0]), proc.stderr[-2000:]


def test_hydra_mistakes_keep_the_full_report_on_request(tmp_path):
    proc, _ = in_process("train.py", "ring_degre=2", f"hydra.run.dir={tmp_path}", env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "ConfigCompositionException" in proc.stderr


# ---- preemption ---------------------------------------------------------------------------------------------------

PREEMPT = [*TINY, "trainer.max_steps=6", "callbacks.model_checkpoint.every_n_train_steps=2",
           "+callbacks.slow._target_=tests.faults.SlowSteps", "+callbacks.slow.seconds=0.3"]


def preempt(run_dir: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, list[int]]:
    """Start train.py, send SIGTERM to the launching process once step 2 is saved."""
    env = {**os.environ, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": ""}
    proc = subprocess.Popen([sys.executable, "train.py", *PREEMPT, *overrides, f"hydra.run.dir={run_dir}"], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoints" / "step_0000002.ckpt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run to preempt ended early"
        time.sleep(0.05)
    ranks = children_of(proc.pid)
    os.kill(proc.pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, output, output), ranks


def test_sigterm_stops_with_a_checkpoint_and_resumes_on_the_same_curve(tmp_path):
    """One process (in this one): SIGTERM after step 2 writes that step's checkpoint, exits 143 with the line that
    says how to resume, and the resumed run continues on the uninterrupted run's loss curve."""
    from ringdit.checkpoints.loading import safe_torch_load

    proc, _ = in_process("train.py", *PREEMPT[:-2], "+callbacks.term._target_=tests.faults.SignalAtStep",
                         "+callbacks.term.rank=0", "+callbacks.term.step=3", f"hydra.run.dir={tmp_path / 'preempted'}")
    assert proc.returncode == 143, proc.stderr[-3000:]
    last = tmp_path / "preempted" / "checkpoints" / "last.ckpt"
    step = safe_torch_load(last)["global_step"]
    assert step == 3  # the step during which the signal came
    assert f"preempted: SIGTERM stopped every rank at step {step} with checkpoint {last}; resume with " \
           f"ckpt_path=last" in proc.stdout + proc.stderr
    run("train.py", tmp_path / "straight", *PREEMPT[:-2])
    run("train.py", tmp_path / "resumed", *PREEMPT[:-2], f"ckpt_path={last}")
    straight, resumed = logged_losses(tmp_path / "straight"), logged_losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(step, 6))
    for i, loss in resumed.items():
        assert loss == pytest.approx(straight[i], rel=1e-6, abs=1e-7), f"step {i}"


def test_sigterm_to_a_launch_stops_every_rank_together(tmp_path):
    """Lightning's launch of 2 ranks (ring 2), SIGTERM to the launching process (rank 0, as a scheduler sends it):
    both ranks stop at the same step, with its checkpoint, exit code 143, nothing left running. (SIGTERM to the
    other rank alone: the test below.)"""
    from ringdit.checkpoints.loading import safe_torch_load

    start = time.monotonic()
    proc, ranks = preempt(tmp_path, "ring_degree=2", "trainer.strategy.timeout_s=60")
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "preempted: SIGTERM stopped every rank at step" in proc.stderr
    assert 2 <= safe_torch_load(tmp_path / "checkpoints" / "last.ckpt")["global_step"] < 6
    assert len(ranks) == 1
    for pid in ranks:  # the launcher left after the rank it spawned
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert time.monotonic() - start < 240


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigterm_to_one_rank_stops_every_rank_at_its_step(strategy, tmp_path):
    """Ring 2, SIGTERM to rank 1 alone after step 3: every rank stops at that step with its checkpoint (FSDP: each
    rank writes its shards, a sharded folder), exit code 143. (The ranks forked as torchrun starts them; Lightning's
    own launch is the test above.)"""
    from ringdit.checkpoints.location import SHARDED_METADATA, is_sharded_checkpoint
    from ringdit.checkpoints.loading import safe_torch_load
    from tests.distributed import run_command_ranks

    proc = run_command_ranks("train.py", (f"hydra.run.dir={tmp_path}", *PREEMPT[:-2], "ring_degree=2",
                                          f"trainer/strategy={strategy}", "trainer.strategy.timeout_s=60",
                                          "+callbacks.term._target_=tests.faults.SignalAtStep", "+callbacks.term.rank=1",
                                          "+callbacks.term.step=3"), 2, {"WANDB_MODE": "offline"}, timeout=240)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "preempted: SIGTERM stopped every rank at step 3" in proc.stdout + proc.stderr
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert is_sharded_checkpoint(last) == (strategy == "fsdp")  # FSDP: each rank wrote its shards of that step
    assert safe_torch_load(last / SHARDED_METADATA if strategy == "fsdp" else last)["global_step"] == 3


# ---- an error in a callback does not cost the step's checkpoint -------------------------------------------------------


class RaiseAtStepEnd(L.Callback):
    """Raise in ``on_train_batch_end`` of optimizer step ``step`` (as a failing preview grid would)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"injected callback error at step {self.step}")


def test_a_failing_callback_keeps_the_checkpoint_of_its_step(tmp_path):
    from ringdit.checkpoints.loading import safe_torch_load

    proc, _ = in_process("train.py", *TINY, "trainer.max_steps=6", "callbacks.model_checkpoint.every_n_train_steps=3",
                         "+callbacks.fail._target_=tests.test_launch.RaiseAtStepEnd", "+callbacks.fail.step=3",
                         f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0 and "injected callback error at step 3" in proc.stderr, proc.stderr[-3000:]
    assert safe_torch_load(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 3
    assert safe_torch_load(tmp_path / "checkpoints" / "step_0000003.ckpt")["global_step"] == 3


# ---- launches whose other ranks never come ------------------------------------------------------------------------

CLUSTER_VARIABLES = ("TORCHELASTIC_RUN_ID", "RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "SLURM_NTASKS", "LSB_JOBID",
                     "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "KUBERNETES_PORT", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK",
                     "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize(
    ("overrides", "environment", "message"),
    [
        (["trainer.num_nodes=2"], {}, r"trainer.num_nodes=2 but no cluster launcher started this process .* "
                                      r"on one machine use trainer.num_nodes=1 and trainer.devices"),
        (["ring_degree=2"], {"LOCAL_RANK": "0"}, r"LOCAL_RANK=0 is set in the environment but no launcher started "
                                                 r"this process .* wait for 2 ranks that never come; unset LOCAL_RANK"),
    ],
)
def test_launch_that_would_wait_for_ever_is_refused(overrides, environment, message, tmp_path, capsys, monkeypatch):
    import train

    for name in CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    line = refused(train.prepare, compose_run("train", overrides, tmp_path), capsys)
    assert re.search(message, line), line


def test_ranks_that_never_come_end_the_launch_after_the_rendezvous_timeout(tmp_path):
    """What cannot be told before spawning (this looks like one rank of a hand-made 2-process launch) is bounded."""
    port = 29581
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARIABLES}
    env.update(LOCAL_RANK="0", NODE_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WANDB_MODE="offline")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "train.py", *TINY, "ring_degree=2",
                           "trainer.strategy.rendezvous_timeout_s=3", f"hydra.run.dir={tmp_path}"], cwd=REPO,
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert re.search(r"Error: rank 0 waited 3 s for all 2 ranks \(trainer.num_nodes=1 x 2 per node\) to join at "
                     rf"127.0.0.1:{port}, and some never came", proc.stderr), proc.stderr[-3000:]
    assert time.monotonic() - start < 120


def test_the_fsdp_strategy_joins_through_the_same_bounded_rendezvous(monkeypatch):
    """RingFSDPStrategy sets up its process group inside SequenceParallelStrategy.setup_environment, the one that
    arms the rendezvous watchdog (launched above with DDP): ranks that never come end an FSDP launch alike."""
    from ringdit.parallel.layout import Layout
    from ringdit.training.fsdp import RingFSDPStrategy
    from ringdit.training.parallel_strategy import SequenceParallelStrategy

    class Joined(Exception):
        pass

    def bounded_rendezvous(self):
        raise Joined  # where the watchdog is armed and the process group created

    monkeypatch.setattr(SequenceParallelStrategy, "setup_environment", bounded_rendezvous)
    with pytest.raises(Joined):
        RingFSDPStrategy(layout=Layout(ring_degree=2, strategy="fsdp")).setup_environment()


# ---- wandb ----------------------------------------------------------------------------------------------------------


def no_wandb_credentials(monkeypatch, home: Path) -> None:
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / ".netrc"))


def test_wandb_online_without_an_api_key_is_refused(tmp_path, capsys, monkeypatch):
    import train

    no_wandb_credentials(monkeypatch, tmp_path)
    line = refused(train.prepare, compose_run("train", ["logger=wandb", "logger.wandb.mode=online"], tmp_path), capsys)
    assert "logger.wandb.mode=online needs a W&B API key for https://api.wandb.ai: set WANDB_API_KEY or run " \
           "`wandb login`" in line


def test_wandb_online_without_a_server_logs_offline_quickly(tmp_path, monkeypatch, caplog):
    import socket

    from ringdit.training.loggers import wandb_logger

    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    no_wandb_credentials(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_API_KEY", "0123456789" * 4)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    start = time.monotonic()
    logger = wandb_logger(str(tmp_path), mode="online")
    assert time.monotonic() - start < 10
    assert logger._offline
    assert f"wandb: cannot reach http://127.0.0.1:{port}; logging offline to {tmp_path}/wandb" in caplog.text


# ---- sampling on data-parallel ranks --------------------------------------------------------------------------------


def test_odd_sample_count_on_two_data_parallel_ranks(tiny_checkpoint, tmp_path):
    """Prediction gives the ranks 2 and 1 samples; gathering pads to equal counts and drops the padding."""
    import numpy as np

    run("infer.py", tmp_path, f"ckpt_path={tiny_checkpoint}", "dp_degree=2", "num_samples=3",
        "diffusion.sampling.steps=2",
        "trainer.strategy.timeout_s=60")
    written = np.load(tmp_path / "samples.npz")
    assert written["images"].shape == (3, 8, 8, 1) and written["labels"].tolist() == [0, 1, 2]


# ---- memory estimate ------------------------------------------------------------------------------------------------


# The estimate's terms, the warning's hint and the plan command: tests/test_memory.py.


def test_a_sequence_too_long_for_memory_is_reported_before_training(tmp_path, caplog):
    """Videos of 512 x 512 frames: 262144 tokens per sample, hundreds of GiB: train.py's checks (``prepare``, which
    runs before any rank or step) warn, naming the tokens per rank."""
    with caplog.at_level("WARNING", logger="ringdit"):
        prepare_train(["data=moving_digits", "model=dit_video", "data.canvas=512", "logger=none"], tmp_path)
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory:")]
    assert len(warnings) == 1, caplog.text[-3000:]
    assert re.search(r"memory: about \d+\.\d GiB per rank needed \(262144 tokens per rank", warnings[0]), warnings[0]
    assert not (tmp_path / "checkpoints").exists()
