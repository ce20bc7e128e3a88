"""Peak memory per rank at start-up and in a train step, measured on CPU ranks: a Wan-1.3B-width transformer under
FSDP (with and without EMA, and LoRA on a bf16 base), today's code beside an older commit's, and ``ringdit.costs``'s
estimate beside the measurement.

    python benchmarks/startup_memory.py                  # this checkout; about 15 min on 2 idle cores
    python benchmarks/startup_memory.py --old f0f9609    # and the code before meta-device start-up (+2 min)
    python benchmarks/startup_memory.py --quick          # 4 layers, worlds 1 and 2: a smoke run, about 3 min
    python benchmarks/startup_memory.py --json m.json    # keep the measurements (--resume: go on from them;
                                                         # --tables m.json: reprint them with today's estimate)

Every case is a fresh set of gloo ranks (one thread each, forked from a fork server that only imported torch,
diffusers and peft), so no case inherits another's heap. Per rank:

- **baseline**: the process's RSS after its imports (torch, diffusers, peft, ringdit) and the process group, before
  the model is built;
- **start-up**: the RSS high-water mark (``VmHWM``) of ``build_model`` (the high-water mark is reset with
  ``echo 5 > /proc/self/clear_refs`` before each phase);
- **step**: the high-water mark of a train step -- forward and backward of a random batch through
  ``model(x, t, cond)`` with a plain MSE loss, an AdamW step for the trainable parameters, the EMA update -- for the
  first step and for the second (AdamW's moments exist from the first step's end: the second is the steady state).

The tables give peak minus baseline in GiB, the largest over the ranks. RSS counts every page the process touched
(the allocator's slack too), which is what the operating system, and its out-of-memory killer, sees: glibc keeps
freed blocks under its dynamic mmap threshold (at most 32 MiB) in its heap, so many all-gathered parameters below
that size stay resident after FSDP frees them (``MALLOC_MMAP_THRESHOLD_=1048576 python benchmarks/startup_memory.py``
shows the figures without that retention).

``--old`` builds the model with an older ringdit (a folder, or a git revision checked out into a temporary worktree
and removed after; a case whose ranks imported another ringdit is reported as failed); the script tolerates what
that code lacks (``build_model(seed=)``, ``lora.base_dtype``, a module-level ``shard_model``). Memory only: nothing
here is a pass/fail test, and the times printed are context.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # appended, so that PYTHONPATH (an older checkout) wins over this one
    sys.path.append(str(ROOT))
from benchmarks.cpu_ranks import free_port  # noqa: E402

GiB = 2**30
WAN_1_3B_WIDTH = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                      out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, cross_attn_norm=True,
                      qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
TEXT_LEN = 8
EMA_DECAY = 0.999
# The first step allocates AdamW's moments after the backward; from the second on they are held through forward
# and backward, beside the gathered blocks and the gradients: the training's peak, which the estimate models.
STEPS = 2
LORA_RANK = 16
SHORT, LONG = (1, 8, 8), (3, 16, 16)  # latents (T, H, W): 16 and 192 tokens after the (1, 2, 2) patches
# Imported once by the fork server the ranks are forked from (a rank starts in a second, not in the tens of seconds
# of a cold import); ringdit is not among them: each rank imports the one its case measures.
PRELOAD = ["torch.distributed.fsdp", "torch.nn.parallel", "diffusers.models.transformers.transformer_wan", "peft",
           "hydra.utils", "lightning.pytorch"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured run: how the model is held (strategy, world, EMA, LoRA), its depth and the latent it trains on."""

    strategy: str              # fsdp | ddp
    world: int
    ema: bool
    lora: str | None           # None: full fine-tune; "bfloat16" / "float32": LoRA on a base held in that dtype
    layers: int
    latent: tuple[int, int, int]
    code: str = "new"          # new: this checkout; old: the --old code

    @property
    def lora_settings(self) -> dict | None:
        return None if self.lora is None else {"rank": LORA_RANK, "base_dtype": self.lora}

    @property
    def config(self) -> dict:
        return {"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "wan",
                "config": {**WAN_1_3B_WIDTH, "num_layers": self.layers}, "input_size": list(self.latent),
                "in_channels": 16, "text_len": TEXT_LEN, "text_dim": 4096}

    @property
    def label(self) -> str:
        what = "full" if self.lora is None else f"LoRA r{LORA_RANK}, {'bf16' if self.lora == 'bfloat16' else 'fp32'} base"
        return f"{what}, {'EMA' if self.ema else 'no EMA'}"


