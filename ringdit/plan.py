"""Plan a training run's layout: which (dp, ring, ulysses, strategy) and memory options -- activation checkpointing
of all, half or none of the blocks, their inputs offloaded to CPU memory, an fp8 LoRA base, 8-bit optimizer states --
fit the GPUs, and which of those costs least.

    python -m ringdit.plan model=wan_14b data.frames=81 data.size=[480,832] gpus=16 gpu_memory_gb=80
    python -m ringdit.plan model=flux_dev data.size=1024 gpus=8 lora.rank=64
    python -m ringdit.plan model=dit_xl data.size=512 gpus=4 trainer/strategy=ddp ema_decay=null

For every layout of ``gpus`` ranks (dp x ring x ulysses = gpus, Ulysses up to the heads, ring x ulysses no more
than the tokens) it prints the estimated peak memory per rank at start-up and during a step (``ringdit.memory``: what
it models is in its docstring), the attention TFLOPs per rank and step, the GB each rank sends per step for ring,
Ulysses and the parameter / gradient sync, and an estimated time per sample relative to the best layout that fits;
then the layout it recommends, and why. Only the model is built, on the meta device; nothing is downloaded. A setting
left null (``trainer/strategy``, ``model.activation_checkpointing``, ``model.activation_offload``,
``lora.base_dtype``, ``optimizer_8bit``) is searched over: every combination is a candidate, and the table shows the
``show`` best that fit and the ``show`` nearest that do not; the last line is train.py's command for the recommended
one (the settings carry train.py's names). Each candidate is a ``ringdit.layout.Layout`` (what train.py checks once and
runs); ``distill=dmd2`` counts DMD2's three models in the memory (``ringdit.memory``), while the cost below stays one
model's step.

The time per sample is ``ringdit.step_time``'s model of one step on one rank (its docstring has each term): matmuls
at ``gpu_tflops``; attention at the rate the kernel of ``attention_backend`` reaches on the chunk one call takes (the
FlashAttention-3 paper's H100 measurements: short chunks run slower); element-wise work at the HBM bandwidth;
the ring's hops (a latency plus K/V, overlapping the attention) and Ulysses' blocking all-to-alls over
``intra_node_gbps`` within a node (``gpus_per_node``; ranks placed as ``ringdit.parallel.mesh`` says) or
``inter_node_gbps`` across; eager PyTorch's launch floor per block (why splitting a short sequence stops paying);
recomputation; DDP's gradient all-reduce and FSDP's gathers and reduce-scatters where they do not hide behind the
compute; offloaded activations at ``host_gbps``; per sample: the step over dp x data.batch_size. It is held against
published wall-clock times of real models on H100s (docs/benchmarks.md). DMD2's step is timed as one model's.

The recommendation is the candidate that fits with the least time per sample; among equal times (within 1 %) the one
with exact numerics (a bf16 base, fp32 optimizer states), then DDP, then less recomputation, then no offloading, then
the most headroom. So an fp8 base or 8-bit states are recommended only when they buy something: a layout that fits
only with them, or one that needs less recomputation.
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass, fields, replace

from omegaconf import DictConfig, OmegaConf

from ringdit.cli import hydra_main, user_errors
from ringdit.errors import ConfigError, require_count, require_number
from ringdit.layout import Layout, check_strategy_degrees, strategy_kind
from ringdit.memory import DISTILL_METHODS, FLOAT8, GiB, MemoryEstimate, ModelSize, Setup, estimate_memory, model_size
from ringdit.models.frames import FrameRule
from ringdit.step_time import Machine, step_time

PRECISIONS = ("32-true", "32", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true", "64")


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
    seconds: float           # the step, as ringdit.step_time models it
    samples: int             # trained per step: dp x batch

    @property
    def per_sample(self) -> float:
        return self.seconds / self.samples


def step_cost(model: ModelSize, layout: Layout, setup: Setup, hardware: Hardware) -> StepCost:
    """The work, traffic and time of one training step on one rank (``ringdit.step_time``'s model)."""
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


def recommend(found: list[Candidate], hardware: Hardware) -> tuple[Candidate | None, list[str]]:
    """The layout that fits with the least time per sample, and one or two lines saying why."""
    fitting = sorted((c for c in found if c.fits), key=preference)
    usable = hardware.usable_bytes / GiB
    if not fitting:
        least = min(found, key=lambda c: c.memory.peak_bytes)
        return None, [f"No layout fits in {usable:.1f} GiB per GPU: the least memory is {least.label}'s "
                      f"{least.memory.peak_bytes / GiB:.1f} GiB. Try lora.rank=16 (and lora.base_dtype=null: an fp8 "
                      f"base), trainer/strategy=fsdp trainer.strategy.cpu_offload=true, more gpus, a smaller "
                      f"data.size or data.frames, or data.batch_size=1."]
    best = fitting[0]
    first = (f"Recommended: {best.label} -- {_number(best.memory.peak_bytes / GiB)} of {usable:.1f} GiB per GPU, and "
             f"the least estimated time per sample of the {len(fitting)} layouts that fit")
    if len(fitting) > 1:
        first += f" (next: {fitting[1].label}, {fitting[1].cost.per_sample / best.cost.per_sample:.2f}x)"
    return best, [first + ".", "Why: " + "; ".join(_reasons(best, found, hardware)) + "."]


def _reasons(best: Candidate, found: list[Candidate], hardware: Hardware) -> list[str]:
    s, lay = best.setup, best.layout

    def variant(**changes) -> Candidate | None:
        wanted = best.variant(**changes)
        return next((c for c in found if (c.layout, c.setup) == wanted), None)

    reasons = []
    other = variant(strategy="ddp" if lay.fsdp else "fsdp")
    if other is None:  # the settings named the strategy
        reasons.append(f"{lay.strategy.upper()} (trainer/strategy={lay.strategy})")
    elif lay.fsdp and not other.fits:
        reasons.append(f"FSDP, as replicated (DDP) state would need {other.memory.peak_bytes / GiB:.1f} GiB per rank")
    elif lay.fsdp:
        reasons.append(f"FSDP: sharding over {lay.shard_degree} ranks costs less than replicating")
    else:
        reasons.append("DDP: the replicated state fits, and DDP does without FSDP's per-step all-gathers")
    reasons += _option_reasons(s, variant)
    if lay.sp_degree == 1:
        reasons.append(f"no sequence parallelism: every rank trains whole samples (dp={lay.dp_degree}); "
                       + _split_reason(best, found))
    else:
        parts = []
        if lay.ulysses_degree > 1:
            where = "within a node" if lay.ulysses_degree <= hardware.gpus_per_node else "across nodes"
            parts.append(f"ulysses={lay.ulysses_degree} {where} (its all-to-alls block the step)")
        if lay.ring_degree > 1:
            where = "within a node" if lay.sp_degree <= hardware.gpus_per_node else "across nodes"
            parts.append(f"ring={lay.ring_degree} {where} (its K/V hops overlap the attention)")
        reasons.append(f"the sequence split over {lay.sp_degree} ranks: {', '.join(parts)}; "
                       + _split_reason(best, found))
    return reasons


def _split_reason(best: Candidate, found: list[Candidate]) -> str:
    """Why ``best`` splits its samples' sequences over as many ranks as it does: the best layout of the other kind
    (whole samples per rank against a split sequence), its estimated time per sample or the memory it needs."""
    whole = best.layout.sp_degree == 1
    other = [c for c in found if (c.layout.sp_degree == 1) != whole]
    if not other:
        return ("no layout splits a sample's sequence here" if whole else
                "no layout trains whole samples per rank here")
    fitting = [c for c in other if c.fits]
    if not fitting:
        if whole:
            return "no split layout fits"
        least = min(other, key=lambda c: c.memory.peak_bytes)
        return (f"whole samples per rank do not fit: the least of them, {least.label}, needs "
                f"{least.memory.peak_bytes / GiB:.1f} GiB")
    rival = min(fitting, key=preference)
    ratio = rival.cost.per_sample / best.cost.per_sample
    kind = "splitting the sequence" if whole else "whole samples per rank"
    return f"the best layout with {kind}, {rival.label}, takes {ratio:.2f}x the time per sample"


def _option_reasons(s: Setup, variant) -> list[str]:
    """Why each memory option of the recommended setup ``s`` is on: its variant without it (``variant(**changes)``,
    None when the settings fixed it) does not fit, or costs more time."""
    def because(what: str, other, without: str) -> str:
        if other is None:
            return f"{what} (as set)"
        if not other.fits:
            return f"{what}, as {without} the step would need {other.memory.peak_bytes / GiB:.1f} GiB"
        return f"{what}, as {without} it would take {other.cost.per_sample / best_time:.2f}x the time"

    best_time = variant().cost.per_sample
    reasons = []
    fraction = s.checkpoint_fraction
    if fraction:  # against the next smaller share that was tried
        less = [c for c in (variant(activation_checkpointing=f, activation_offload=False)
                            for f in sorted({0.5, 0.0}, reverse=True) if f < fraction) if c is not None]
        share = "every block" if fraction == 1 else options_label(Setup(activation_checkpointing=fraction)).strip()
        reasons.append(because(f"activation checkpointing ({share})", less[0] if less else None,
                               "with less checkpointing"))
    if s.activation_offload:
        reasons.append(because("the checkpointed blocks' inputs offloaded to CPU memory",
                               variant(activation_offload=False), "on the device"))
    if s.lora_base_dtype in FLOAT8:
        reasons.append(because(f"an fp8 base ({s.lora_base_dtype})", variant(lora_base_dtype="bfloat16"),
                               "with a bf16 base"))
    if s.optimizer_8bit:
        reasons.append(because("8-bit optimizer states (optimizer=adamw8bit)", variant(optimizer_8bit=False),
                               "with fp32 states"))
    return reasons


# ---- the model the plan is for -------------------------------------------------------------------------------------


def latent_shape(cfg: DictConfig, model_cfg: dict, vae_factors: tuple[int | None, int], video: bool,
                 frame_pad: int = 1, patch: tuple[int, ...] = (1, 1), clip_frames: int | None = None) -> list[int]:
    """The model's input shape ((T,) H, W) for ``data.size`` / ``data.frames`` (pixels; latents when
    ``data.latent`` is true: ``vae_factors``, (temporal, spatial) of the model kind's VAE, and the latent frames
    padded to a multiple of ``frame_pad`` as prepare pads them: CogVideoX's); H and W whole tokens of ``patch``.
    ``data.frames`` null lays out ``clip_frames``, the frames of the model's published pipeline, where it has one."""
    from ringdit.media.buckets import MAX_SIDE

    size = cfg.data.size
    size = [size, size] if isinstance(size, int) and not isinstance(size, bool) else \
        list(size) if OmegaConf.is_list(size) else []
    if len(size) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) and 0 < s <= MAX_SIDE for s in size):
        raise ConfigError(f"data.size must be H, W in pixels (or one integer for a square), each from 1 to "
                          f"{MAX_SIDE}, got {cfg.data.size!r}; e.g. data.size=[480,832]")
    frames = cfg.data.frames if cfg.data.frames is not None or not video else clip_frames
    temporal, spatial = vae_factors if cfg.data.latent else (1, 1)
    family = model_cfg.get("family", "dit")
    if video:
        require_count("data.frames", frames, hint="the frames of a video sample, e.g. 81")  # a DiT has no default
        if temporal and temporal > 1:  # the VAE's rule (CogVideoX's latents padded to pairs: 1 + 8k); the patch's
            FrameRule(temporal, frame_pad if cfg.data.latent else 1).check("data.frames", frames,  # is checked below
                                                                          who=f"{family}'s VAE")
    elif frames is not None:
        raise ConfigError(f"data.frames={frames} but {_preset_name(model_cfg)} is an image model; leave "
                          f"data.frames null")
    step = [spatial * p for p in patch[-2:]]  # pixels (or cells) per token
    if any(s % k for s, k in zip(size, step)):
        why = f"the VAE's factor {spatial} x the model's patch {list(patch[-2:])}" if cfg.data.latent else \
            f"the model's patch {list(patch[-2:])}"
        fix = [max(k, round(s / k) * k) for s, k in zip(size, step)]
        raise ConfigError(f"data.size={size} is not a multiple of {step} ({why}); use data.size=[{fix[0]},{fix[1]}]"
                          + (", or data.latent=false for sizes that are the model's input already"
                             if cfg.data.latent else ""))
    latent = [s // spatial for s in size]
    if video:
        latent_frames = (frames - 1) // temporal + 1 if temporal and temporal > 1 else frames
        if cfg.data.latent:
            latent_frames = -(-latent_frames // frame_pad) * frame_pad
        latent = [latent_frames, *latent]
    return latent


def planned_model(cfg: DictConfig) -> tuple[ModelSize, str]:
    """The preset's sizes for the data's shape, from the model built on the meta device, and a line describing it."""
    from ringdit.spec.model import build_on_meta, model_class, model_config

    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    lora = OmegaConf.to_container(cfg.lora, resolve=True)
    # the model kind says what data it takes: its patch, whether it is a video model, its VAE's factors, and the
    # data description but the shape, which the sizes give
    plan = model_class(model_cfg).planned_data(model_cfg, OmegaConf.to_container(cfg.data, resolve=True))
    patch = plan["patch"]
    shape = latent_shape(cfg, model_cfg, plan["vae_factors"], plan["video"], plan.get("frame_pad", 1), patch,
                         plan.get("clip_frames"))
    data = {**plan["data"], "image_size": shape}
    if any(s % p for s, p in zip(shape, patch)):
        raise ConfigError(f"data.frames={cfg.data.frames or plan.get('clip_frames')} gives {shape[0]} latent frames, which the model's temporal "
                          f"patch {patch[0]} does not divide; choose frames whose latent count is a multiple of it")
    config = model_config(model_cfg, data)
    meta_model = build_on_meta(config)
    expert = OmegaConf.select(cfg, "diffusion.expert", default=None)
    if expert not in (None, "both"):
        if expert not in ("high", "low") or not getattr(meta_model, "experts", ()):
            raise ConfigError(f"diffusion.expert={expert!r}: high or low picks the expert of a two-expert model "
                              f"(model=wan22_a14b*) that trains; null for every other model")
        meta_model.train_only(expert)  # its gradients, optimizer state and EMA only
    size = model_size(config, meta_model, lora)
    grid = " x ".join(str(s // p) for s, p in zip(shape, patch))
    text = f" + {size.text_tokens} text tokens (sharded with the image)" if size.text_tokens else ""
    clip = (f", {plan['clip_frames']} frames: the pipeline's clip; data.frames= to change it"
            if plan["video"] and cfg.data.frames is None else "")
    line = (f"{_preset_name(model_cfg)}: {_count(size.parameters)} parameters"
            + (f" ({_count(size.lora_parameters)} of LoRA rank {lora['rank']})" if size.lora else "")
            + f", {size.depth} blocks, hidden {size.hidden_size}, {size.num_heads} heads, MLP {size.mlp_hidden}; "
              f"{size.tokens} tokens per sample ({grid} of the input {list(shape)}{clip}){text}")
    return size, line


def _preset_name(model_cfg: dict) -> str:
    from hydra.core.hydra_config import HydraConfig

    try:
        return f"model={HydraConfig.get().runtime.choices['model']}"
    except (ValueError, KeyError):
        return model_cfg.get("_target_", "model")


# ---- settings ------------------------------------------------------------------------------------------------------


def _positive(setting: str, value, example: str, *, at_most: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0 \
            or (at_most is not None and value > at_most):
        bound = f" and at most {at_most}" if at_most is not None else ""
        raise ConfigError(f"{setting} must be a number above 0{bound}, got {value!r}; e.g. {setting}={example}")
    return float(value)


def _choice(setting: str, value, choices: tuple) -> None:
    """``value`` is one of ``choices`` and of its type (1 is not true, 0.0 not false)."""
    if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
        words = ("null" if c is None else str(c).lower() if isinstance(c, bool) else str(c) for c in choices)
        raise ConfigError(f"{setting} must be one of {' | '.join(words)}, got {value!r}")


def gpu_counts(cfg: DictConfig, fixed: dict[str, int]) -> tuple[int, int]:
    """(gpus, gpus_per_node) from the planner's names or train.py's (``trainer.devices`` per node x
    ``trainer.num_nodes``), which must agree where both are given; none given: as train.py, the product of the
    degrees when all three are ``fixed``, else 8. The ranks fill whole nodes, as train.py runs devices x num_nodes
    processes."""
    gpus, per_node = cfg.gpus, cfg.gpus_per_node
    devices, nodes = cfg.trainer.get("devices"), cfg.trainer.get("num_nodes")
    require_count("gpus", gpus, optional=True, hint="the GPUs to lay out, e.g. gpus=16")
    require_count("gpus_per_node", per_node, optional=True, hint="the GPUs of one node, e.g. gpus_per_node=8")
    require_count("trainer.devices", devices, optional=True, hint="the GPUs of one node, e.g. trainer.devices=8")
    require_count("trainer.num_nodes", nodes, optional=True, hint="e.g. trainer.num_nodes=2")
    if per_node is not None and devices is not None and per_node != devices:
        raise ConfigError(f"gpus_per_node={per_node} and trainer.devices={devices} both name the GPUs of one node; "
                          f"give one of them")
    per_node = per_node or devices
    if nodes is not None:
        if per_node is None:
            per_node = gpus // nodes if gpus and gpus % nodes == 0 else 8
        if gpus is not None and gpus != per_node * nodes:
            raise ConfigError(f"gpus={gpus} but {'trainer.devices' if devices else 'gpus_per_node'} x "
                              f"trainer.num_nodes = {per_node} x {nodes} = {per_node * nodes}; give gpus or "
                              f"trainer.num_nodes, not both")
        gpus = per_node * nodes
    gpus = gpus or devices or (math.prod(fixed.values()) if len(fixed) == len(DEGREES) else 8)
    per_node = per_node or min(gpus, 8)
    if gpus > per_node and gpus % per_node:
        below, above = gpus // per_node * per_node, -(-gpus // per_node) * per_node
        fits = [d for d in divisors(gpus) if d < per_node][-1]
        raise ConfigError(f"gpus={gpus} do not fill whole nodes of gpus_per_node={per_node} (train.py runs "
                          f"trainer.devices x trainer.num_nodes processes); use gpus={below} or gpus={above}, or "
                          f"gpus_per_node={fits}")
    return gpus, min(gpus, per_node)


def fixed_degrees(cfg: DictConfig) -> dict[str, int]:
    """The degrees the settings fix (train.py's names), each a positive integer; null ones are laid out."""
    fixed = {name: cfg.get(name) for name in DEGREES if cfg.get(name) is not None}
    for name, value in fixed.items():
        require_count(name, value, optional=True, hint=f"or null to lay out every {name}")
    check_strategy_degrees(cfg)
    return fixed


# the optimizers conf/optimizer/ holds: their states per trainable parameter, whether they are 8-bit
OPTIMIZERS = {"torch.optim.AdamW": (2, False), "ringdit.optimizers.adamw8bit": (2, True), "torch.optim.SGD": None}


def optimizer_states(cfg: DictConfig) -> tuple[int, tuple[bool, ...]]:
    """The optimizer's states per trainable parameter and the 8-bit choices to lay out, from ``optimizer=`` (train.py's
    group) or ``optimizer_states`` / ``optimizer_8bit``, which must agree with it where both are given."""
    states, eight_bit = cfg.optimizer_states, cfg.optimizer_8bit
    require_count("optimizer_states", states, minimum=0, optional=True,
                  hint="AdamW 2, SGD with momentum 1, SGD 0")
    _choice("optimizer_8bit", eight_bit, (None, True, False))
    optimizer = cfg.get("optimizer")
    if optimizer is None:
        return (2 if states is None else states), ((False, True) if eight_bit is None else (eight_bit,))
    target = optimizer.get("_target_")
    if target not in OPTIMIZERS:
        if states is None or eight_bit is None:
            raise ConfigError(f"optimizer._target_={target!r}: the planner knows the states of "
                              f"{', '.join(OPTIMIZERS)}; for another, give optimizer_states=N and optimizer_8bit=false")
        return states, (eight_bit,)
    momentum = optimizer.get("momentum", 0)
    require_number("optimizer.momentum", momentum, low=0)
    own_states, own_8bit = OPTIMIZERS[target] or ((1 if momentum else 0), False)
    for setting, given, own in (("optimizer_states", states, own_states), ("optimizer_8bit", eight_bit, own_8bit)):
        if given is not None and given != own:
            raise ConfigError(f"{setting}={str(given).lower()} but optimizer={_choice_name('optimizer', target)} "
                              f"keeps {own_states} states per parameter{' in 8 bits' if own_8bit else ''}; drop "
                              f"{setting}= (or choose another optimizer=)")
    return own_states, (own_8bit,)


def _choice_name(group: str, target: str) -> str:
    """The option ``group=...`` that was chosen (Hydra's record), else the class it names."""
    from hydra.core.hydra_config import HydraConfig

    try:
        return HydraConfig.get().runtime.choices[group]
    except (ValueError, KeyError):
        return target


def settings(cfg: DictConfig) -> tuple[Hardware, Layout, Setup, tuple[str, ...], tuple, dict[str, tuple],
                                       dict[str, int]]:
    """Every setting but the model's, checked: the hardware, the layout's settings (its degrees and strategy are
    filled in per candidate), the run's setup, the strategies and checkpointed shares to try, the other memory
    options' values to try and the degrees the settings fix (``candidates``)."""
    from ringdit.attention import list_backends
    from ringdit.dtypes import dtype_named
    from ringdit.lora import check_lora_settings, resolve_base_dtype
    from ringdit.models.checkpointing import checkpoint_fraction

    fixed = fixed_degrees(cfg)
    gpus, per_node = gpu_counts(cfg, fixed)
    memory = _positive("gpu_memory_gb", cfg.gpu_memory_gb, "80")
    usable = _positive("usable_memory", cfg.usable_memory, "0.9", at_most=1)
    hardware = Hardware(gpus=gpus, gpus_per_node=per_node, usable_bytes=memory * usable * GiB,
                        flops=_positive("gpu_tflops", cfg.gpu_tflops, "400") * 1e12,
                        intra_node=_positive("intra_node_gbps", cfg.intra_node_gbps, "150") * 1e9,
                        inter_node=_positive("inter_node_gbps", cfg.inter_node_gbps, "25") * 1e9,
                        host=_positive("host_gbps", cfg.host_gbps, "25") * 1e9)
    require_count("data.batch_size", cfg.data.batch_size, hint="samples per data-parallel rank, e.g. 1")
    require_count("data.text_len", cfg.data.text_len, optional=True, hint="text tokens per sample, e.g. 512")
    require_count("data.channels", cfg.data.channels, optional=True, hint="null takes the model's")
    require_count("data.num_classes", cfg.data.num_classes, hint="e.g. 1000")
    _choice("data.latent", cfg.data.latent, (True, False))
    strategy = cfg.trainer.strategy
    kind = strategy_kind(cfg.trainer) if "_target_" in strategy else None  # none selected: both are laid out
    checkpointing = cfg.model.get("activation_checkpointing")
    checkpointing = (0.0, 0.5, 1.0) if checkpointing is None else (checkpoint_fraction(checkpointing),)
    offload = cfg.model.get("activation_offload")
    _choice("model.activation_offload", offload, (None, True, False))
    states, eight_bit = optimizer_states(cfg)
    require_count("show", cfg.show, hint="rows of the table that fit (and as many that do not)")
    precision = str(cfg.trainer.precision)
    _choice("trainer.precision", precision, PRECISIONS)
    if str(cfg.trainer.get("accelerator", "gpu")) not in ("gpu", "cuda", "auto"):
        raise ConfigError(f"trainer.accelerator={cfg.trainer.accelerator}: the planner lays out GPUs; use "
                          f"trainer=gpu")
    _choice("trainer.strategy.cpu_offload", strategy.cpu_offload, (True, False))
    _choice("attention_backend", cfg.attention_backend, list_backends())
    if strategy.param_dtype is not None:
        dtype_named("trainer.strategy.param_dtype", strategy.param_dtype)
    base = cfg.lora.base_dtype
    if base is not None:
        resolve_base_dtype(base)
    replicate = strategy.replicate_degree
    require_count("trainer.strategy.replicate_degree", replicate, hint="1 shards over every GPU")
    if gpus % replicate:
        raise ConfigError(f"trainer.strategy.replicate_degree={replicate} does not divide gpus={gpus} (HSDP "
                          f"shards within gpus / replicate_degree ranks); use a divisor of {gpus}")
    decay = cfg.ema_decay
    if decay is not None and (isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay < 1):
        raise ConfigError(f"ema_decay must be a number in [0, 1) or null, got {decay!r}; null or 0 turns the EMA "
                          f"off, e.g. ema_decay=0.999")
    check_lora_settings(OmegaConf.to_container(cfg.lora, resolve=True))
    layout = Layout(devices=per_node, num_nodes=math.ceil(gpus / per_node), device_type="cuda",
                    attention_backend=cfg.attention_backend, replicate_degree=replicate,
                    cpu_offload=strategy.cpu_offload)
    distill_cfg = cfg.get("distill") or {}
    distill = distill_cfg.get("method", "none")
    _choice("distill", distill, DISTILL_METHODS)
    setup = Setup(batch_size=cfg.data.batch_size, param_dtype=strategy.param_dtype, precision=precision,
                  ema=bool(decay), lora_base_dtype=base or "bfloat16", optimizer_states=states,
                  distill=distill, gan_loss=bool(distill_cfg.get("gan_loss", False)),
                  gan_block=distill_cfg.get("gan_block"),
                  regression_pairs=(distill_cfg.get("regression_pairs") or 0) if distill_cfg.get("regression_loss")
                  else 0)
    strategies = (kind,) if kind else ("ddp", "fsdp")
    lora = (cfg.lora.rank or 0) > 0
    options = {
        "activation_offload": (False, True) if offload is None else (offload,),
        "lora_base_dtype": ("bfloat16", "float8_e4m3fn") if base is None and lora else (base or "bfloat16",),
        "optimizer_8bit": eight_bit,
    }
    return hardware, layout, setup, strategies, checkpointing, options, fixed


# ---- the table -----------------------------------------------------------------------------------------------------

HEADER = (f"{'dp':>4}{'ring':>5}{'uly':>5} {'strategy':<9}{'memory options':<40}|{'start GiB':>10}{'step GiB':>9}"
          f"{'state':>7}"
          f"{'acts':>7} |{'attn TFLOP':>11}{'ring GB':>9}{'uly GB':>8}{'sync GB':>9} |{'s/sample':>9}{'rel':>7}")


def _number(x: float) -> str:
    """Three digits or so, whatever the size: 321, 68.3, 0.042, 0."""
    return "0" if x == 0 else f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 0.1 else f"{x:.2g}"


def _count(n: int) -> str:
    """A parameter count: 14.29 B, 676.0 M, 2.0 M."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f} {unit}"
    return str(n)


def table_row(c: Candidate, reference: float) -> str:
    """One layout: its degrees, memory per rank (GiB), traffic (GB) and time per sample (and its ratio to
    ``reference``)."""
    s, lay, m, k = c.setup, c.layout, c.memory, c.cost
    memory = [(m.startup_bytes / GiB, 10), (m.step_bytes / GiB, 9), (m.state_bytes / GiB, 7),
              ((m.activation_bytes + m.attention_bytes) / GiB, 7)]
    traffic = [(k.attention_flops / 1e12, 11), (k.ring_bytes / 1e9, 9), (k.ulysses_bytes / 1e9, 8),
               (k.sync_bytes / 1e9, 9)]
    options = options_label(s).strip() or "-"
    return (f"{lay.dp_degree:>4}{lay.ring_degree:>5}{lay.ulysses_degree:>5} {lay.strategy:<9}{options:<40}|"
            + "".join(f"{_number(x):>{width}}" for x, width in memory) + " |"
            + "".join(f"{_number(x):>{width}}" for x, width in traffic) + " |"
            + f"{k.per_sample:>9.3g}{k.per_sample / reference:>6.2f}x")


def format_plan(found: list[Candidate], hardware: Hardware, layout: Layout, setup: Setup, model: ModelSize,
                model_line: str, show: int = 1000) -> str:
    """The plan as printed: the model and the settings, the ``show`` candidates that fit best (best first), the
    ``show`` nearest that do not, and the recommendation."""
    best, why = recommend(found, hardware)
    fitting = sorted((c for c in found if c.fits), key=preference)
    short = sorted((c for c in found if not c.fits), key=lambda c: c.memory.peak_bytes)
    reference = (best or min(found, key=preference)).cost.per_sample
    nodes = math.ceil(hardware.gpus / hardware.gpus_per_node)
    lines = [
        model_line,
        f"{hardware.gpus} GPUs on {nodes} node(s), {hardware.usable_bytes / GiB:.1f} GiB usable each; batch "
        f"{setup.batch_size} per dp rank, {setup.precision}, FSDP param_dtype {setup.param_dtype}, "
        f"{'EMA' if setup.ema else 'no EMA'}{', cpu_offload' if layout.cpu_offload else ''}"
        + ("; distill=dmd2: the student and a critic train, the teacher is frozen"
           if setup.frozen_models else ""),
        "memory per rank (state: weights, gradients, optimizer, EMA; acts: activations and attention); traffic sent "
        "per rank and step; rel: estimated time per sample / the recommended layout's",
        "",
        HEADER,
        *(table_row(c, reference) for c in fitting[:show]),
    ]
    if len(fitting) > show:
        lines.append(f"... and {len(fitting) - show} more that fit")
    if short:
        lines += ["", f"does not fit in {hardware.usable_bytes / GiB:.1f} GiB ({min(show, len(short))} nearest of "
                      f"{len(short)}):", *(table_row(c, reference) for c in short[:show])]
    return "\n".join([*lines, "", *why])


def train_command(best: Candidate, cfg: DictConfig) -> str:
    """train.py's command line for the candidate ``best`` of the plan of ``cfg``: its layout and memory options, and
    the plan's other settings, by train.py's names (the data and everything else are the run's own)."""
    lay, s = best.layout, best.setup
    words = ["python train.py", _preset_name(OmegaConf.to_container(cfg.model)), "trainer=gpu",
             f"trainer/strategy={lay.strategy}", f"dp_degree={lay.dp_degree}", f"ring_degree={lay.ring_degree}",
             f"ulysses_degree={lay.ulysses_degree}"]
    if lay.num_nodes > 1:  # train.py's default device count is every rank on one node
        words += [f"trainer.devices={lay.devices}", f"trainer.num_nodes={lay.num_nodes}"]
    if str(cfg.trainer.precision) != "bf16-mixed":  # trainer=gpu's
        words.append(f"trainer.precision={cfg.trainer.precision}")
    if lay.fsdp:
        strategy = cfg.trainer.strategy
        words += [f"trainer.strategy.param_dtype={strategy.param_dtype}"] if strategy.param_dtype else []
        words += [f"trainer.strategy.replicate_degree={lay.replicate_degree}"] if lay.replicate_degree > 1 else []
        words += ["trainer.strategy.cpu_offload=true"] if lay.cpu_offload else []
    if s.checkpoint_fraction:
        period = 1 / s.checkpoint_fraction
        value = "true" if period == 1 else f"every_{round(period)}" if period.is_integer() else \
            f"{s.checkpoint_fraction:g}"
        words.append(f"model.activation_checkpointing={value}")
        words += ["model.activation_offload=true"] if s.activation_offload else []
    if lay.attention_backend == "math":  # the others hold the same memory; train.py picks the best available
        words.append("attention_backend=math")
    words += optimizer_words(cfg, s)
    for key in ("diffusion.expert", "lora.rank", "lora.alpha", "lora.targets"):
        value = OmegaConf.select(cfg, key)
        if value not in (None, 0, "both"):
            words.append(f"{key}={value}")
    if (cfg.lora.rank or 0) > 0:
        words.append(f"lora.base_dtype={s.lora_base_dtype}")
    if s.distill != "none":
        words.append(f"distill={s.distill}")
    if not s.ema:
        words.append("ema_decay=null")
    return " ".join(words)


def optimizer_words(cfg: DictConfig, s: Setup) -> list[str]:
    """train.py's optimizer= for the plan's optimizer: the one chosen, else the one whose states were counted."""
    optimizer = cfg.get("optimizer")
    if optimizer is not None:
        name = _choice_name("optimizer", optimizer.get("_target_"))
        momentum = optimizer.get("momentum") if name == "sgd" else None
        return [f"optimizer={name}"] + ([f"optimizer.momentum={momentum}"] if momentum else [])
    if s.optimizer_8bit:
        return ["optimizer=adamw8bit"]
    return {0: ["optimizer=sgd"], 1: ["optimizer=sgd", "optimizer.momentum=0.9"]}.get(s.optimizer_states,
                                                                                       ["optimizer=adamw"])


_planned_preset: list[str] = []  # main's experiment=<name>, for the run line (Hydra composes the planner's own settings)


@hydra_main("plan")  # conf/plan.yaml
def plan(cfg: DictConfig) -> None:
    with user_errors():  # a wrong setting: one line, exit code 2
        hardware, layout, setup, strategies, checkpointing, options, fixed = settings(cfg)
        size, model_line = planned_model(cfg)
        check_fixed_degrees(size, hardware.gpus, fixed)
        found = candidates(size, layout, setup, hardware, strategies, checkpointing, options, fixed)
    print(format_plan(found, hardware, layout, setup, size, model_line, cfg.show))
    best, _ = recommend(found, hardware)
    if best is not None:
        if _planned_preset:  # the preset's command, and whether its own layout is the one recommended
            from ringdit.plan_preset import preset_overrides, preset_run_line

            print(preset_run_line(_planned_preset[0], preset_overrides(_planned_preset[0])[1], best))
        else:
            print(f"Run it: {train_command(best, cfg)} (with the run's data=...)")
        from ringdit.previews import planned_preview_line  # here: ringdit.previews reads the memory, not the plan

        print(planned_preview_line(cfg, best.layout, best.setup, size, hardware))


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (default ``sys.argv[1:]``); its exit code: 0, or 2 for a settings mistake.
    ``experiment=<preset>``: train.py's preset, its settings laid out (``ringdit.plan_preset``)."""
    from ringdit.plan_preset import expand_experiment

    try:
        with user_errors():
            argv, preset = expand_experiment(sys.argv[1:] if argv is None else list(argv))
        _planned_preset[:] = [preset] if preset else []
        plan(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
