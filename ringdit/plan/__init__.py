"""Plan a training run's layout: which (dp, ring, ulysses, strategy) and memory options -- activation checkpointing
of all, half or none of the blocks, their inputs offloaded to CPU memory, an fp8 LoRA base, 8-bit optimizer states --
fit the GPUs, and which of those costs least.

    python -m ringdit.plan model=wan_14b data.frames=81 data.size=[480,832] gpus=16 gpu_memory_gb=80
    python -m ringdit.plan model=flux_dev data.size=1024 gpus=8 lora.rank=64
    python -m ringdit.plan model=dit_xl data.size=512 gpus=4 trainer/strategy=ddp ema_decay=null

For every layout of ``gpus`` ranks (dp x ring x ulysses = gpus, Ulysses up to the heads, ring x ulysses no more
than the tokens) it prints the estimated peak memory per rank at start-up and during a step (``ringdit.costs``: what
it models is in its docstring), the attention TFLOPs per rank and step, the GB each rank sends per step for ring,
Ulysses and the parameter / gradient sync, and an estimated time per sample relative to the best layout that fits;
then the layout it recommends, and why. Only the model is built, on the meta device; nothing is downloaded. A setting
left null (``trainer/strategy``, ``model.activation_checkpointing``, ``model.activation_offload``,
``lora.base_dtype``, ``optimizer_8bit``) is searched over: every combination is a candidate, and the table shows the
``show`` best that fit and the ``show`` nearest that do not; the last line is train.py's command for the recommended
one (the settings carry train.py's names). Each candidate is a ``ringdit.parallel.layout.Layout`` (what train.py checks once and
runs); ``distill=dmd2`` counts DMD2's three models in the memory (``ringdit.costs``), while the cost below stays one
model's step.

The time per sample is ``ringdit.costs.step_time``'s model of one step on one rank (its docstring has each term): matmuls
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

import sys

from omegaconf import DictConfig

from ringdit.commands.cli import user_errors
from ringdit.commands.task import Task, command
from ringdit.plan.preset import expand_experiment, preset_overrides, preset_run_line
from ringdit.plan.report import format_plan, recommend, train_command
from ringdit.plan.search import candidates, check_fixed_degrees
from ringdit.plan.planner_settings import settings
from ringdit.plan.shapes import planned_model
from ringdit.costs.previews import planned_preview_line

_planned_preset: list[str] = []  # main's experiment=<name>, for the run line (Hydra composes the planner's own settings)


@command("plan", doing="planning")  # conf/plan.yaml; SIGTERM stops it where it is: nothing is written
def plan(cfg: DictConfig, task: Task) -> None:
    hardware, layout, setup, strategies, checkpointing, options, fixed = settings(cfg)
    size, model_line = planned_model(cfg)
    check_fixed_degrees(size, hardware.gpus, fixed)
    found = candidates(size, layout, setup, hardware, strategies, checkpointing, options, fixed)
    task.start()
    print(format_plan(found, hardware, layout, setup, size, model_line, cfg.show))
    best, _ = recommend(found, hardware)
    if best is not None:
        if _planned_preset:  # the preset's command, and whether its own layout is the one recommended
            print(preset_run_line(_planned_preset[0], preset_overrides(_planned_preset[0])[1], best))
        else:
            print(f"Run it: {train_command(best, cfg)} (with the run's data=...)")
        print(planned_preview_line(cfg, best.layout, best.setup, size, hardware))


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (default ``sys.argv[1:]``); its exit code: 0, or 2 for a settings mistake.
    ``experiment=<preset>``: train.py's preset, its settings laid out (``ringdit.plan.preset``)."""
    try:
        with user_errors():
            argv, preset = expand_experiment(sys.argv[1:] if argv is None else list(argv))
        _planned_preset[:] = [preset] if preset else []
        plan(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    return 0