# ---- one rank ----------------------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """The RSS high-water mark back to the current RSS (Linux ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _storages(tensors) -> dict[int, int]:
    """Bytes by storage (each counted once: tied and shared tensors are one allocation)."""
    out = {}
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        out[storage.data_ptr()] = storage.nbytes()
    return out


def _tensor_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ema) -> dict[str, int]:
    """This rank's bytes of parameters, gradients, optimizer state and of the EMA's own tensors (not shared with the
    model): what the RSS holds besides activations, buffers, FSDP's gathered blocks and the allocator's slack."""
    params = _storages(model.parameters())
    grads = _storages(p.grad for p in model.parameters() if p.grad is not None)
    moments = _storages(v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0)
    averaged = {} if ema is None else _storages([*ema.parameters(), *ema.buffers()])
    own = {ptr: n for ptr, n in averaged.items() if ptr not in params and ptr not in _storages(model.buffers())}
    return {"params": sum(params.values()), "grads": sum(grads.values()), "optim": sum(moments.values()),
            "ema": sum(own.values())}


def _shard_function(mesh):
    """``shard_model`` over ``mesh``: this checkout's, or (older code, where it is a strategy method) the same
    per-block ``fully_shard``."""
    try:
        from ringdit.training.fsdp import shard_model
    except ImportError:
        from torch.distributed.fsdp import fully_shard

        from ringdit.models.parallelize import repeated_blocks

        def shard_model(model, mesh):
            for block in repeated_blocks(model):
                fully_shard(block, mesh=mesh)
            return fully_shard(model, mesh=mesh)

    return functools.partial(shard_model, mesh=mesh)


def _measure(rank: int, case: Case, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=case.world, timeout=datetime.timedelta(seconds=1800))
    try:
        import diffusers
        import peft  # noqa: F401  (imported by LoRA; counted in the baseline, not in start-up)
        from torch.nn.parallel import DistributedDataParallel

        import ringdit
        from ringdit.models.build import build_model
        from ringdit.models.lora import add_lora
        from ringdit.parallel import build_shard_mesh

        diffusers.WanTransformer3DModel  # noqa: B018  (diffusers imports its models lazily)
        kwargs = {"ema_decay": EMA_DECAY if case.ema else None}
        if "seed" in inspect.signature(build_model).parameters:
            kwargs["seed"] = 0
        torch.manual_seed(0)  # older code initialises from the global generator
        lora = case.lora_settings
        if lora is not None and "base_dtype" not in inspect.signature(add_lora).parameters:
            if case.lora != "float32":
                raise RuntimeError(f"{ringdit.__file__}: add_lora has no base_dtype; cannot hold the base in {case.lora}")
            lora = {"rank": LORA_RANK}  # older code: the base stays fp32
        if case.strategy == "fsdp":
            kwargs["shard"] = _shard_function(build_shard_mesh(case.world))
        gc.collect()
        baseline = _status_kib("VmRSS") * 1024

        _reset_peak()
        start = time.perf_counter()
        model, ema = build_model(case.config, lora=lora, **kwargs)
        startup = _status_kib("VmHWM") * 1024
        startup_s = time.perf_counter() - start
        parameters = sum(p.numel() for p in model.parameters())
        weights = sum(p.numel() * p.element_size() for p in model.parameters())  # the whole model, as held

        train = DistributedDataParallel(model) if case.strategy == "ddp" else model  # its buckets: in the step
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        g = torch.Generator().manual_seed(1 + rank)
        x = torch.randn(1, 16, *case.latent, generator=g)
        target = torch.randn(x.shape, generator=g)
        cond = {"text": torch.randn(1, TEXT_LEN, 4096, generator=g)}
        steps, step_s = [], []
        for _ in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            _reset_peak()
            start = time.perf_counter()
            loss = torch.nn.functional.mse_loss(train(x, torch.tensor([500.0]), cond), target)
            loss.backward()
            optimizer.step()
            if ema is not None:
                ema.update_parameters(model)
            steps.append(_status_kib("VmHWM") * 1024 - baseline)
            step_s.append(time.perf_counter() - start)
        results.put({"rank": rank, "baseline": baseline, "startup": startup - baseline, "step1": steps[0],
                     "step2": steps[-1], "step": max(steps), "startup_s": startup_s, "step_s": max(step_s),
                     "parameters": parameters, "weights": weights, "ringdit": str(Path(ringdit.__file__).parents[1]),
                     **_tensor_bytes(model, optimizer, ema)})
    finally:
        dist.destroy_process_group()


