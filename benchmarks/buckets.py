"""Training throughput on a mixed-bucket set vs a single-bucket set of the same total tokens, ring 2 on CPU ranks,
and how often compile=true recompiles when every step's token count changes.

    python benchmarks/buckets.py                 # eager, then --compile's recompile count (a few minutes)
    python benchmarks/buckets.py --no-compile    # the throughput table only

Both sets are procedural text latents (data=synthetic_text_latents) for a Wan-shaped transformer, widened so that
compute, not Python, dominates a step. The mixed set has three buckets -- two aspect ratios and two frame counts --
whose token counts divide neither 2 nor 4 (the ring pads each step's tail differently); the single set has one
bucket and as many samples as hold the same tokens. Both runs train the same number of steps with the same batch
size; throughput is the logged tokens per second over the timed steps (after --warmup), i.e. total tokens / total
step time. Run on an idle machine: the two runs are measured back to back, in one invocation.

The compile table counts TORCH_LOGS=recompiles lines of both ranks: all of them, those a tensor size change caused,
how many graphs (a rank's compiled frames: the block, the attention processor, the pieces between graph breaks)
those hit, and the most any one graph recompiled for a size. With automatic dynamic shapes a graph recompiles once,
at the first length it was not compiled for, with the length symbolic; later lengths reuse it.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = ["model.config.num_attention_heads=4", "model.config.attention_head_dim=32", "model.config.ffn_dim=512",
         "model.config.num_layers=2", "model.config.rope_max_seq_len=64"]
# two aspect ratios, two frame counts, three token counts (455, 455, 567, 585), none divisible by 2
MIXED = ["data.buckets=[[5,14,26],[5,26,14],[9,14,18],[9,10,26]]", "data.bucket_samples=[40,40,40,40]"]
SINGLE = ["data.buckets=[[5,14,26]]", "data.bucket_samples=[181]"]  # 181 x 455 = 82,355 ~ 40 x (2 x 455 + 567 + 585)


def train(run_dir: Path, data_dir: Path, args, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", "experiment=wan_tiny", *MODEL,
               f"data.cache_dir={data_dir}", f"data.batch_size={args.batch_size}", f"trainer.max_steps={args.steps}",
               "ring_degree=2", "logger=csv", "callbacks.model_checkpoint.every_n_train_steps=100000",
               "callbacks.sample_grid.every_n_steps=100000", "scheduler=constant",
               "optimizer=sgd", "optimizer.lr=0.01", "data.val_fraction=0",
               *overrides]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", **(env or {})})
    if proc.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{proc.stderr[-4000:]}")
    return proc


def throughput(run_dir: Path, warmup: int, samples: int) -> tuple[float, Counter]:
    """(tokens per second over the steps after ``warmup``: their tokens / their time, steps per sample token count);
    ``samples`` per step (the global batch)."""
    with open(run_dir / "csv" / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("train/tokens_per_sec") and int(row["step"]) >= warmup]
    seconds = [samples / float(row["train/samples_per_sec"]) for row in rows]
    tokens = [samples * float(row["train/sample_tokens"]) for row in rows]
    return sum(tokens) / sum(seconds), Counter(int(float(row["train/sample_tokens"])) for row in rows)


def recompiles(stderr: str) -> tuple[int, int, int, int]:
    """From a TORCH_LOGS=recompiles log: (recompilations, those a tensor size change caused, the graphs -- a rank's
    compiled frames -- they hit, the most any one graph recompiled for a size)."""
    lines = stderr.splitlines()
    total, sized = 0, Counter()
    for i, line in enumerate(lines):
        if "Recompiling function" not in line:
            continue
        total += 1
        reasons = " ".join(lines[i + 1:i + 4])
        rank = line.split("]")[0]
        frame = re.search(r"\[(\d+)/\d+\] \[__recompiles\]", line)
        if "size mismatch" in reasons and frame:
            sized[rank, frame.group(1)] += 1
    return total, sum(sized.values()), len(sized), max(sized.values(), default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps first")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="skip the compile=true recompile count")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rates = {}
        for name, data in (("single bucket", SINGLE), ("mixed buckets", MIXED)):
            train(root / name.replace(" ", "_"), root / "data", args, *data)
            rates[name] = throughput(root / name.replace(" ", "_"), args.warmup, args.batch_size)
        base = rates["single bucket"][0]
        print(f"Wan-shaped transformer (4 x 32 heads, 2 layers), ring 2 on 2 CPU ranks, batch {args.batch_size}, "
              f"{args.steps - args.warmup} timed steps after {args.warmup}")
        print("| data | tokens per sample (steps) | tokens/s | vs single bucket |")
        print("|---|---|---:|---:|")
        for name, (rate, steps) in rates.items():
            shapes = ", ".join(f"{tokens} ({count})" for tokens, count in sorted(steps.items()))
            print(f"| {name} | {shapes} | {rate:,.0f} | {rate / base:.2f}x |")
        if args.no_compile:
            return
        print()
        print("| compile=true | distinct token counts | recompilations (both ranks) | from a size change | graphs they "
              "hit | most by one graph |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, data in (("single bucket", SINGLE), ("mixed buckets", MIXED)):
            proc = train(root / f"compiled_{name.replace(' ', '_')}", root / "data", args, *data, "compile=true",
                         env={"TORCH_LOGS": "recompiles"})
            _, steps = throughput(root / f"compiled_{name.replace(' ', '_')}", 0, args.batch_size)
            total, sized, graphs, most = recompiles(proc.stderr)
            print(f"| {name} | {len(steps)} | {total} | {sized} | {graphs} | {most} |")


if __name__ == "__main__":
    main()
