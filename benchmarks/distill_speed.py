"""How much faster a distilled student samples than its teacher: the seconds of the sampling itself (one batch,
after a warm-up batch; no start-up, no writing), for each checkpoint and sampler given, in this process, with the
threads torch has (``OMP_NUM_THREADS``). Text models sample the prompts given (cycled to ``--samples``).

    OMP_NUM_THREADS=1 python benchmarks/distill_speed.py --samples 100 \\
        --run "teacher euler 30" <teacher.ckpt> diffusion.sampling.sampler=euler diffusion.sampling.steps=30 \\
        --run "student 4 steps" <student.ckpt> \\
        --prompts "[a 0 moving left,a 1 moving left]"
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import ringdit  # noqa: E402
from ringdit.commands.sample import prepare  # noqa: E402


def seconds_to_sample(checkpoint: str, overrides: list[str], samples: int, prompts: str | None,
                      repeats: int) -> tuple[float, int]:
    """(the fastest of ``repeats`` timed samplings of ``samples`` in one batch, the model evaluations per sample:
    guidance's two halves, batched together, count two)."""
    given = [f"prompts={prompts}"] if prompts else []
    with tempfile.TemporaryDirectory() as folder:
        cfg = ringdit.config("infer", [f"ckpt_path={checkpoint}", f"num_samples={samples}", f"batch_size={samples}",
                                       *given, *overrides], run_dir=folder)
        _, module, requests, _ = prepare(cfg)
        module.configure_model()
        module.eval()
        module.on_predict_start()  # its Sampler, on the CPU
        _, condition, seeds, *_ = next(iter(requests))
        evaluations = 0
        model = module.model

        def count(module, args):
            nonlocal evaluations
            evaluations += args[0].shape[0]  # the samples in this forward (x: (B, C, [T,] H, W))

        hook = model.register_forward_pre_hook(count)
        best = float("inf")
        with torch.no_grad():
            for attempt in range(repeats + 1):  # the first: a warm-up (allocations, lazy initialisation)
                evaluations = 0
                start = time.perf_counter()
                module.sampler.generate(condition, seeds.tolist())  # its negative prompt, as infer.py's
                if attempt:
                    best = min(best, time.perf_counter() - start)
        hook.remove()
        return best, evaluations // samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", nargs="+", action="append", required=True, metavar=("NAME CKPT", "OVERRIDE"),
                        help="a name, a checkpoint and infer.py overrides (its sampler settings)")
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--prompts", default=None, help="text models: infer.py's prompts=[...]")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results = []
    for name, checkpoint, *overrides in args.run:
        seconds, evaluations = seconds_to_sample(checkpoint, overrides, args.samples, args.prompts, args.repeats)
        results.append((name, seconds, evaluations))
        print(f"{name}: {seconds:.2f} s for {args.samples} samples ({evaluations} model evaluations a sample)",
              flush=True)
    slowest = max(seconds for _, seconds, _ in results)
    for name, seconds, _ in results:
        print(f"  {name}: {slowest / seconds:.1f}x the slowest's speed")


if __name__ == "__main__":
    main()