# ---- the machine and the runs ----------------------------------------------------------------------------------


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def busy_processes() -> list[str]:
    """Other processes using CPU now (not this one or its children): two samples of /proc a second apart (``ps``'s
    figure is the average since each process started)."""
    def ticks() -> dict[int, tuple[int, int, str]]:
        out = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                    command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    continue
                out[int(entry.name)] = (int(fields[11]) + int(fields[12]), int(fields[1]), command[:70])
        return out

    first = ticks()
    time.sleep(1.0)
    second = ticks()
    hz, me = os.sysconf("SC_CLK_TCK"), os.getpid()
    rows = sorted(((t - first[pid][0]) / hz * 100, pid, command) for pid, (t, parent, command) in second.items()
                  if pid in first and me not in (pid, parent))
    return [f"{cpu:.0f}% {command}" for cpu, pid, command in reversed(rows) if cpu >= 10]


def run_case(case: Case, ringdit_path: Path | None, need: int) -> dict:
    """``case`` on fresh ranks; the largest value over the ranks of each measurement, and the machine's state
    when it started. ``need``: the bytes it is expected to take (waits, then skips, when the machine lacks them)."""
    for _ in range(12):
        if available_bytes() > need:
            break
        time.sleep(10)
    else:
        return {"skipped": f"{available_bytes() / GiB:.1f} GiB available, about {need / GiB:.1f} GiB needed"}
    machine = {"load": Path("/proc/loadavg").read_text().split()[0], "busy": busy_processes()}
    saved = list(sys.path)
    if ringdit_path is not None:  # the spawned ranks import sys.path's first ringdit
        sys.path.insert(0, str(ringdit_path))
    try:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        results = ctx.SimpleQueue()
        start = time.perf_counter()
        mp.start_processes(_measure, args=(case, free_port(), results), nprocs=case.world, start_method="forkserver")
        wall = time.perf_counter() - start
    finally:
        sys.path[:] = saved
    ranks = [results.get() for _ in range(case.world)]
    if ringdit_path is not None and Path(ranks[0]["ringdit"]).resolve() != ringdit_path.resolve():
        raise RuntimeError(f"the ranks imported {ranks[0]['ringdit']}, not {ringdit_path} (was the folder removed?)")
    numeric = [key for key, value in ranks[0].items() if isinstance(value, (int, float)) and key != "rank"]
    return {**{key: max(r[key] for r in ranks) for key in numeric}, "ringdit": ranks[0]["ringdit"], "wall_s": wall,
            **machine}


@contextmanager
def code_at(old: str | None):
    """The folder holding the older ringdit: ``old`` itself, or a temporary worktree of the revision ``old``."""
    if old is None or Path(old).is_dir():
        yield None if old is None else Path(old).resolve()
        return
    folder = Path(tempfile.mkdtemp(prefix="ringdit-old-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), old], check=True,
                   capture_output=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(folder)], check=True)
        folder.parent.rmdir()


# ---- the estimate ----------------------------------------------------------------------------------------------


