"""The plan as printed: the recommended layout and why, the table of candidates (memory, traffic, time per sample)
and train.py's command line for the one recommended."""

from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf

from ringdit.parallel.heads import head_counts, head_imbalance
from ringdit.parallel.layout import Layout
from ringdit.costs import FLOAT8, GiB, ModelSize, Setup
from ringdit.plan.search import Candidate, Hardware, options_label, preference
from ringdit.plan.planner_settings import choice_name, preset_name

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


# ---- the table -----------------------------------------------------------------------------------------------------

HEADER = (f"{'dp':>4}{'ring':>5}{'uly':>5} {'strategy':<9}{'memory options':<40}|{'start GiB':>10}{'step GiB':>9}"
          f"{'state':>7}"
          f"{'acts':>7} |{'attn TFLOP':>11}{'ring GB':>9}{'uly GB':>8}{'sync GB':>9} |{'s/sample':>9}{'rel':>7}")


def _number(x: float) -> str:
    """Three digits or so, whatever the size: 321, 68.3, 0.042, 0."""
    return "0" if x == 0 else f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 0.1 else f"{x:.2g}"


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
    return "\n".join([*lines, "", *why, *uneven_heads_lines(fitting[:show] + short[:show], model.num_heads)])


def uneven_heads_lines(listed: list[Candidate], heads: int) -> list[str]:
    """One line per Ulysses degree of the listed layouts that does not divide the heads: how it places them and how
    much longer its attention takes than an even split (``head_imbalance``, which the time per sample counts)."""
    lines = []
    for degree in sorted({c.layout.ulysses_degree for c in listed if heads % c.layout.ulysses_degree}):
        counts = head_counts(heads, degree)
        more, fewer = max(counts), min(counts)
        lines.append(f"Uneven heads: ulysses={degree} places the {heads} heads {counts.count(more)} ranks x {more} + "
                     f"{counts.count(fewer)} x {fewer}; its attention takes {head_imbalance(heads, degree):.2f}x an "
                     f"even split's (counted in s/sample)")
    return lines


def train_command(best: Candidate, cfg: DictConfig) -> str:
    """train.py's command line for the candidate ``best`` of the plan of ``cfg``: its layout and memory options, and
    the plan's other settings, by train.py's names (the data and everything else are the run's own)."""
    lay, s = best.layout, best.setup
    words = ["python train.py", preset_name(OmegaConf.to_container(cfg.model)), "trainer=gpu",
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
        name = choice_name("optimizer", optimizer.get("_target_"))
        momentum = optimizer.get("momentum") if name == "sgd" else None
        return [f"optimizer={name}"] + ([f"optimizer.momentum={momentum}"] if momentum else [])
    if s.optimizer_8bit:
        return ["optimizer=adamw8bit"]
    return {0: ["optimizer=sgd"], 1: ["optimizer=sgd", "optimizer.momentum=0.9"]}.get(s.optimizer_states,
                                                                                       ["optimizer=adamw"])
