"""Preemption beyond training: SIGTERM during ``infer.py`` (one rank, ring 2, data-parallel ranks with unequal
batches) and during ``python -m ringdit.prepare`` under torchrun stops every rank within seconds, keeps what is
finished, exits 143 and leaves no process behind; SIGTERM before the first step or during the final write loses
nothing already written."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from tests.helpers import REPO, TEXT_LEN, TINY, children_of, fail_fast, run, write_latents

STOP_SECONDS = 20  # SIGTERM to exit; measured 1.5-4.5 s on 2 loaded cores (the rest is processes shutting down)


# ---- faults for the runs (Hydra targets: +callbacks.NAME._target_=tests.test_preemption....) -------------------------


class SlowSampling(L.Callback):
    """Sleep ``seconds`` before every model forward (sampler step) while sampling, and mark each finished batch on
    rank 0 (``batches/<i>`` in ``output_dir``), so a test can signal a run between two known points."""

    def __init__(self, seconds: float, output_dir: str):
        self.seconds, self.marks = seconds, Path(output_dir) / "batches"

    def on_predict_start(self, trainer, pl_module) -> None:
        pl_module.model.register_forward_pre_hook(lambda module, args: time.sleep(self.seconds))

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.is_global_zero:
            self.marks.mkdir(parents=True, exist_ok=True)
            (self.marks / str(batch_idx)).touch()


class SignalOnRank(L.Callback):
    """Signal ``sig`` (a signal name: SIGTERM, SIGKILL) to this process on global rank ``rank`` once the file
    ``when`` exists (``SlowSampling``'s mark of rank 0's first batch), from a thread: whatever the rank is doing then
    (sampling, or done and waiting for the others), as a scheduler's signal would come. The time it was sent is
    written to ``when`` + ".signalled"."""

    def __init__(self, rank: int, sig: str, when: str):
        self.rank, self.sig, self.when = rank, getattr(signal, sig), Path(when)

    def on_predict_start(self, trainer, pl_module) -> None:
        if trainer.global_rank != self.rank:
            return

        def signal_when_marked() -> None:
            deadline = time.monotonic() + 120
            while not self.when.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            Path(f"{self.when}.signalled").write_text(str(time.time()))
            os.kill(os.getpid(), self.sig)

        threading.Thread(target=signal_when_marked, daemon=True).start()


def raise_sigterm() -> None:
    """A real SIGTERM to this process -- only while the preemption handler has it (else it would end pytest)."""
    from ringdit.commands import preemption

    assert signal.getsignal(signal.SIGTERM) is preemption._on_sigterm, "SIGTERM is not handled here"
    signal.raise_signal(signal.SIGTERM)


class SigtermAt(L.Callback):
    """SIGTERM to this process when sampling starts (``start``: before the first step), after the first batch
    (``first_batch``), after the last sampler step (``last_step``), or in the middle of writing samples.npz
    (``write``)."""

    def __init__(self, at: str):
        self.at, self.savez = at, np.savez_compressed

    def on_predict_start(self, trainer, pl_module) -> None:
        if self.at == "start":
            raise_sigterm()
        elif self.at == "write":  # the next savez_compressed call (SampleWriter's) gets the signal first

            def signal_then_write(*args, **kwargs):
                np.savez_compressed = self.savez
                raise_sigterm()
                self.savez(*args, **kwargs)

            np.savez_compressed = signal_then_write

    def teardown(self, trainer, pl_module, stage) -> None:
        np.savez_compressed = self.savez

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        last = batch_idx + 1 == trainer.num_predict_batches[dataloader_idx]
        if (self.at == "last_step" and last) or (self.at == "first_batch" and batch_idx == 0):
            raise_sigterm()


# ---- helpers --------------------------------------------------------------------------------------------------------


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie: ended
    except OSError:
        return True


def signal_when(command: list[str], ready, target: str = "launcher", env: dict | None = None,
                timeout: float = 240, sig: int = signal.SIGTERM) -> tuple[subprocess.CompletedProcess, float, list[int]]:
    """Start ``command``; once ``ready()``, send ``sig`` (SIGTERM) to the launching process (``launcher``) or its
    first child (``child``): (the finished process, seconds from the signal to its exit, its children then)."""
    environment = {**os.environ, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "", "HF_HUB_OFFLINE": "1", **(env or {})}
    proc = subprocess.Popen(command, cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run to signal ended or stalled first:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    children = children_of(proc.pid)
    os.kill(proc.pid if target == "launcher" else children[0], sig)
    start = time.monotonic()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *children]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        pytest.fail(f"no exit 120 s after signal {sig}:\n{proc.communicate()[0][-3000:]}")
    seconds = time.monotonic() - start
    output = proc.stdout.read()
    return subprocess.CompletedProcess(command, proc.returncode, output, output), seconds, children


# ---- infer.py -------------------------------------------------------------------------------------------------------


def sample_under_sigterm(run_dir: Path, checkpoint: Path, *overrides: str, batch_size: int, num_samples: int):
    """infer.py with 20 slow steps per batch, its launching process signalled once rank 0 has finished its first
    batch."""
    command = [sys.executable, "infer.py", f"hydra.run.dir={run_dir}", f"ckpt_path={checkpoint}", "trainer=cpu",
               "diffusion.sampling.steps=20", f"batch_size={batch_size}", f"num_samples={num_samples}",
               "trainer.strategy.timeout_s=60",
               "+callbacks.slow._target_=tests.test_preemption.SlowSampling", "+callbacks.slow.seconds=0.1",
               f"+callbacks.slow.output_dir={run_dir}", *overrides]
    proc, seconds, ranks = signal_when(command, lambda: (run_dir / "batches" / "0").exists())
    assert proc.returncode == 143, proc.stdout[-3000:]
    assert seconds < STOP_SECONDS, f"{seconds:.1f} s from SIGTERM to exit"
    assert all(gone(pid) for pid in ranks), "a rank was left behind"
    finished = len(list((run_dir / "batches").iterdir()))  # whole batches rank 0 had when every rank stopped
    samples = np.load(run_dir / "samples.npz")
    assert 0 < len(samples["images"]) < num_samples
    return proc, samples, finished, seconds


def test_sigterm_stops_ring2_sampling_and_keeps_the_finished_batches(tiny_checkpoint, tmp_path):
    """The launching process gets SIGTERM; the rank it spawned (its ring partner) stops at the same sampler step."""
    proc, samples, finished, seconds = sample_under_sigterm(tmp_path, tiny_checkpoint, "ring_degree=2", batch_size=2,
                                                            num_samples=8)
    kept = 2 * finished
    assert samples["images"].shape == (kept, 8, 8, 1) and samples["labels"].tolist() == list(range(kept))
    assert (tmp_path / "samples.png").exists() and not list(tmp_path.glob(".*.tmp"))
    assert (f"preempted: SIGTERM stopped sampling on every rank; wrote {kept} of 8 samples (the finished batches) to "
            f"{tmp_path / 'samples.png'} and {tmp_path / 'samples.npz'}") in proc.stdout, proc.stdout[-3000:]
    assert "exit code 143" in proc.stdout and "Traceback" not in proc.stdout


KILLED_SECONDS = 60  # one rank SIGKILLed (no handler runs) to every other process gone


def forked_sampling(run_dir: Path, checkpoint: Path, *overrides: str, sig: str, batch_size: int, num_samples: int):
    """infer.py on 2 ranks forked as torchrun starts them, 20 slow steps per batch; rank 1 gets ``sig`` once rank 0
    has finished its first batch: (the run's report, seconds from the signal to the end of every rank)."""
    from tests.distributed import run_command_ranks

    mark = run_dir / "batches" / "0"
    overrides = (f"hydra.run.dir={run_dir}", f"ckpt_path={checkpoint}", "trainer=cpu", "diffusion.sampling.steps=20",
                 f"batch_size={batch_size}", f"num_samples={num_samples}", "trainer.strategy.timeout_s=60",
                 "+callbacks.slow._target_=tests.test_preemption.SlowSampling", "+callbacks.slow.seconds=0.1",
                 f"+callbacks.slow.output_dir={run_dir}", "+callbacks.signal._target_=tests.test_preemption.SignalOnRank",
                 "+callbacks.signal.rank=1", f"+callbacks.signal.sig={sig}", f"+callbacks.signal.when={mark}",
                 *overrides)
    proc = run_command_ranks("infer.py", overrides, 2, {"WANDB_MODE": "offline"}, timeout=240)
    signalled = Path(f"{mark}.signalled")
    assert signalled.exists(), f"rank 1 was not signalled:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, time.time() - float(signalled.read_text())


def test_sigkill_of_one_rank_ends_ring2_sampling(tiny_checkpoint, tmp_path):
    """A rank killed outright mid-sampling: its ring partner's next collective fails (the peer's socket closed), the
    run ends non-zero within seconds, and no partial samples.npz is written. (The ranks forked as torchrun starts
    them; Lightning's launch under a signal is the SIGTERM test above.)"""
    proc, seconds = forked_sampling(tmp_path, tiny_checkpoint, "ring_degree=2", sig="SIGKILL", batch_size=2,
                                    num_samples=8)
    assert proc.returncode not in (0, 143), proc.stderr[-3000:]
    assert seconds < KILLED_SECONDS, f"{seconds:.1f} s from SIGKILL to exit"
    assert not (tmp_path / "samples.npz").exists() and not list(tmp_path.glob(".samples*"))


def test_sigterm_to_a_data_parallel_rank_that_is_done_stops_the_other(tiny_checkpoint, tmp_path):
    """3 samples on 2 data-parallel ranks, 1 a batch: rank 1 has one batch, rank 0 two. Rank 1, done and waiting for
    rank 0, gets SIGTERM; rank 0 stops in its second batch; samples 0 (rank 0) and 1 (rank 1) are written."""
    proc, seconds = forked_sampling(tmp_path, tiny_checkpoint, "dp_degree=2", sig="SIGTERM", batch_size=1,
                                    num_samples=3)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 143, output[-3000:]
    assert seconds < STOP_SECONDS, f"{seconds:.1f} s from SIGTERM to exit"
    assert len(list((tmp_path / "batches").glob("[0-9]"))) == 1  # rank 0 had finished one batch, not two
    assert np.load(tmp_path / "samples.npz")["labels"].tolist() == [0, 1]
    assert "wrote 2 of 3 samples (the finished batches)" in output, output[-3000:]


def in_process_infer(checkpoint: Path, run_dir: Path, at: str):
    before = signal.getsignal(signal.SIGTERM)
    proc, _ = fail_fast("infer.py", f"ckpt_path={checkpoint}", "trainer=cpu", "diffusion.sampling.steps=2",
                        "batch_size=2",
                        "num_samples=4", "+callbacks.term._target_=tests.test_preemption.SigtermAt",
                        f"+callbacks.term.at={at}", f"hydra.run.dir={run_dir}")
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back
    return proc, proc.stdout + proc.stderr


def test_sigterm_before_the_first_step_writes_nothing(tiny_checkpoint, tmp_path):
    proc, output = in_process_infer(tiny_checkpoint, tmp_path, "start")
    assert proc.returncode == 143, output[-3000:]
    assert "preempted: SIGTERM stopped sampling; no sample of 4 was finished, nothing written; exit code 143" in output
    assert not list(tmp_path.glob("samples*"))


def test_sigterm_stops_sampling_on_one_rank_and_keeps_what_a_straight_run_draws_first(tiny_checkpoint, tmp_path):
    """SIGTERM after the first of two batches: its samples are written, and they are those an uninterrupted run
    draws first (sample i is the same each run)."""
    proc, output = in_process_infer(tiny_checkpoint, tmp_path / "stopped", "first_batch")
    assert proc.returncode == 143, output[-3000:]
    assert "preempted: SIGTERM stopped sampling; wrote 2 of 4 samples (the finished batches)" in output
    straight = tmp_path / "straight"
    proc, _ = fail_fast("infer.py", f"ckpt_path={tiny_checkpoint}", "trainer=cpu", "diffusion.sampling.steps=2",
                        "batch_size=2", "num_samples=4", f"hydra.run.dir={straight}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    kept, full = np.load(tmp_path / "stopped" / "samples.npz"), np.load(straight / "samples.npz")
    assert np.array_equal(kept["images"], full["images"][:2]) and kept["labels"].tolist() == [0, 1]


def test_sigterm_after_the_last_step_writes_every_sample(tiny_checkpoint, tmp_path):
    proc, output = in_process_infer(tiny_checkpoint, tmp_path, "last_step")
    assert proc.returncode == 143, output[-3000:]
    assert "wrote 4 of 4 samples (the finished batches)" in output
    assert len(np.load(tmp_path / "samples.npz")["images"]) == 4


def test_sigterm_during_the_final_write_finishes_it(tiny_checkpoint, tmp_path):
    """Every sample was drawn: the write completes (samples.npz whole, then the picture) and the run ends as done."""
    proc, output = in_process_infer(tiny_checkpoint, tmp_path, "write")
    assert proc.returncode == 0, output[-3000:]
    assert "SIGTERM came after the last step boundary: the work had finished, nothing was stopped" in output
    assert f"wrote 4 samples to {tmp_path / 'samples.png'}" in output
    assert len(np.load(tmp_path / "samples.npz")["images"]) == 4 and not list(tmp_path.glob(".*.tmp"))


def test_sigterm_during_the_vae_decode_stops_it_and_keeps_the_samples(models, tmp_path, monkeypatch):
    """A latent model with vae=: SIGTERM while rank 0 decodes (no other rank waits) stops there; samples.npz, written
    before, is whole, and the line says how to decode it later."""
    import ringdit.sampling.sampler

    latents = np.random.default_rng(0).standard_normal((40, 4, 8, 8)).astype(np.float32)
    data = write_latents(tmp_path, latents, np.arange(40) % 2)
    run("train.py", tmp_path / "run", *TINY, "trainer.max_steps=1", "data=latents", f"data.path={data}")

    def signal_while_decoding(*args, **kwargs):
        raise_sigterm()
        pytest.fail("SIGTERM did not stop the decode")

    monkeypatch.setattr(ringdit.sampling.sampler, "decode_latents", signal_while_decoding)  # as infer's Sampler calls it
    out = tmp_path / "infer"
    proc, _ = fail_fast("infer.py", f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}", "trainer=cpu",
                        "num_samples=3", "diffusion.sampling.steps=2", f"vae={models['flux']}", f"hydra.run.dir={out}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 143, output[-3000:]
    assert (f"preempted: SIGTERM stopped the VAE decode; every sample is in {out / 'samples.npz'} (decoded files may "
            f"be incomplete); decode them with python -m ringdit.media.decode {out / 'samples.npz'} "
            f"vae={models['flux']}; exit code 143") in output
    assert np.load(out / "samples.npz")["latents"].shape == (3, 4, 8, 8)


# ---- python -m ringdit.prepare --------------------------------------------------------------------------------------

SHARDS = 16  # one image a shard, 256 x 256: about 2 s of encoding per rank here (idle), the window to signal in


@pytest.fixture
def many_images(tmp_path) -> Path:
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(SHARDS):
        Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)).save(folder / f"img{i:03d}.png")
        (folder / f"img{i:03d}.txt").write_text("a red fox")
    return folder