def estimate(case: Case):
    """``ringdit.costs``'s estimate for ``case`` (this checkout's), or None where it has none."""
    try:
        from ringdit.parallel.layout import Layout
        from ringdit.costs import estimate_model_memory
    except ImportError:
        return None
    layout = Layout(dp_degree=case.world, strategy=case.strategy, device_type="cpu")
    return estimate_model_memory(case.config, layout, lora=case.lora_settings, ema=case.ema, training=True,
                                 precision="32", lora_base_dtype=case.lora or "float32")


def rough_need(case: Case, full_weights: int) -> int:
    """Bytes the whole case takes on the machine, with a margin (to wait until they are free): per rank the weights,
    gradients, AdamW's two moments, the EMA and DDP's buckets, sharded or not (the old start-up: the whole model and
    its EMA on every rank), plus 0.45 x the weights for gathered blocks and the allocator's slack, plus 0.4 GiB of
    baseline."""
    weights = full_weights * case.layers // 12
    copies = 0.55 if case.lora == "bfloat16" else 1 if case.lora else 4 + case.ema + (case.strategy == "ddp")
    per_rank = copies * weights / (case.world if case.strategy == "fsdp" else 1) + 0.45 * weights
    if case.code == "old":
        per_rank = max(per_rank, (1 + case.ema) * weights)
    return int(case.world * (1.1 * per_rank + 0.4 * GiB))


# ---- the tables ------------------------------------------------------------------------------------------------


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def startup_table(cases: list[Case], results: dict[Case, dict]) -> str:
    full = next((results[c] for c in cases if c.lora is None and "weights" in results[c]), None)
    if full is None:
        return "(no full fine-tune was measured: no W to compare with)"
    W = full["weights"]
    rows = []
    for case in cases:
        r = results[case]
        head = [case.code, case.label, str(case.world)]
        if "skipped" in r or "failed" in r:
            rows.append(head + [r.get("skipped") or r["failed"]] + [""] * 8)
            continue
        bound = 1.2 * W / case.world
        held = bound * (2 if case.ema and case.lora is None else 1)  # + the EMA: a second copy of what trains
        rows.append(head + [gib(r["baseline"]), gib(r["startup"]), gib(r["step1"]), gib(r["step2"]), gib(bound),
                            "yes" if r["startup"] <= bound else "no",
                            "yes" if r["startup"] <= held else "no", f"{r['startup_s']:.0f} / {r['step_s']:.0f}"])
    return table(["code", "run", "world", "baseline GiB", "start-up GiB", "step 1 GiB", "step 2 GiB", "1.2 W/world GiB",
                  "start-up <= 1.2 W/world", "<= 1.2 (W + EMA)/world", "build / step s"], rows)


def lora_table(results: dict[Case, dict]) -> str:
    rows = []
    for new in (c for c in results if c.code == "new" and c.lora == "bfloat16" and c.ema):
        old = next((c for c in results if c.code == "old" and c.lora and c.ema
                    and dataclasses.replace(c, code="new", lora=new.lora) == new), None)
        if old is None or "startup" not in results[old] or "startup" not in results[new]:
            continue
        n, o = results[new], results[old]
        peak_new, peak_old = max(n["startup"], n["step"]), max(o["startup"], o["step"])
        with_base = (peak_new + n["baseline"]) / (peak_old + o["baseline"])
        rows.append([str(new.world), gib(o["startup"]), gib(o["step"]), gib(n["startup"]), gib(n["step"]),
                     f"{peak_new / peak_old:.2f}", "yes" if peak_new <= 0.55 * peak_old else "no", f"{with_base:.2f}"])
    return table(["world", "old start-up GiB", "old step GiB", "new start-up GiB", "new step GiB",
                  "new / old peak", "<= 0.55", "new / old incl. baseline"], rows)


