"""Each memory option of issue 41 measured on a CPU rank against ``ringdit.costs``'s estimate, and its step time as a
ratio to the plain run: a Wan-1.3B-shaped transformer (``fsdp_memory.py``'s), LoRA rank 64 unless a full fine-tune.

    python benchmarks/memory_options.py                      # 2 layers, latents (4, 16, 16): 256 tokens, 4 steps
    python benchmarks/memory_options.py --layers 4 --cases plain fp8 ckpt_half

Each case runs in a fresh process (spawned), so its peak RSS is its own. Per case:
- state: this rank's parameter, gradient and optimizer-state tensor bytes (an 8-bit state counted as its codes,
  scales and map), against the estimate's weights + gradients + optimizer terms;
- acts: the peak of live tensors (``tensor_memory.PeakTensorMemory``) during forward and backward above what lived
  before, against the estimate's activations + attention; below the table, the live tensors at the end of forward:
  what the blocks keep for backward (``--layers`` N and N + 1 differ by one block's);
- RSS: the process's peak RSS minus its RSS before the model was built (the libraries imported and, under 8-bit
  AdamW, its step compiled for the shapes the case trains: the compiler's graphs and code are the runtime's, printed
  below the table), against the estimate's peak (start-up or
  step, whichever is larger) less DDP's gradient buckets (the one process runs no DDP wrapper). By default glibc's
  mmap threshold is fixed at 128 KiB (``--malloc mmap``, what ``MALLOC_MMAP_THRESHOLD_=131072`` sets): each
  tensor over that is mapped and unmapped on its own, so the RSS follows the live tensors. ``--malloc glibc`` keeps
  glibc's default, whose threshold rises to the size of each large block freed (up to 32 MiB): activations of a few
  MiB then come from the heap, whose freed, fragmented memory stays resident, and the RSS grows step after step
  by what the allocator keeps rather than what the tensors need;
- step: the median wall time of the steps after the first (the first compiles torchao's step), as a ratio to the
  ``plain`` case. Only an idle machine gives meaningful ratios.

``activation_offload`` is not a case: on CPU ranks it is off (the activations are in host memory already).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ringdit, also in spawned ranks
from benchmarks.fsdp_memory import TEXT_LEN, WAN_1_3B  # noqa: E402
from benchmarks.tensor_memory import PeakTensorMemory  # noqa: E402

LORA = {"rank": 64, "alpha": 64}
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD = 128 * 1024  # glibc's initial threshold; fixed, it no longer rises
# name: (LoRA base dtype or None for a full fine-tune, 8-bit AdamW, activation_checkpointing)
CASES = {
    "plain": ("float32", False, False),
    "bf16_base": ("bfloat16", False, False),
    "fp8": ("float8_e4m3fn", False, False),
    "fp8_8bit": ("float8_e4m3fn", True, False),
    "ckpt_all": ("float32", False, True),
    "ckpt_half": ("float32", False, 0.5),
    "full": (None, False, False),
    "full_8bit": (None, True, False),
}


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds: an 8-bit optimizer state's codes, scales and map; else numel x element size."""
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    if hasattr(tensor, "codes"):
        return sum(t.numel() * t.element_size() for t in (tensor.codes, tensor.scale, tensor.qmap))
    return tensor.numel() * tensor.element_size()


def config(layers: int, latents: tuple, checkpointing) -> dict:
    return {"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "wan",
            "config": {**WAN_1_3B, "num_layers": layers}, "input_size": list(latents), "in_channels": 16,
            "text_len": TEXT_LEN, "text_dim": 4096, "activation_checkpointing": checkpointing}


