"""What a training run's previews (``callbacks.sample_grid``) cost on its layout, counted before the run starts: the
memory of one micro-batch's sampling beside the training state that stays on the device, and the seconds a preview
takes by the planner's step-time model (``ringdit.plan.search.step_cost``). train.py refuses a preview that cannot
fit, naming the setting, and says what one costs."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from omegaconf import OmegaConf

from ringdit.commands.cli import CONF_DIR
from ringdit.common.errors import ConfigError
from ringdit.costs.step_time import Machine, step_time
from ringdit.diffusion.samplers import is_guided
from ringdit.parallel.layout import Layout
from ringdit.costs import GiB, ModelSize, Setup, available_memory, estimate_memory, model_size
from ringdit.costs.model_size import sequence_streams
from ringdit.models.conditioning import text_conditioned

log = logging.getLogger("ringdit.costs.previews")
SETTING = "callbacks.sample_grid"


@dataclass(frozen=True)
class Preview:
    """One preview's work: every rank samples every sample (the model is sharded across them)."""

    samples: int      # rows (classes, held-out prompts or prompt lines) x per_class
    batch: int        # samples per forward: the micro-batch (batch_size; None: all)
    tokens: int       # model tokens of its largest sample
    steps: int        # sampler steps
    guided: bool      # both halves of classifier-free guidance in each forward (not CFG-parallel)

    @property
    def rows(self) -> int:
        """Rows of one forward."""
        return self.batch * (2 if self.guided else 1)

    @property
    def forwards(self) -> int:
        return math.ceil(self.samples / self.batch) * self.steps


def preview_peak_bytes(model: ModelSize, layout: Layout, setup: Setup, preview: Preview) -> int:
    """Bytes per rank while a preview samples: the training state (weights, gradients -- counted, though set to None
    between steps: a bound --, optimizer state, EMA, DDP's buckets) and one micro-batch's sampling forward (FSDP's
    gathered blocks, activations, attention) at the preview's tokens."""
    training = estimate_memory(model, layout, setup)
    sampling = estimate_memory(replace(model, tokens=preview.tokens), layout,
                               replace(setup, training=False, batch_size=preview.rows))
    return (training.state_bytes + training.bucket_bytes + sampling.gathered_bytes + sampling.activation_bytes
            + sampling.attention_bytes)


def preview_seconds(model: ModelSize, layout: Layout, setup: Setup, preview: Preview, machine=None) -> float:
    """Seconds one preview's sampling takes on ``layout`` by the planner's step-time model (``ringdit.costs.step_time``,
    what ``python -m ringdit.plan`` ranks layouts with: a sampling forward of one micro-batch, times the forwards);
    ``machine``: its GPUs (default conf/plan.yaml's). Not ``ringdit.plan`` itself: it imports the specs, which
    import this."""
    timed = step_time(replace(model, tokens=preview.tokens), layout,
                      replace(setup, training=False, batch_size=preview.batch, activation_checkpointing=False),
                      machine or default_machine(layout), forwards=2 if preview.guided else 1)
    return timed.seconds * preview.forwards


def default_machine(layout: Layout):
    """The planner's GPUs (conf/plan.yaml's numbers), ``layout``'s devices to a node."""
    conf = OmegaConf.load(CONF_DIR / "plan.yaml")
    return Machine(gpus_per_node=layout.devices, matmul_flops=conf.gpu_tflops * 1e12,
                   intra_node=conf.intra_node_gbps * 1e9, inter_node=conf.inter_node_gbps * 1e9,
                   host=conf.host_gbps * 1e9)


def planned_preview(grid: dict, *, rows: int, tokens: int, sampling: dict, cfg_parallel: bool) -> Preview:
    """The ``Preview`` of a ``callbacks.sample_grid`` config: ``rows`` classes / prompts, its largest sample's
    ``tokens``, the run's ``sampling`` settings under the grid's own steps / cfg_scale."""
    samples = rows * grid.get("per_class", 8)
    settings = {**sampling, **{k: grid[k] for k in ("steps", "cfg_scale") if grid.get(k) is not None}}
    return Preview(samples=samples, batch=min(grid.get("batch_size") or samples, samples), tokens=tokens,
                   steps=settings.get("steps") or 50, guided=is_guided(settings) and not cfg_parallel)


def largest_batch(model: ModelSize, layout: Layout, setup: Setup, preview: Preview, available: int) -> int:
    """The largest micro-batch below ``preview.batch`` whose preview fits in ``available`` bytes (the peak grows
    with it: a bisection); 0 if not even one sample does."""
    low, high = 0, preview.batch - 1
    while low < high:
        middle = (low + high + 1) // 2
        if preview_peak_bytes(model, layout, setup, replace(preview, batch=middle)) <= available:
            low = middle
        else:
            high = middle - 1
    return low