def estimate_table(cases: list[Case], results: dict[Case, dict]) -> tuple[str, str]:
    rows, terms = [], []
    for case in cases:
        r = results[case]
        e = estimate(case) if case.code == "new" and "startup" in r else None
        if e is None:
            continue
        within = lambda got, want: "yes" if abs(want / got - 1) <= 0.2 else "**no**"  # noqa: E731
        rows.append([case.strategy, case.label, str(case.world), str(case.layers), "x".join(map(str, case.latent)),
                     gib(e.startup_bytes), gib(r["startup"]), f"{e.startup_bytes / r['startup']:.2f}",
                     within(r["startup"], e.startup_bytes),
                     gib(e.step_bytes), gib(r["step"]), f"{e.step_bytes / r['step']:.2f}", within(r["step"], e.step_bytes)])
        state = r["params"] + r["grads"] + r["optim"] + r["ema"]
        rest = e.bucket_bytes + e.gathered_bytes + e.activation_bytes + e.attention_bytes
        terms.append([case.strategy, case.label, str(case.world), str(case.layers), "x".join(map(str, case.latent)),
                      f"{gib(e.weights_bytes)} / {gib(r['params'])}", f"{gib(e.gradient_bytes)} / {gib(r['grads'])}",
                      f"{gib(e.optimizer_bytes)} / {gib(r['optim'])}", f"{gib(e.ema_bytes)} / {gib(r['ema'])}",
                      f"{gib(rest)} / {gib(r['step'] - state)}"])
    header = ["strategy", "run", "world", "layers", "latent"]
    return (table(header + ["start-up est.", "start-up meas.", "est/meas", "within 20%", "step est.", "step meas.",
                            "est/meas", "within 20%"], rows),
            table(header + ["weights est/meas", "grads est/meas", "AdamW est/meas", "EMA est/meas",
                            "rest of step est/meas"], terms))


# ---- the plan ----------------------------------------------------------------------------------------------------


def plan(quick: bool, old: bool) -> tuple[list[Case], list[Case]]:
    """(start-up cases, estimate-only cases). The start-up cases -- Wan-1.3B width, 12 layers (2.3 GB in fp32), FSDP
    at worlds 1, 2, 4 -- are compared with the estimate too; the estimate-only ones add DDP and the longer latent on
    a 4-layer model, so that the comparison covers DDP / FSDP / LoRA, 1-4 ranks and two sequence lengths."""
    layers, worlds = (4, (1, 2)) if quick else (12, (1, 2, 4))
    startup = [Case("fsdp", w, ema, None, layers, SHORT) for ema in (False, True) for w in worlds]
    startup += [Case("fsdp", w, True, "bfloat16", layers, SHORT) for w in worlds]
    if old:
        startup += [Case("fsdp", w, True, lora, layers, SHORT, code="old") for lora in (None, "float32") for w in (1, 2)]
    checks = [Case("ddp", 1, True, None, 4, SHORT), Case("ddp", 2, True, None, 4, LONG),
              Case("fsdp", 2, True, None, 4, LONG), Case("fsdp", 4, False, None, 4, LONG),
              Case("ddp", 1, True, "bfloat16", 4, SHORT)]  # bf16 matmuls are slow on CPUs: LoRA on short latents
    return startup, [c for c in checks if c.world <= max(worlds)]


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--quick", action="store_true", help="4 layers, worlds 1 and 2, fewer estimate checks")
    parser.add_argument("--old", metavar="PATH|REV", help="also measure an older ringdit: a folder, or a git "
                        "revision (checked out into a temporary worktree), e.g. f0f9609")
    parser.add_argument("--json", metavar="PATH", help="also write the measurements there (after every case)")
    parser.add_argument("--resume", action="store_true", help="with --json: keep the cases that file already "
                        "holds and measure only the others (a run stopped half-way on a shared machine)")
    parser.add_argument("--tables", metavar="PATH", help="measure nothing: print the tables (and this checkout's "
                        "estimate) for the measurements a --json run wrote")
    args = parser.parse_args()
    if args.tables:
        saved = load_results(Path(args.tables))
        print_tables([c for c, (first, _) in saved.items() if first], [c for c, (first, _) in saved.items() if not first],
                     {c: result for c, (_, result) in saved.items()})
        return
    startup_cases, check_cases = plan(args.quick, args.old is not None)
    import ringdit

    malloc = " ".join(f"{k}={v}" for k, v in os.environ.items() if k.startswith("MALLOC_")) or "glibc malloc defaults"
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {available_bytes() / GiB:.1f} GiB available, {malloc}; "
          f"this checkout: {Path(ringdit.__file__).parents[1]}", flush=True)
    results: dict[Case, dict] = {}
    if args.resume and args.json and Path(args.json).exists():
        results = {c: r for c, (_, r) in load_results(Path(args.json)).items() if "startup" in r}
    start = time.perf_counter()
    full_weights = 2_400_000_000  # a 12-layer model in fp32, for rough_need before anything was measured
    with code_at(args.old) as old_path:
        for case in startup_cases + check_cases:
            if case in results:
                continue
            try:
                results[case] = run_case(case, old_path if case.code == "old" else None, rough_need(case, full_weights))
            except Exception as error:  # a case that cannot run (older code lacking a feature): say so, go on
                results[case] = {"failed": f"failed: {str(error).splitlines()[-1][:120]}"}
            r = results[case]
            print(f"  {case.code} {case.strategy} world {case.world} {case.label}, {case.layers} layers, latent "
                  f"{case.latent}: " + (f"start-up {gib(r['startup'])} GiB, steps {gib(r['step1'])} / "
                                        f"{gib(r['step2'])} GiB, "
                                        f"{r['wall_s']:.0f} s (load {r['load']}; busy: {', '.join(r['busy']) or '-'})"
                                        if "startup" in r else r.get("skipped") or r["failed"]), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(
                    [{"case": dataclasses.asdict(c), "startup_table": c in startup_cases, "result": results[c]}
                     for c in startup_cases + check_cases if c in results], indent=1))
    print(f"\nall cases: {time.perf_counter() - start:.0f} s\n")
    print_tables(startup_cases, check_cases, results)


