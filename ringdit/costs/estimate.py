"""The memory one rank needs, estimated before anything is spawned: train.py's warning, ``python -m ringdit.plan``.

A run far too big for the machine does not fail: it swaps, or sits at step 0 until the out-of-memory killer comes.
``warn_if_memory_short`` says so in one log line, with a layout that would fit. It is an estimate, meant to catch
settings that are 2x off and to rank layouts, not to plan the last gigabyte. What it models, per rank, in bytes --
the names are ``MemoryEstimate``'s fields, so a measured table can be compared term by term (on CPU ranks: the
peak RSS minus the process's baseline against ``peak_bytes``; ``startup_bytes`` and ``step_bytes`` apart).
The estimate reads the run's ``ringdit.parallel.layout.Layout`` (the ranks, the strategy, how and where it shards: the one
model of the layout, which train.py checks once and the planner builds per candidate) and a ``Setup`` (the rest:
batch, precision, memory options, optimizer, what trains). P = parameters, T = trainable parameters (all of them;
under LoRA only the adapters), w = bytes of a weight (4; 2 under ``*16-true`` precision), n = the ranks one parameter
is sharded over (``Layout.shard_degree``; DDP: 1; FSDP: world / ``replicate_degree``), S = tokens per sample, D =
hidden size, F = the MLP's inner width, L = depth, B = batch per data-parallel rank, a = bytes of an activation (2
under 16-bit precision, else 4), M = the models that train (1; DMD2: 2, below):

- ``weights_bytes``: P x w / n; under LoRA the frozen Linear / Conv weights in ``lora.base_dtype`` (2 bytes for
  bfloat16; the rest of the base -- norms, embedding and modulation tables -- keeps w) plus the adapters (for each
  targeted Linear (in, out): rank x (in + out) parameters) in w; an fp8 base (``float8_e4m3fn`` / ``float8_e5m2``):
  the blocks' Linear weights 1 byte each plus a 4-byte scale per output row, the other Linear / Conv weights and
  every bias 2 bytes (``ringdit.models.fp8.hold_in_float8``);
  DMD2 (``distill=dmd2``) holds three models: M = 2 of them as above (the student and the critic, LoRA-adapted
  alike), plus the frozen teacher, built whole without LoRA, P x w / n;
- ``gradient_bytes``: M x T x w / n (DMD2: the critic's stay allocated while the student's update runs);
  ``optimizer_bytes``: AdamW's two moments, 2 x M x T x w / n; 8-bit states (``optimizer=adamw8bit``): 1 byte a value
  plus a 4-byte scale per block of 256 (``ringdit.training.optimizers``);
- ``ema_bytes``: T x w / n when ``ema_decay`` is on (under LoRA the EMA tracks only the adapters; DMD2: the
  student's only);
- ``bucket_bytes`` (DDP): its gradient all-reduce buckets, a second copy of the gradients, M x T x w (DMD2: DDP
  wraps the student and the critic together);
- ``gathered_bytes`` (FSDP): the all-gathered parameters in flight -- the root module's (not resharded) and two
  blocks' (the current one and the prefetched next), in ``param_dtype`` (else their own dtype) -- plus one block's
  unsharded gradient before its reduce-scatter;
- ``activation_bytes``: what backward needs, about 10 x D + 2 x F values per token per block (norm and modulation
  inputs, q, k, v, attention output, projection, residuals, the MLP's hidden layer before and after its activation);
  a full fine-tune keeps besides what only the weights' gradients need: the normalized inputs adaLN's two scales
  multiply and the branch outputs its two gates multiply (4 x D), and the inputs of the Linears LoRA's default
  targets leave out (frozen, such a Linear keeps none; Wan's feed-forward: D + F). The peak is in backward's first
  (the last) block: it holds all of its activations (kept, or recomputed when checkpointed) while every earlier block
  keeps its input (D, when checkpointed: ``model.activation_checkpointing`` picks ceil(f x L) blocks spread evenly,
  f = 1, a fraction, or 1 / N for every_N) or all of its activations; with ``activation_offload`` the earlier
  checkpointed inputs are in host memory (``host_bytes``) but one, in flight. Backward's working set there adds the
  gradient of the MLP's hidden layer before and after its activation (2 x F); a full fine-tune under DDP also one
  weight's gradient, computed whole before it is added to ``.grad`` (the largest parameter, w bytes). One block's
  worth when sampling; an fp8 base adds its largest block Linear weight cast up to the compute dtype. DMD2's step
  runs one model's backward at a time (the critic's updates, then the student's through its one trained simulated
  step), and the teacher's and critic's forwards of the matching loss run without gradient while the student keeps
  its activations, each holding one block's worth, less than backward's working set: the same term; but with its
  GAN head (``distill.gan_loss``) the critic's update also keeps its two forwards of real and generated images
  through the blocks up to the one the head reads (``distill.gan_block``, default the middle one: L // 2 + 1 blocks,
  each keeping what it keeps above) until its backward, and the student's update the frozen critic's forward through
  them (the head's own parameters, a per-token projection, are not counted); with the regression loss
  (``distill.regression_loss``) the student's update also keeps its forward of the ``distill.regression_pairs``
  teacher pairs, one batch of them (the pairs themselves, noise and sample each, are not counted); the larger of the
  two updates is the peak. Tokens per rank: S / (ring x ulysses), rounded up, plus as much of the text of joint
  attention (Flux, QwenImage), which is sharded like the image;
- ``attention_bytes``: per ring hop, after the Ulysses exchange (S / ring tokens of D / ulysses values): q, k, v,
  output and the K/V block in flight, 6 x B x S / ring x D / ulysses x a; the ``math`` backend also materialises the
  (S / ring)^2 score and probability matrices per head in fp32 (and their gradients when training);
- ``startup_bytes``: the peak while the model is built and loaded, before the first step. FSDP builds on the meta
  device and materialises only this rank's shards (weights and EMA, / n) plus one full parameter at a time for its
  random init or loading: the largest single tensor, in fp32. DDP holds the whole model (the base in its dtype under
  LoRA) and a whole EMA copy, plus that one tensor in flight; under DMD2 the three models' weights;
- ``host_bytes``: under FSDP's ``cpu_offload`` the sharded weights, gradients, optimizer state and EMA live in CPU
  memory, and the checkpointed blocks' inputs under ``activation_offload``: counted here, not on the device.

The step's peak (``step_bytes``) is the sum of the device terms; the rank's peak (``peak_bytes``) is the larger of
start-up and step. Not modelled: the CUDA context and NCCL buffers, allocator fragmentation (on CPU ranks glibc's
heap keeps freed activations resident unless its mmap threshold is fixed, e.g. ``MALLOC_MMAP_THRESHOLD_=131072``),
torch.compile's graphs and generated code (host memory: torchao's 8-bit step compiles one graph per trained shape),
the data loader, the optimizer's temporaries, cross-attention to text (Wan's, small beside self-attention).

``estimate_model_memory(config, ...)`` gives the estimate for a built-config, so a benchmark can print it beside
the peak it measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ringdit.diffusion.distillation import DISTILL_METHODS  # re-exported: the planner checks distill= with it
from ringdit.parallel.layout import Layout
from ringdit.models.checkpointing import checkpointed_blocks
from ringdit.parallel.heads import head_counts

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}
FLOAT8 = ("float8_e4m3fn", "float8_e5m2")
STATE_BLOCK = 256  # values per fp32 scale of an 8-bit optimizer state (conf/optimizer/adamw8bit.yaml)


# ---- what the estimate reads: the model's sizes and the run's setup --------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    """What the estimate needs of a model: its sizes, never its weights (read from the model built on meta)."""

    parameters: int            # P: every parameter (elements), before LoRA
    trainable_parameters: int  # of those, the ones a full fine-tune trains (a DiT's frozen pos_embed is not)
    largest_parameter: int     # elements of the largest single tensor: start-up materialises one at a time
    root_parameters: int       # outside the repeated blocks (embeddings, output layer): FSDP's root unit
    block_parameters: int      # the largest repeated block: FSDP's unit of all-gather
    hidden_size: int           # D
    depth: int                 # L: repeated blocks a forward runs (Flux: dual- and single-stream together; two
                               # experts: one expert's)
    num_heads: int             # H: attention heads (Ulysses splits them)
    mlp_hidden: int            # F: the MLP's inner width (DiT: mlp_ratio x D; Wan: ffn_dim)
    tokens: int                # S: tokens per sample, the sequence ring x ulysses split (with the streams packed
                               # after the patch tokens: Qwen-Image-Edit's reference image)
    text_tokens: int = 0       # joint attention's text tokens (Flux, QwenImage), sharded with the image
    lora_parameters: int = 0   # the adapters the run's lora settings add; 0: no LoRA
    lora_base_parameters: int = 0  # the Linear / Conv weights: what lora.base_dtype casts
    float8_parameters: int = 0     # of those, the blocks' Linear weights (no biases): what an fp8 base holds in fp8
    float8_rows: int = 0           # their output rows: one fp32 scale each
    float8_largest: int = 0        # the largest of those weights: cast up while its layer computes
    untargeted_linear_inputs: int = 0  # values per token (a block's, on average): the inputs of the blocks' Linears
                                       # outside the model's default LoRA targets, kept when their weights train
    # (stream, tokens per sample) of each stream the attention sees beside the patch tokens (the model's
    # ``stream_tokens``): a packed one is in ``tokens``; another runs through blocks of its own, counted in ``depth``
    # (Wan VACE's control video, as many tokens as the video's)
    stream_tokens: tuple[tuple[str, int], ...] = ()

    @property
    def lora(self) -> bool:
        return self.lora_parameters > 0


@dataclass(frozen=True)
class Setup:
    """What, besides the model and its ``Layout`` (the ranks, the strategy and where it holds the sharded state),
    decides a rank's memory: the batch, the precision, the memory options, the optimizer and what trains."""

    batch_size: int = 1                # samples per data-parallel rank and step
    param_dtype: str | None = None     # FSDP: the dtype blocks are gathered and computed in; None: their own
    precision: str = "32-true"         # trainer.precision
    activation_checkpointing: bool | float = False  # the share of the blocks checkpointed (true: 1)
    activation_offload: bool = False   # the checkpointed blocks' inputs in host memory (CUDA)
    ema: bool = True
    lora_base_dtype: str = "float32"   # the frozen base under LoRA (ModelSize.lora_parameters > 0)
    optimizer_states: int = 2          # tensors per trainable parameter: AdamW 2, SGD with momentum 1, SGD 0
    optimizer_8bit: bool = False       # the states in 8 bits with block scales (optimizer=adamw8bit)
    training: bool = True              # False: sampling (no gradients, optimizer, EMA; nothing kept for backward)
    distill: str = "none"              # dmd2: a trained critic and a frozen teacher beside the model (the student)
    gan_loss: bool = False             # dmd2's GAN head: two more critic forwards in each critic update
    gan_block: int | None = None       # the critic block the head reads (negative from the end); None: the middle one
    regression_pairs: int = 0          # dmd2's regression loss: the teacher pairs the student's update runs; 0: off

    def __post_init__(self):
        for name, value in (("param_dtype", self.param_dtype), ("lora_base_dtype", self.lora_base_dtype)):
            if value not in DTYPE_BYTES and not (name == "param_dtype" and value is None):
                raise ValueError(f"{name} must be one of {', '.join(DTYPE_BYTES)}, got {value!r}")
        if self.distill not in DISTILL_METHODS:
            raise ValueError(f"distill must be one of {' | '.join(DISTILL_METHODS)}, got {self.distill!r}")

    @property
    def checkpoint_fraction(self) -> float:
        return float(self.activation_checkpointing)

    @property
    def state_bytes(self) -> float:
        """Bytes of one optimizer state value."""
        return 1 + 4 / STATE_BLOCK if self.optimizer_8bit else self.weight_bytes

    @property
    def weight_bytes(self) -> int:
        """Bytes of a weight (and its gradient, moments, EMA): Lightning's ``*-true`` precisions cast the model."""
        return 8 if "64" in self.precision else 2 if "16-true" in self.precision else 4

    @property
    def activation_bytes(self) -> int:
        """Bytes of an activation: 16-bit under ``bf16-mixed`` / ``16-mixed`` autocast and ``*16-true``."""
        return 8 if "64" in self.precision else 2 if "16" in self.precision else 4

    @property
    def trained_models(self) -> int:
        """Models whose weights train, each with its gradients and optimizer state: the model; under DMD2 the student
        and the critic."""
        return 2 if self.training and self.distill in ("dmd2", "rcm") else 1  # sCM trains no critic

    @property
    def frozen_models(self) -> int:
        """Whole models held beside them without gradients: DMD2's teacher."""
        return 1 if self.training and self.distill != "none" else 0


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds, by term (the module docstring says what each is)."""

    tokens_per_rank: int
    weights_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    ema_bytes: int
    bucket_bytes: int
    gathered_bytes: int
    activation_bytes: int
    attention_bytes: int
    startup_bytes: int
    host_bytes: int

    STEP_TERMS = ("weights", "gradient", "optimizer", "ema", "bucket", "gathered", "activation", "attention")

    @property
    def state_bytes(self) -> int:
        """The training state on the device: weights, gradients, optimizer state, EMA."""
        return self.weights_bytes + self.gradient_bytes + self.optimizer_bytes + self.ema_bytes

    @property
    def step_bytes(self) -> int:
        return sum(getattr(self, f"{term}_bytes") for term in self.STEP_TERMS)

    @property
    def peak_bytes(self) -> int:
        return max(self.startup_bytes, self.step_bytes)

    total_bytes = peak_bytes  # the name the warning and older callers read

    def terms(self) -> dict[str, int]:
        """Every byte field by name (``weights``, ..., ``startup``, ``host``), for tables."""
        return {f.name.removesuffix("_bytes"): getattr(self, f.name) for f in fields(self) if f.name.endswith("_bytes")}


# ---- the estimate ------------------------------------------------------------------------------------------------


def estimate_memory(model: ModelSize, layout: Layout, setup: Setup = Setup()) -> MemoryEstimate:
    """The estimate described in the module docstring, in bytes per rank, of ``model`` laid out as ``layout``."""
    n, w, a, B = layout.shard_degree, setup.weight_bytes, setup.activation_bytes, setup.batch_size
    training, fsdp = setup.training, layout.fsdp
    trainable = model.lora_parameters if model.lora else model.trainable_parameters
    trained, frozen = setup.trained_models, setup.frozen_models  # DMD2: the student and the critic; the teacher
    # the training state, this rank's share of it
    weights = (trained * model_bytes(model, setup) + frozen * model.parameters * w) // n
    gradients = trained * trainable * w // n if training else 0
    optimizer = int(setup.optimizer_states * trained * trainable * setup.state_bytes) // n if training else 0
    ema = trainable * w // n if training and setup.ema else 0
    buckets = trained * trainable * w if training and not fsdp else 0
    gathered = 0
    if fsdp:
        in_flight_blocks = model.root_parameters + 2 * model.block_parameters
        gathered = int(in_flight_blocks * gathered_bytes_per_parameter(model, setup))
        if training and not model.lora:  # one block's unsharded gradient, before its reduce-scatter
            gathered += model.block_parameters * w
    # activations kept for backward, on this rank's tokens
    tokens_per_rank = math.ceil(model.tokens / layout.sp_degree) + math.ceil(model.text_tokens / layout.sp_degree)
    D, F = model.hidden_size, model.mlp_hidden
    per_block = 10 * D + 2 * F  # values kept per token by one block
    if training and not model.lora:  # the weights train: their gradients also need adaLN's normalized inputs (its two
        # scales multiply them), the branch outputs its two gates multiply, and the Linears' inputs that LoRA's
        # targets leave out (frozen, a Linear keeps none)
        per_block += 4 * D + model.untargeted_linear_inputs
    blocks = checkpointed_blocks(model.depth, setup.checkpoint_fraction) if training else []
    offloaded = sum(blocks) * D if setup.activation_offload else 0  # checkpointed block inputs in host memory
    if not training:
        per_token = per_block
    else:  # backward runs the last block first; while it does, every earlier block still keeps its input (checkpointed)
        # or all of its activations, and the last block holds all of its own (kept, or recomputed): the peak
        per_token = per_block + sum(D if checkpointed else per_block for checkpointed in blocks[:-1])
        if offloaded and any(blocks[:-1]):  # the earlier checkpointed inputs are in host memory but one, in flight
            per_token -= (sum(blocks[:-1]) - 1) * D
        # backward's working set at that peak: the gradient of the MLP's hidden layer before and after its activation
        per_token += 2 * F
    values = B * per_token  # per token of a sample: one forward's, through its backward (the one update of a step)
    if training and setup.trained_models > 1:  # DMD2: its two updates' peaks, whichever is larger
        kept = [D if checkpointed else per_block for checkpointed in blocks]  # what a forward's blocks keep
        head = (model.depth // 2 if setup.gan_block is None else setup.gan_block % model.depth) + 1
        critic_update = student_update = values
        if setup.gan_loss:  # the GAN head: the critic's update also keeps its two forwards (real, generated images)
            # through the head's block; the student's, the frozen critic's forward through it (no weight gradients)
            critic_update += 2 * B * sum(kept[:head])
            student_update += B * sum(D if checkpointed else 10 * D + 2 * F for checkpointed in blocks[:head])
        # the regression loss: the student's update also keeps its forward of the teacher pairs, all in one batch
        student_update += setup.regression_pairs * sum(kept)
        values = max(critic_update, student_update)
    activations = tokens_per_rank * values * a
    if model.lora and setup.lora_base_dtype in FLOAT8:  # one fp8 layer's weight cast up to the compute dtype
        activations += model.float8_largest * a
    if training and not model.lora and not fsdp:  # a weight's gradient is computed whole before it is added to .grad
        # (gradient accumulation, zero_grad(set_to_none=False)): the largest one in flight (FSDP: ``gathered``'s)
        activations += model.largest_parameter * w
    # one ring hop, after the Ulysses exchange: S / ring tokens of H / ulysses heads (D / ulysses values per token)
    ring_tokens = math.ceil(model.tokens / layout.ring_degree) + math.ceil(model.text_tokens / layout.ring_degree)
    heads = max(head_counts(model.num_heads, layout.ulysses_degree))  # the busiest Ulysses rank's (uneven: one more)
    attention = 6 * B * ring_tokens * (model.hidden_size * heads // model.num_heads) * a  # q k v out, K/V in flight
    if layout.attention_backend == "math":
        scores = B * heads * ring_tokens**2 * 4  # fp32 scores, probabilities
        attention += 2 * scores * (2 if training else 1)  # and their gradients
    # start-up: what is materialised before the first step, plus one full tensor being initialised or loaded
    in_flight = model.largest_parameter * 4
    host = B * tokens_per_rank * offloaded * a
    if fsdp and layout.cpu_offload:
        host += weights + gradients + optimizer + ema
        startup = in_flight
        weights = gradients = optimizer = ema = 0
    else:
        startup = weights + ema + in_flight
    return MemoryEstimate(tokens_per_rank=tokens_per_rank, weights_bytes=weights, gradient_bytes=gradients,
                          optimizer_bytes=optimizer, ema_bytes=ema, bucket_bytes=buckets, gathered_bytes=gathered,
                          activation_bytes=activations, attention_bytes=attention, startup_bytes=startup,
                          host_bytes=host)


def model_bytes(model: ModelSize, setup: Setup) -> int:
    """The whole model's weights as the run holds them: w a parameter; under LoRA the frozen Linear / Conv weights
    in ``lora_base_dtype`` and the adapters in w."""
    w = setup.weight_bytes
    if not model.lora:
        return model.parameters * w
    if setup.lora_base_dtype in FLOAT8:  # block Linear weights in fp8 with row scales, the rest of the base in bf16
        cast = model.float8_parameters * (1 - w) + model.float8_rows * 4 \
            + (model.lora_base_parameters - model.float8_parameters) * (2 - w)
    else:
        cast = model.lora_base_parameters * (DTYPE_BYTES[setup.lora_base_dtype] - w)
    return (model.parameters + model.lora_parameters) * w + cast


def gathered_bytes_per_parameter(model: ModelSize, setup: Setup) -> float:
    """Bytes of one parameter as FSDP all-gathers it: ``param_dtype``, else the dtype it is held in (on average)."""
    if setup.param_dtype:
        return DTYPE_BYTES[setup.param_dtype]
    return model_bytes(model, setup) / (model.parameters + model.lora_parameters)
