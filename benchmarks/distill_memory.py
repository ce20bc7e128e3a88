"""``distill=dmd2``'s peak memory per rank, measured on CPU ranks of real ``train.py`` runs, against
``ringdit.costs``'s estimate (the one train.py warns with and ``python -m ringdit.plan distill=dmd2`` plans with).

    python benchmarks/distill_memory.py                       # every case, about 5 min on 2 idle cores
    python benchmarks/distill_memory.py --cases plain dmd2    # some of them

A DiT (hidden 384, depth 6, 6 heads: 11.2 M parameters) on the digits, batch 64 of 16 tokens, fp32, AdamW, EMA 0.999,
from a teacher written once (the same architecture's seeded weights, a safetensors file: ``init_from``; what the
teacher knows does not change what it holds). Each case is one ``python train.py`` (3 student updates of 2 critic
updates each) whose ranks run a callback (``PeakRSS``, below): at ``setup`` -- the process group exists, the data
is open, no model is built yet (``configure_model`` comes next) -- it takes the rank's RSS as its baseline and resets
its high-water mark (``echo 5 > /proc/self/clear_refs``); at the end of training it writes the high-water mark
(``VmHWM``) above that baseline. That is what the memory estimate models: the models, their EMA, gradients, optimizer
state, DDP's buckets or FSDP's gathers, and the step's activations -- not the libraries, the CUDA context or the
data. glibc's mmap threshold is fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_=131072``, as ``memory_options.py`` does)
so that freed activations leave the RSS; the tables of ``docs/memory.md`` say why.

The estimate is ``ringdit.costs.check_training_memory`` on the same composed config and ``Layout``, as train.py
computes it; its ``peak_bytes`` (start-up or step, whichever is larger) is compared to the measured peak, the largest
over the ranks. ``plain``, the same model and teacher trained without distillation, is the control: the harness
measured against the estimate of one model. ``dmd2_gan`` adds DMD2's GAN head (``distill.gan_loss=true``),
``dmd2_regression`` DMD's regression loss (``distill.regression_loss=true``: 64 teacher pairs, sampled as training
starts).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lightning.pytorch.callbacks import Callback  # noqa: E402

MODEL = ["model.hidden_size=384", "model.depth=6", "model.num_heads=6"]
RUN = ["data.batch_size=64", "trainer.max_steps=3", "trainer=cpu", "+trainer.limit_val_batches=0",
       "trainer.precision=32-true", "callbacks=none", "logger=none", "scheduler=constant", "ema_decay=0.999"]
DMD2 = ["distill=dmd2", "distill.critic_steps=2"]
CASES = {
    "plain": [],                                            # one model (the estimate as before): the control
    "dmd2": DMD2,                                           # DDP, one rank: student, EMA, critic, teacher
    "dmd2_lora": [*DMD2, "lora.rank=16"],                   # the student and critic adapted, the teacher whole
    "dmd2_fsdp": [*DMD2, "trainer/strategy=fsdp", "dp_degree=2"],  # FSDP over 2 ranks: every model sharded
    "dmd2_gan": [*DMD2, "distill.gan_loss=true"],          # DDP with the GAN head: two more critic forwards
    "dmd2_regression": [*DMD2, "distill.regression_loss=true"],  # the student's forward of 64 teacher pairs too
}
GiB, MiB = 2**30, 2**20


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))


class PeakRSS(Callback):
    """Writes ``<out>/rank<r>.json``: this rank's peak RSS above its RSS before the models were built."""

    def __init__(self, out: str):
        self.out, self.baseline = Path(out), 0

    def setup(self, trainer, pl_module, stage) -> None:
        gc.collect()
        self.baseline = rss_bytes()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark starts again from the RSS now

    def on_train_end(self, trainer, pl_module) -> None:
        peak = rss_bytes("VmHWM") - self.baseline
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(
            {"rank": trainer.global_rank, "baseline": self.baseline, "peak": peak}))


def write_teacher(path: Path) -> None:
    """The teacher: this architecture's seeded weights, as the safetensors file ``init_from`` reads."""
    import ringdit
    from safetensors.torch import save_file

    from ringdit.models.build import build_model
    from ringdit.spec import model_config

    cfg = ringdit.config("train", MODEL)
    data = {"channels": 1, "image_size": [8, 8], "num_classes": 10}
    model, _ = build_model(model_config(cfg.model, data), seed=0)
    save_file({key: value.contiguous() for key, value in model.state_dict().items()}, str(path))


def estimate(overrides: list[str], run_dir: Path):
    """``ringdit.costs``'s estimate for ``overrides``, as train.py computes it (``TrainSpec.from_config``)."""
    import ringdit
    from ringdit.costs import check_training_memory
    from ringdit.spec import TrainSpec, build_on_meta

    cfg = ringdit.config("train", overrides, run_dir)
    spec = TrainSpec.from_config(cfg)
    meta = build_on_meta(spec.model.config, spec.layout.ulysses_degree)
    return check_training_memory(cfg, spec.layout, spec.model.config, meta,
                                 largest_step=spec.data.module.largest_step())


def measure(case: str, teacher: Path, work: Path) -> dict:
    run_dir = work / case
    run_dir.mkdir()
    overrides = [*MODEL, *RUN, *CASES[case], f"init_from={teacher}"]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}",
                           "+callbacks.peak_rss._target_=benchmarks.distill_memory.PeakRSS",
                           f"+callbacks.peak_rss.out={run_dir}"], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{case}: train.py exited {proc.returncode}\n{proc.stderr[-3000:]}")
    ranks = [json.loads(path.read_text()) for path in sorted(run_dir.glob("rank*.json"))]
    return {"case": case, "ranks": len(ranks), "peak": max(r["peak"] for r in ranks),
            "estimate": estimate(overrides, work / f"{case}_spec")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        teacher = work / "teacher.safetensors"
        write_teacher(teacher)
        print("DiT hidden 384, depth 6, batch 64 x 16 tokens, fp32, AdamW, EMA; one CPU thread per rank, malloc mmap "
              "128 KiB; MiB per rank (the largest over the ranks)")
        print(f"{'case':<16}{'ranks':>6}{'measured':>10}{'estimate':>10}{'ratio':>7}   estimate's terms "
              f"(weights gradient optimizer ema bucket gathered activation attention | startup)")
        for case in args.cases:
            r = measure(case, teacher, work)
            e = r["estimate"]
            terms = " ".join(f"{e.terms()[t] / MiB:.0f}" for t in e.STEP_TERMS)
            print(f"{case:<16}{r['ranks']:>6}{r['peak'] / MiB:>10.0f}{e.peak_bytes / MiB:>10.0f}"
                  f"{r['peak'] / e.peak_bytes:>7.2f}   {terms} | {e.startup_bytes / MiB:.0f}", flush=True)


if __name__ == "__main__":
    main()