def rss_bytes(field: str = "VmRSS") -> int:
    """The process's resident memory now (``VmRSS``) or its peak since the last ``reset_peak_rss`` (``VmHWM``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))


def reset_peak_rss() -> None:
    """Start the peak RSS (``VmHWM``) afresh from the RSS now (Linux: ``5`` into ``/proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def compile_8bit_step(cfg: dict, lora: dict | None) -> int:
    """Compile torchao's 8-bit AdamW step (``torch.compile(dynamic=False)``: one graph per shape) for each shape the
    case trains, on throwaway tensors, and return the resident bytes that left behind: torch.compile's graphs and
    generated code, which, like the imported libraries, are the runtime's memory, not the model's."""
    from ringdit.models.lora import add_lora
    from ringdit.training.optimizers import adamw8bit
    from ringdit.spec.model import build_on_meta

    meta = build_on_meta(cfg, 1)
    if lora:
        add_lora(meta, **{**lora, "base_dtype": None})  # the adapters' shapes; the base's dtype changes none
    shapes = {tuple(p.shape) for p in meta.parameters() if p.requires_grad}
    before = rss_bytes()
    params = [torch.zeros(shape, requires_grad=True) for shape in shapes]
    for param in params:
        param.grad = torch.zeros_like(param)
    adamw8bit(params, lr=1e-5).step()
    del params
    gc.collect()
    return rss_bytes() - before


def measure(rank: int, case: str, layers: int, steps: int, latents: tuple, malloc: str, results) -> None:
    if malloc == "mmap" and not ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        raise RuntimeError("glibc's mallopt refused M_MMAP_THRESHOLD: run with --malloc glibc")
    from ringdit.models.build import build_model
    from ringdit.costs import estimate_model_memory
    from ringdit.training.optimizers import adamw8bit

    import diffusers.models.transformers  # noqa: F401  (the libraries' own memory is no case's: imported first)
    import peft  # noqa: F401
    import torchao.optim  # noqa: F401

    torch.set_num_threads(1)
    base, eight_bit, checkpointing = CASES[case]
    lora = {**LORA, "base_dtype": base} if base else None
    cfg = config(layers, latents, checkpointing)
    estimate = estimate_model_memory(cfg, lora=lora, lora_base_dtype=base or "float32", ema=False,
                                     optimizer_8bit=eight_bit, activation_checkpointing=float(checkpointing))
    compiled = compile_8bit_step(cfg, lora) if eight_bit else 0
    reset_peak_rss()  # the peak from here on: not the imports' or the compilation's transient memory
    before = rss_bytes()
    model, _ = build_model(cfg, lora=lora, seed=0)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = (adamw8bit if eight_bit else torch.optim.AdamW)(trained, lr=1e-5)
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(1, 16, *latents, generator=g), torch.tensor([500.0])
    cond = {"text": torch.randn(1, TEXT_LEN, 4096, generator=g)}
    times, acts, kept = [], 0, 0
    for step in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        memory = PeakTensorMemory()
        # tensors that lived before (weights, buffers, inputs, gradients) are not the step's: a view of one is no
        # new storage
        existing = [*model.parameters(), *model.buffers(), x, t, *cond.values(), *(p.grad for p in trained)]
        memory._seen.update(e.untyped_storage().data_ptr() for e in existing if e is not None)
        with memory:
            loss = model(x, t, cond).square().mean()
            kept = memory.live_bytes  # what forward left for backward
            loss.backward()
        if step or steps == 1:  # the first step also creates the gradients (the estimate's gradient term)
            acts = max(acts, memory.peak_bytes)
        optimizer.step()
        times.append(time.perf_counter() - start)
    state = sum(tensor_bytes(p) for p in model.parameters()) + sum(tensor_bytes(p.grad) for p in trained) \
        + sum(tensor_bytes(v) for s in optimizer.state.values() for k, v in s.items() if k != "step")
    results.put({"case": case, "state": state, "acts": acts, "rss": rss_bytes("VmHWM") - before, "compiled": compiled, "kept": kept,
                 "step_s": statistics.median(times[1:] or times),
                 "est_state": estimate.weights_bytes + estimate.gradient_bytes + estimate.optimizer_bytes,
                 "est_acts": estimate.activation_bytes + estimate.attention_bytes,
                 "est_peak": max(estimate.startup_bytes, estimate.step_bytes - estimate.bucket_bytes)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--latents", type=int, nargs=3, default=[4, 16, 16], metavar=("T", "H", "W"))
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--malloc", choices=("mmap", "glibc"), default="mmap",
                        help="mmap: tensors over 128 KiB mapped on their own (the RSS follows them); glibc: its "
                             "default dynamic threshold (the RSS also holds the heap's freed memory)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    mib = 2**20
    print(f"Wan-1.3B-shaped, {args.layers} layers, latents {tuple(args.latents)}, LoRA rank 64 (full: every weight), "
          f"fp32 activations, one CPU rank, malloc {args.malloc}; MiB measured / estimated (ratio)")
    print(f"{'case':<11}{'state MiB':>24}{'acts MiB':>24}{'peak RSS MiB':>24}{'step s':>8}{'vs plain':>9}", flush=True)
    plain, compiled, kept = None, {}, {}
    for case in args.cases:  # each row as soon as its case is done
        results = ctx.SimpleQueue()
        mp.start_processes(measure, args=(case, args.layers, args.steps, tuple(args.latents), args.malloc, results),
                           nprocs=1, start_method="spawn")
        r = results.get()
        kept[case] = r["kept"]
        if r["compiled"]:
            compiled[case] = r["compiled"]
        plain = r["step_s"] if case == "plain" else plain
        cells = "".join(f"{f'{m / mib:.0f} / {e / mib:.0f} ({m / e:.2f})':>24}"
                        for m, e in ((r["state"], r["est_state"]), (r["acts"], r["est_acts"]),
                                     (r["rss"], r["est_peak"])))
        ratio = f"{r['step_s'] / plain:.2f}x" if plain else "-"
        print(f"{r['case']:<11}{cells}{r['step_s']:>8.2f}{ratio:>9}", flush=True)
    print("kept for backward at the end of forward: " + ", ".join(f"{case} {size / mib:.1f} MiB"
                                                               for case, size in kept.items()))
    if compiled:
        print("resident before the baseline, torchao's 8-bit step compiled for the trained shapes: " + ", ".join(
            f"{case} {size / mib:.0f} MiB" for case, size in compiled.items()))


if __name__ == "__main__":
    main()
