"""Peak memory of an 80-sample preview of a tiny Wan (fp64, guided, 2 Euler steps), drawn in one batch or in
micro-batches (``ringdit.diffusion.pipeline.in_micro_batches``, ``callbacks.sample_grid.batch_size``): each run in a
fresh process, its peak resident memory (ru_maxrss) above what the process held after building the model and sampling
one sample. The samples are the same (tests/test_preview_batches.py checks it exactly).

    python benchmarks/preview_memory.py            # the table
    python benchmarks/preview_memory.py 4          # one run: micro-batches of 4 (0: one batch)
"""

from __future__ import annotations

import resource
import subprocess
import sys

SAMPLES, SHAPE = 80, (5, 16, 16)  # latent frames, height, width: 320 tokens at Wan's (1, 2, 2) patch


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def one_run(batch: int | None) -> None:
    import torch

    from ringdit.diffusion.objectives import FlowMatching
    from ringdit.diffusion.pipeline import SamplingPipeline, in_micro_batches
    from ringdit.models.diffusers import DiffusersTransformer
    from ringdit.commands.cli import model_preset
    from ringdit.parallel import ParallelDims

    torch.manual_seed(0)
    model = DiffusersTransformer("wan", config=model_preset("wan_tiny")["config"], input_size=SHAPE, in_channels=4, text_len=7,
                                 text_dim=16).double().eval()
    pipeline = SamplingPipeline.for_run(FlowMatching(shift=3.0), {"steps": 2, "cfg_scale": 5.0, "sampler": "euler",
                                                                  "shift": 3.0},
                                        {"image_size": list(SHAPE), "latent_scale": 1.0})
    text = torch.randn(SAMPLES, 7, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def generate(condition, seeds, negative=None):
        return pipeline.generate(model, condition, seeds, dims=ParallelDims(), device="cpu", negative=negative)

    generate({"text": text[:1]}, [0])  # the kernels and allocator warmed up: the baseline
    before = peak_mib()
    in_micro_batches(generate, {"text": text}, list(range(SAMPLES)), batch)
    print(f"{peak_mib() - before:.1f}")


def main() -> None:
    if len(sys.argv) > 1:
        one_run(int(sys.argv[1]) or None)
        return
    print(f"{SAMPLES} samples of {SHAPE} latents (320 tokens), tiny Wan, fp64, guided (2 rows a sample), 2 steps")
    print(f"{'micro-batch':>12} {'rows a forward':>15} {'peak above baseline MiB':>24}")
    for batch in (0, 40, 16, 4, 1):
        mib = subprocess.run([sys.executable, __file__, str(batch)], capture_output=True, text=True, check=True)
        rows = 2 * (batch or SAMPLES)
        print(f"{batch or SAMPLES:>12} {rows:>15} {float(mib.stdout.strip().splitlines()[-1]):>24.1f}")


if __name__ == "__main__":
    main()
