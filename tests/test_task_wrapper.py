"""The eight commands run in one wrapper (``ringdit.commands.task``): an error in a command's settings phase is one
line and exit code 2, SIGTERM at any point of any of them ends it with one line and exit code 143, and wandb runs
are finished however the work ends. Each command is run in this process as its command line runs it (``in_process``),
its work interrupted by a patched function it calls first; one launch proves the signal from outside."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import lightning as L
import pytest

from tests.helpers import REPO, TINY, in_process

# command line, the function its work calls first (patched: module, name), what a SIGTERM line says it stopped
COMMANDS = {
    "train": (["train.py"], ("ringdit.training.run", "prepare"), "training"),
    "infer": (["infer.py"], ("ringdit.commands.sample", "prepare"), "sampling"),
    "serve": (["-m ringdit.serve"], ("ringdit.serve", "Server"), "serving"),
    "prepare": (["-m ringdit.prepare", "input=in", "out=out", "vae=vae", "text_encoder=te"],
                ("ringdit.media.encode_folder", "encode_folder"), "preparing"),
    "export": (["-m ringdit.export", "ckpt_path=x.ckpt"], ("ringdit.checkpoints.exporting", "write_export"),
               "the export"),
    "plan": (["-m ringdit.plan"], ("ringdit.plan", "settings"), "planning"),
    "decode": (["-m ringdit.media.decode", "samples.npz", "vae=vae"], ("ringdit.common.errors", "require_count"),
               "decoding"),
    "calibrate": (["-m ringdit.caching", "calibrate", "ckpt_path=x.ckpt"],
                  ("ringdit.caching.calibrate", "require_count"), "calibrating"),
}


def run_command(name: str, tmp_path, monkeypatch, then) -> tuple[int, str]:
    """Command ``name`` in this process, its first call replaced by ``then()``: (exit code, its output)."""
    import importlib

    (script, *overrides), (module, function), _ = COMMANDS[name]
    monkeypatch.setattr(importlib.import_module(module), function, lambda *args, **kwargs: then())
    run_dir = [f"hydra.run.dir={tmp_path / 'run'}"] if name in ("train", "infer", "serve") else []
    before = signal.getsignal(signal.SIGTERM)
    try:
        proc, _ = in_process(script, *overrides, *run_dir)
        # the handler is put back (prepare's module, run as __main__, puts its own in place while it loads)
        assert signal.getsignal(signal.SIGTERM) is before or name == "prepare"
    finally:
        signal.signal(signal.SIGTERM, before)
    return proc.returncode, proc.stdout + proc.stderr


def sigterm() -> None:
    """A real SIGTERM to this process -- only while the wrapper handles it (else it would end pytest)."""
    assert callable(signal.getsignal(signal.SIGTERM)), "SIGTERM is not handled here"
    signal.raise_signal(signal.SIGTERM)
    pytest.fail("SIGTERM did not stop the command")


@pytest.mark.parametrize("name", list(COMMANDS))
def test_sigterm_stops_every_command_with_one_line(name, tmp_path, monkeypatch, caplog):
    """SIGTERM while the command checks its settings (plan, export, decode, calibrate: before, no handler -- the
    process died of the signal, with no line) stops it where it is: exit code 143, the line saying what was kept."""
    code, output = run_command(name, tmp_path, monkeypatch, sigterm)
    output += caplog.text  # the line is logged (a process without logging set up writes it to stderr)
    doing = COMMANDS[name][2]
    assert code == 143, output[-3000:]
    assert f"preempted: SIGTERM stopped {doing}; " in output and output.count("preempted:") == 1, output[-3000:]
    assert "exit code 143" in output and "Traceback" not in output


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_settings_error_of_every_command_is_one_line(name, tmp_path, monkeypatch):
    def refuse():
        raise ValueError("seed=x: not a number; pass seed=<an integer>")

    code, output = run_command(name, tmp_path, monkeypatch, refuse)
    assert code == 2, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("Error: ")]
    assert errors == ["Error: seed=x: not a number; pass seed=<an integer>"] and "Traceback" not in output


def test_a_fault_keeps_its_traceback(tmp_path, monkeypatch):
    """What is not a settings mistake (here a KeyError in planning) is a fault: its traceback, not one line."""
    def fault():
        raise KeyError("a bug")

    code, output = run_command("plan", tmp_path, monkeypatch, fault)
    assert code == 1 and "Traceback" in output and "KeyError: 'a bug'" in output


def test_sigterm_to_a_launched_export_exits_143_with_its_line(tmp_path):
    """A process of its own (no pytest logging): the signal from outside, the line on stderr, exit code 143."""
    ready = tmp_path / "ready"
    script = (  # the export's writing, replaced by a wait (the module the command imports for it, made up front)
        "import sys, time, types, pathlib\n"
        "fake = types.ModuleType('ringdit.checkpoints.exporting')\n"
        f"fake.write_export = lambda *a, **k: (pathlib.Path({str(ready)!r}).touch(), time.sleep(120))\n"
        "sys.modules['ringdit.checkpoints.exporting'] = fake\n"
        "from ringdit.export import main\n"
        f"sys.exit(main(['ckpt_path=x.ckpt', 'out={tmp_path / 'out.safetensors'}']))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "HYDRA_FULL_ERROR": ""})
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err[-3000:]
    assert err.strip().splitlines() == ["preempted: SIGTERM stopped the export; out= is as it was (it is replaced "
                                        "only once the export is whole); run the same command again; exit code 143"]


class FailAtFirstStep(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        raise RuntimeError("a fault in a callback")


def test_a_failing_training_run_finishes_its_wandb_run(tmp_path):
    """logger=wandb offline, a fault at the first step: the traceback, and the wandb run finished (its files
    complete for ``wandb sync``; the next run in this process gets its own)."""
    import wandb

    proc, _ = in_process("train.py", f"hydra.run.dir={tmp_path}", *TINY, "logger=wandb", "trainer.max_steps=2",
                         "+callbacks.fail._target_=tests.test_task_wrapper.FailAtFirstStep",
                         env={"WANDB_API_KEY": "", "WANDB_MODE": ""})
    assert proc.returncode == 1 and "a fault in a callback" in proc.stderr, proc.stderr[-3000:]
    assert wandb.run is None, "the failed run's wandb run is still open"
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_a_sampling_run_whose_logging_fails_finishes_its_wandb_run(tiny_checkpoint, tmp_path, monkeypatch):
    """infer.py logger=wandb: its samples are logged to a wandb run made after sampling; when logging them fails,
    the wrapper still finishes that run (before, only a run that logged everything was finished)."""
    import wandb

    import ringdit.commands.sample

    def fail(*args, **kwargs):
        raise RuntimeError("a fault while logging")

    monkeypatch.setattr(ringdit.commands.sample, "log_samples", fail)
    proc, _ = in_process("infer.py", f"ckpt_path={tiny_checkpoint}", "trainer=cpu", "diffusion.sampling.steps=2",
                         "num_samples=2", "logger=wandb", f"hydra.run.dir={tmp_path}",
                         env={"WANDB_API_KEY": "", "WANDB_MODE": ""})
    assert proc.returncode == 1 and "a fault while logging" in proc.stderr, proc.stderr[-3000:]
    assert wandb.run is None, "the wandb run is still open"
    assert (tmp_path / "samples.npz").exists()