def prepare_settings(images: Path, out: Path, models: dict, **more) -> dict:
    return dict(input=str(images), out=str(out), vae=str(models["flux"]), text_encoder=str(models["flux"]),
                size=more.pop("size", 256), max_text_len=TEXT_LEN, shard_size=1, batch_size=1, **more)


def check_shards(out: Path) -> dict[str, int]:
    """Every shard in ``out`` and every text file beside them (text/) is whole (one sample, readable); no temp file
    is left; name -> mtime. (A shard killed before its text file has stale text: a re-run encodes it.)"""
    from safetensors import safe_open

    assert not [p.name for p in out.iterdir() if not p.name.startswith("shard-") and p.name != "text"]  # no .tmp
    stamps = {}
    for path in sorted(out.glob("shard-*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            assert f.get_slice("latents").get_shape()[0] == 1, path
        stamps[path.name] = path.stat().st_mtime_ns
    if (out / "text").is_dir():
        assert all(p.name.startswith("shard-") and p.name in stamps for p in (out / "text").iterdir())
        for path in (out / "text").iterdir():
            with safe_open(str(path), framework="pt") as f:
                assert f.get_slice("text").get_shape()[0] == 1, path
    return stamps


# slow: its parts are held by faster tests -- SIGTERM stopping prepare after its shard and a rerun resuming
# (test_sigterm_while_a_shard_is_written_keeps_it, test_sigterm_while_models_load_stops_at_once), torchrun passing
# SIGTERM to every rank (tests/test_launch.py::test_sigterm_to_a_launch_stops_every_rank_together) and two prepare
# ranks resuming to a straight run's shards (test_a_rank_killed_while_preparing_leaves_whole_shards_and_the_other_finishes)
@pytest.mark.slow
def test_sigterm_stops_prepare_under_torchrun_and_a_rerun_resumes(models, many_images, tmp_path):
    """SIGTERM to torchrun, which passes it to both ranks: each stops after its shard with one line and 143, and the
    same command again resumes. (SIGTERM to one rank alone is that rank's half of this, plus torchrun stopping the
    other after a rank failed: the SIGKILL test below.)"""
    from ringdit.media.encode_folder import encode_folder

    out = tmp_path / "out"
    settings = prepare_settings(many_images, out, models)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "ringdit.prepare", *(f"{key}={value}" for key, value in settings.items())]
    # signalled once both ranks encode (a shard of each: rank r writes shards i % 2 == r), not while one still loads
    # its models: a rank signalled then stops only after loading, by when a busy machine's other rank may be done
    proc, seconds, ranks = signal_when(command, lambda: both_ranks_wrote_a_shard(out))
    assert proc.returncode != 0  # torchrun's own code for "a rank failed" or "I was signalled": 1
    assert seconds < STOP_SECONDS, f"{seconds:.1f} s from SIGTERM to exit"
    assert all(gone(pid) for pid in ranks), "a rank was left behind"
    stopped = [line for line in proc.stdout.replace("\r", "\n").splitlines()
               if "preempted: SIGTERM stopped preparing" in line]
    kept = check_shards(out)
    assert 0 < len(kept) < SHARDS
    # every rank still encoding when signalled stops; on a loaded machine one rank may have written its whole share
    # before the other's first shard appeared (the signal's cue), and ends as done instead
    working = len({i % 2 for i in range(SHARDS) if f"shard-{i:05d}.safetensors" not in kept})
    assert working >= 1 and len(stopped) == working, proc.stdout[-3000:]
    assert all(line.endswith("exit code 143") for line in stopped), proc.stdout[-3000:]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun's ranks (OMP_NUM_THREADS=1); two threads on two busy cores: 25x slower
    try:
        for rank in (0, 1):  # the same command again (each rank in turn): only the missing shards are encoded
            report = encode_folder(**settings, rank=rank, world_size=2, progress=False)
            assert report.shards_skipped == sum(int(name[6:11]) % 2 == rank for name in kept)
        after = check_shards(out)
        assert len(after) == SHARDS and all(after[name] == stamp for name, stamp in kept.items())
        # the interrupted and resumed shards are exactly an uninterrupted run's: a quarter of that run (every fourth
        # shard, as rank r of 4 prepares them), one that holds a shard written before the stop and one after
        resumed, world = sorted(set(after) - set(kept)), 4

        def holds(rank: int, names) -> bool:
            return any(int(name[6:11]) % world == rank for name in names)

        rank = next((r for r in range(world) if holds(r, kept) and holds(r, resumed)), int(resumed[0][6:11]) % world)
        straight = tmp_path / "straight"
        encode_folder(**{**settings, "out": str(straight)}, rank=rank, world_size=world, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert_same_shards(out, straight)


def test_a_rank_killed_while_preparing_leaves_whole_shards_and_the_other_finishes(models, many_images, tmp_path):
    """2 prepare ranks (forked as torchrun starts them), rank 1 SIGKILLed once both have written a shard: rank 0 does
    not wait for it and finishes its share; every shard written is whole (atomic writes), so a rerun resumes from
    them. (Under torchrun its agent then stops the other ranks; torchrun starting prepare and passing SIGTERM on is
    the test above.)"""
    from tests.distributed import run_command_ranks

    out = tmp_path / "out"
    settings = prepare_settings(many_images, out, models)

    def kill_rank_1(pids: list[int]) -> None:
        deadline = time.monotonic() + 120
        while not both_ranks_wrote_a_shard(out):
            assert time.monotonic() < deadline, "the ranks wrote no shard each"
            time.sleep(0.02)
        os.kill(pids[1], signal.SIGKILL)

    proc = run_command_ranks("-m ringdit.prepare", tuple(f"{key}={value}" for key, value in settings.items()), 2,
                             {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, timeout=240, while_running=kill_rank_1)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]  # rank 1's: rank 0 ended by itself, with 0
    assert "rank 0 ended without a report" not in proc.stderr, proc.stderr[-3000:]
    kept = check_shards(out)
    assert {f"shard-{i:05d}.safetensors" for i in range(0, SHARDS, 2)} <= set(kept)  # rank 0's share, all of it
    assert 0 < sum(int(name[6:11]) % 2 for name in kept) < SHARDS // 2  # rank 1's: some, not all


def both_ranks_wrote_a_shard(out: Path) -> bool:
    """Whether each of 2 prepare ranks has written a shard in ``out`` (rank r writes the shards i with i % 2 == r),
    its text file included (written right after the latents: a kill between the two would catch the text mid-write,
    its temporary file left for the next write to remove)."""
    return {int(path.name[6:11]) % 2 for path in (out / "text").glob("shard-*")} == {0, 1}


def assert_same_shards(got: Path, expected: Path) -> None:
    from safetensors import safe_open

    names = sorted(p.name for p in expected.glob("shard-*.safetensors"))  # a share of the shards: ``got`` has more
    assert names and set(names) <= {p.name for p in got.glob("shard-*.safetensors")}
    for name in [*names, *(f"text/{name}" for name in names)]:  # the latents, and the text files beside them
        with safe_open(str(got / name), framework="pt") as a, safe_open(str(expected / name), framework="pt") as b:
            assert a.metadata() == b.metadata(), name
            assert sorted(a.keys()) == sorted(b.keys()), name
            for key in b.keys():  # same kernels (one thread each, batch 1): the same bits
                assert torch.equal(a.get_tensor(key), b.get_tensor(key)), f"{name} {key}"


def test_sigterm_while_a_shard_is_written_keeps_it(models, many_images, tmp_path, monkeypatch, caplog):
    """In this process: SIGTERM in the middle of writing the first shard; the shard is finished, then the run stops."""
    import ringdit.media.encode_shards as media  # the module whose shard loop writes and loads the VAE
    from ringdit.prepare import main

    write = media.save_tensors

    def signal_while_writing(*args, **kwargs):  # its latents; its text file follows, both before the stop
        raise_sigterm()
        return write(*args, **kwargs)

    monkeypatch.setattr(media, "save_tensors", signal_while_writing)
    out = tmp_path / "out"
    settings = prepare_settings(many_images, out, models, size=16)
    with pytest.raises(SystemExit) as stop:
        main([f"{key}={value}" for key, value in settings.items()])
    assert stop.value.code == 143
    assert list(check_shards(out)) == ["shard-00000.safetensors"]
    assert (f"preempted: SIGTERM stopped preparing; 1 complete shards in {out} (of every rank); run the same "
            f"command again to resume; exit code 143") in caplog.text


def test_sigterm_while_models_load_stops_at_once(models, many_images, tmp_path, monkeypatch, caplog):
    """In this process: SIGTERM while the VAE loads stops there (nothing to finish first); nothing is written."""
    import ringdit.media.encode_shards as media  # the module whose shard loop writes and loads the VAE
    from ringdit.prepare import main

    vae = media.VAE

    def signal_while_loading(*args, **kwargs):
        raise_sigterm()
        pytest.fail("SIGTERM did not stop the model loading")
        return vae(*args, **kwargs)

    monkeypatch.setattr(media, "VAE", signal_while_loading)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        main([f"{key}={value}" for key, value in prepare_settings(many_images, out, models, size=16).items()])
    assert stop.value.code == 143
    assert not out.exists() or not list(out.iterdir())
    assert "preempted: SIGTERM stopped preparing; 0 complete shards in" in caplog.text


def test_a_run_in_this_process_leaves_no_launcher_mark(monkeypatch):
    """A run's launcher mark lives while the run does: a train.py this process starts afterwards (a notebook after
    ``ringdit.train``, a test after an in-process run) launches ranks of its own -- with the mark left behind it took
    itself for a spawned rank, skipped the launcher's checks and exited 0 instead of 143 on SIGTERM."""
    from ringdit.commands.launcher import LAUNCHER_PID
    from ringdit.commands.preemption import stop_on_sigterm

    monkeypatch.delenv(LAUNCHER_PID, raising=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with stop_on_sigterm(trainer):
        assert os.environ[LAUNCHER_PID] == str(os.getpid())  # the ranks it spawns now inherit it
    assert LAUNCHER_PID not in os.environ
    child = subprocess.run([sys.executable, "-c", "from ringdit.commands.launcher import spawned_by_launcher as s; "
                            "print(s())"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == "False", child.stderr[-2000:]