def load_results(path: Path) -> dict[Case, tuple[bool, dict]]:
    """What a ``--json`` run wrote: ``{case: (in the start-up table, its measurements)}``."""
    rows = json.loads(path.read_text())
    return {Case(**{**row["case"], "latent": tuple(row["case"]["latent"])}): (row["startup_table"], row["result"])
            for row in rows}


def print_tables(startup_cases: list[Case], check_cases: list[Case], results: dict[Case, dict]) -> None:
    first = next((results[c] for c in startup_cases if c.lora is None and "parameters" in results[c]), None)
    if first is not None:
        print(f"### Start-up and step peak per rank: Wan-1.3B width (12 heads x 128, FFN 8960, text 4096), "
              f"{startup_cases[0].layers} layers, {first['parameters']:,} parameters = {first['weights'] / 1e9:.2f} GB "
              f"(W = {gib(first['weights'])} GiB) in fp32; FSDP, latent {SHORT}, text {TEXT_LEN} tokens, AdamW\n")
    print("Peak RSS minus the rank's baseline (largest over the ranks). Target: start-up <= 1.2 x W / world; the "
          "next column also allows the EMA's own copy of the trained weights (a full fine-tune's EMA is a second W).\n")
    print(startup_table(startup_cases, results))
    lora = lora_table(results)
    if lora.count("\n") > 1:
        print(f"\n### LoRA r{LORA_RANK}: bf16 base + adapter-only EMA (new) vs fp32 base + whole-model EMA (old)\n")
        print("Target: the new peak (larger of start-up and step) per rank <= 0.55 x the old one.\n")
        print(lora)
    comparison, terms = estimate_table(startup_cases + check_cases, results)
    print("\n### ringdit.costs's estimate vs measured peak RSS minus baseline (GiB per rank)\n")
    print(comparison)
    print("\nBy term (estimate / measured tensor bytes; the rest of the step: estimate's buckets + gathered blocks + "
          "activations + attention vs measured step minus those tensors)\n")
    print(terms)


if __name__ == "__main__":
    main()