def check_preview(setup: Setup, lora: dict | None, layout: Layout, model_cfg: dict, meta_model, *, grid: dict,
                  rows: int, tokens: int, sampling: dict) -> Preview | None:
    """train.py's previews against the memory its ranks have: a ConfigError naming ``callbacks.sample_grid.batch_size``
    (and the value that fits) when a preview would not fit where a training step does; then one line with the preview's
    memory and its seconds on this layout (the planner's GPU). None: no previews, or a model kind without sizes."""
    size = model_size(model_cfg, meta_model, lora)
    if size is None or not grid:
        return None
    preview = planned_preview(grid, rows=rows, tokens=tokens, sampling=sampling, cfg_parallel=layout.cfg_parallel)
    peak = preview_peak_bytes(size, layout, setup, preview)
    cpu = layout.device_type == "cpu"
    available = available_memory(layout.device_type, layout.devices if cpu else 1)
    step = estimate_memory(size, layout, setup).peak_bytes
    if available is not None and peak > available >= step:  # the preview, not the training, is what does not fit
        fits = largest_batch(size, layout, setup, preview, int(0.8 * available))  # a fifth spare: it is an estimate
        fix = (f"set {SETTING}.batch_size={fits}" if fits else
               f"even one sample a forward does not fit: lower {SETTING}.size / frames, or drop the previews "
               f"(~callbacks.sample_grid)")
        given = grid.get("batch_size")
        raise ConfigError(f"{SETTING}.batch_size={'null' if given is None else given}: a preview forward of {preview.rows} rows x "
                          f"{preview.tokens} tokens needs about {peak / GiB:.1f} GiB per rank beside the training "
                          f"state, but {available / GiB:.1f} GiB is available; {fix}")
    seconds = preview_seconds(size, layout, setup, preview)
    log.info("previews: %d samples every %s steps, %d a forward%s, %d steps: about %.1f GiB per rank, ~%.0f s each on "
             "this layout (the planner's GPU, python -m ringdit.plan)", preview.samples, grid.get("every_n_steps"),
             preview.batch, " (x2: guidance)" if preview.guided else "", preview.steps, peak / GiB, seconds)
    return preview


def sample_tokens(meta_model, shape: tuple[int, ...]) -> int:
    """Tokens of one sample of latent ``shape`` ([T,] H, W) in the sequence the model's plan splits, as the planner
    counts them (``model_size``): the grid's and, at that grid, each stream packed into the same sequence
    (``Family.stream_tokens``: Qwen-Image-Edit's reference image, as many tokens as the image's). A stream through
    blocks of its own (Wan VACE's control video) is counted where the planner counts it: in the model's depth."""
    grid = tuple(s // p for s, p in zip(shape, meta_model.patch_shape))
    streams = meta_model.stream_tokens_at(grid)  # {stream: tokens} at that grid (the DiT: none)
    # the streams the plan packs after the tokens, and those the model's forward packs itself (MiniMax-H3's audio
    # rows): the planner's sequence streams
    return math.prod(grid) + sum(streams.get(name, 0) for name in sequence_streams(meta_model))


def check_run_previews(setup: Setup, lora: dict | None, layout: Layout, callbacks: tuple[dict, ...], data_info: dict,
                       model_cfg: dict, meta_model, default_tokens: int, sampling: dict) -> Preview | None:
    """``check_preview`` for train.py's ``setup`` (``TrainSpec.memory``), ``lora`` settings and ``callbacks`` (the ``SampleGrid`` among them, its shapes checked against the
    data by ``check_shape``): its rows and its largest sample's tokens (``sample_tokens``: the streams the planner
    counts with the grid's)."""
    import hydra

    for config in callbacks:
        if not str(config.get("_target_", "")).endswith("SampleGrid"):
            continue
        grid = hydra.utils.instantiate(config)
        grid.check_shape(data_info, tuple(meta_model.patch_shape))
        rows = len(grid.lines[:grid.max_classes]) if grid.lines is not None else grid.max_classes \
            if text_conditioned(data_info) else min(data_info.get("num_classes") or 1, grid.max_classes)
        # the grid's sizes, else the data's (what the grid samples at)
        shapes = [shape for shape in (grid.shape, *grid.line_shapes) if shape] or \
            [tuple(data_info["image_size"])] * bool(data_info.get("image_size"))
        tokens = max((sample_tokens(meta_model, shape) for shape in shapes), default=default_tokens)
        return check_preview(setup, lora, layout, model_cfg, meta_model, grid=config, rows=rows, tokens=tokens,
                             sampling=sampling)
    return None


def planned_preview_line(cfg, layout: Layout, setup: Setup, model: ModelSize, hardware) -> str:
    """``python -m ringdit.plan``'s line for the previews on the recommended ``layout``: train.py's default
    ``callbacks.sample_grid`` under the plan's ``+callbacks.sample_grid.*`` (rows: ``max_classes``, at the planned
    sample's tokens) and ``+diffusion.sampling.*`` (default: 50 guided steps) -- their memory beside the training
    state and their seconds (``hardware``: the plan's GPUs)."""
    given = OmegaConf.select(cfg, "callbacks.sample_grid", default=None) or {}
    grid = {**OmegaConf.to_container(OmegaConf.load(CONF_DIR / "callbacks" / "default.yaml").sample_grid),
            **(OmegaConf.to_container(given, resolve=True) if given else {})}
    sampling = OmegaConf.select(cfg, "diffusion.sampling", default=None)
    sampling = {"steps": 50, "cfg_scale": 5.0, **(OmegaConf.to_container(sampling) if sampling else {})}
    preview = planned_preview(grid, rows=grid["max_classes"], tokens=model.tokens, sampling=sampling,
                              cfg_parallel=False)
    peak = preview_peak_bytes(model, layout, setup, preview)
    machine = Machine(gpus_per_node=hardware.gpus_per_node, matmul_flops=hardware.flops,
                      intra_node=hardware.intra_node, inter_node=hardware.inter_node, host=hardware.host)
    seconds = preview_seconds(model, layout, setup, preview, machine)
    fits = largest_batch(model, layout, setup, preview, int(hardware.usable_bytes)) if peak > hardware.usable_bytes \
        else preview.batch
    verdict = "fits" if fits == preview.batch else \
        f"does not fit: +{SETTING}.batch_size={fits} does" if fits else "does not fit even one sample a forward"
    return (f"Previews ({SETTING}: {preview.samples} samples, {preview.batch} a forward"
            f"{' x2 (guidance)' if preview.guided else ''}, {preview.steps} steps): about {peak / GiB:.1f} GiB per "
            f"rank with the training state, {verdict}; ~{seconds:.0f} s each on this layout")
