"""The layouts the planner searches: every (dp, ring, ulysses) of the GPUs under every strategy and memory option
that the settings leave open, each a ``Candidate`` with its memory per rank (``ringdit.costs``) and its step's cost
(``ringdit.costs.step_time``), and the order they are preferred in."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields, replace

from ringdit.common.errors import ConfigError
from ringdit.parallel.layout import Layout
from ringdit.costs import FLOAT8, MemoryEstimate, ModelSize, Setup, estimate_memory
from ringdit.costs.step_time import Machine, step_time

# ---- the hardware and the cost of one step -------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    gpus: int
    gpus_per_node: int
    usable_bytes: float      # per GPU: gpu_memory_gb x usable_memory
    flops: float             # per GPU per second
    intra_node: float        # bytes per second one GPU sends within its node
    inter_node: float        # ... to another node
    host: float = 25e9       # bytes per second one GPU copies to or from host memory (offloaded activations)


@dataclass(frozen=True)
class StepCost:
    attention_flops: float   # per rank and step
    linear_flops: float
    ring_bytes: float        # sent per rank and step
    ulysses_bytes: float
    sync_bytes: float        # FSDP's all-gathers and reduce-scatters, or DDP's all-reduce
    seconds: float           # the step, as ringdit.costs.step_time models it
    samples: int             # trained per step: dp x batch

    @property
    def per_sample(self) -> float:
        return self.seconds / self.samples


def step_cost(model: ModelSize, layout: Layout, setup: Setup, hardware: Hardware) -> StepCost:
    """The work, traffic and time of one training step on one rank (``ringdit.costs.step_time``'s model)."""
    machine = Machine(gpus_per_node=hardware.gpus_per_node, matmul_flops=hardware.flops,
                      intra_node=hardware.intra_node, inter_node=hardware.inter_node, host=hardware.host)
    t = step_time(model, layout, setup, machine)
    return StepCost(attention_flops=t.attention_flops, linear_flops=t.matmul_flops, ring_bytes=t.ring_bytes,
                    ulysses_bytes=t.ulysses_bytes, sync_bytes=t.sync_bytes, seconds=t.seconds,
                    samples=layout.dp_degree * setup.batch_size)


# ---- the layouts -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    setup: Setup  # the memory options tried with it
    memory: MemoryEstimate
    cost: StepCost
    fits: bool

    @property
    def label(self) -> str:
        lay = self.layout
        return (f"dp={lay.dp_degree} ring={lay.ring_degree} ulysses={lay.ulysses_degree} {lay.strategy}"
                f"{options_label(self.setup)}")

    def variant(self, **changes) -> tuple[Layout, Setup]:
        """This candidate's layout and setup with ``changes`` (fields of either) made."""
        layout_fields = {f.name for f in fields(Layout)}
        return (replace(self.layout, **{k: v for k, v in changes.items() if k in layout_fields}),
                replace(self.setup, **{k: v for k, v in changes.items() if k not in layout_fields}))


def options_label(s: Setup) -> str:
    """The memory options of ``s`` as the settings that ask for them: `` +ckpt=every_2+offload fp8 8bit``."""
    parts = []
    if s.checkpoint_fraction:
        fraction = s.checkpoint_fraction
        period = 1 / fraction
        ckpt = "" if fraction == 1 else f"=every_{round(period)}" if period.is_integer() else f"={fraction:g}"
        parts.append(f"+ckpt{ckpt}" + ("+offload" if s.activation_offload else ""))
    if s.lora_base_dtype in FLOAT8:
        parts.append(s.lora_base_dtype.replace("float8_", "fp8-"))
    if s.optimizer_8bit:
        parts.append("adamw8bit")
    return "".join(f" {part}" for part in parts)


def divisors(n: int) -> list[int]:
    """In increasing order; sqrt(n) trial divisions (gpus=10**12 lists its divisors at once)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


DEGREES = ("dp_degree", "ring_degree", "ulysses_degree")


def degree_triples(model: ModelSize, gpus: int, fixed: dict[str, int] | None = None) -> list[tuple[int, int, int]]:
    """Every (dp, ring, ulysses) of ``gpus`` ranks the model can run: dp x ring x ulysses = gpus, Ulysses no more
    than the heads (a degree that does not divide them splits them unevenly: ``ringdit.parallel.head_counts``, the
    step time counts the busiest rank), ring x ulysses no more than the tokens; ``fixed`` (``DEGREES`` -> value):
    only those with it."""
    fixed = fixed or {}
    found = []
    for dp in divisors(gpus):
        sp = gpus // dp
        for ulysses in divisors(sp):
            triple = (dp, sp // ulysses, ulysses)
            if ulysses > model.num_heads or sp > model.tokens \
                    or any(fixed.get(name, value) != value for name, value in zip(DEGREES, triple)):
                continue
            found.append(triple)
    return found


def _either(values) -> str:
    """1, 2 or 4."""
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


def check_fixed_degrees(model: ModelSize, gpus: int, fixed: dict[str, int]) -> None:
    """The degrees the settings fix leave at least one layout; else a ConfigError naming the first one that rules
    every layout out, why, and the values it can take with the others as given."""
    if not fixed or degree_triples(model, gpus, fixed):
        return
    given = " ".join(f"{name}={value}" for name, value in fixed.items())
    for name, value in fixed.items():
        others = {key: v for key, v in fixed.items() if key != name}
        options = sorted({triple[DEGREES.index(name)] for triple in degree_triples(model, gpus, others)})
        if not options:
            continue
        if gpus % value:
            why = f"{name}={value} does not divide gpus={gpus}"
        elif name == "ulysses_degree" and value > model.num_heads:
            why = (f"ulysses_degree={value} is more than the model's {model.num_heads} heads (Ulysses gives each rank "
                   f"whole heads)")
        elif value > model.tokens:
            why = f"{name}={value} is more ranks than the model's {model.tokens} tokens per sample"
        else:
            why = f"{given}: dp_degree x ring_degree x ulysses_degree must be gpus={gpus}"
        raise ConfigError(f"{why}; with {' '.join(f'{k}={v}' for k, v in others.items()) or 'the others free'}, "
                          f"use {name}={_either(options)}")
    raise ConfigError(f"{given}: no layout of gpus={gpus} ranks has these degrees (dp x ring x ulysses = gpus, "
                      f"Ulysses at most the model's {model.num_heads} heads); leave them null to lay out every one")


def candidates(model: ModelSize, layout: Layout, base: Setup, hardware: Hardware, strategies: tuple[str, ...],
               checkpointing: tuple, options: dict[str, tuple] | None = None,
               fixed: dict[str, int] | None = None) -> list[Candidate]:
    """Every feasible layout of ``hardware.gpus`` ranks (``layout`` with its degrees and strategy replaced; ``fixed``:
    only those with these ``DEGREES``) under every combination of the strategies, checkpointed shares and
    ``options`` (Setup fields: ``activation_offload``, ``lora_base_dtype``, ``optimizer_8bit``: the values to try),
    with its memory and cost. Offloading is tried only where blocks are checkpointed."""
    options = {"activation_offload": (False,), **(options or {})}
    names = list(options)
    found = []
    for dp, ring, ulysses in degree_triples(model, hardware.gpus, fixed):
        for strategy, ckpt, *values in itertools.product(strategies, checkpointing, *options.values()):
            chosen = dict(zip(names, values))
            if chosen["activation_offload"] and not ckpt:
                continue
            laid_out = replace(layout, dp_degree=dp, ring_degree=ring, ulysses_degree=ulysses, strategy=strategy)
            setup = replace(base, activation_checkpointing=ckpt, **chosen)
            memory = estimate_memory(model, laid_out, setup)
            found.append(Candidate(laid_out, setup, memory, step_cost(model, laid_out, setup, hardware),
                                   memory.peak_bytes <= hardware.usable_bytes))
    return found


def preference(c: Candidate) -> tuple:
    """Least time per sample first; among equal times (on a grid of 1 % steps: closer than that, as when communication
    hides behind compute, the time model cannot tell them apart) exact numerics (no fp8 base, no 8-bit states), DDP
    (fewer collectives), then less recomputation, no offloading, then the most headroom."""
    s = c.setup
    approximations = (s.lora_base_dtype in FLOAT8) + s.optimizer_8bit
    return (round(math.log(c.cost.per_sample) / math.log(1.01)), approximations, c.layout.fsdp,
            s.checkpoint_fraction, s.activation_offload, c.memory.peak_bytes)
