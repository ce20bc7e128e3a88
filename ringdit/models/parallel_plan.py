"""``ParallelPlan``: where a model meets sequence parallelism, said declaratively, as data next to the model.

Every model ringdit trains -- its own DiT and each diffusers family -- is written for one device and declares one plan
(``DiT.parallel_plan``, ``Family.plan``); ``ringdit.models.parallelize`` applies it. Parallelism attaches at two
places only:

- **attention**: the attention modules whose queries are the (sharded) token sequence. ``self_attention`` modules
  attend over the whole sequence and run through ``USPAttention`` (ring / Ulysses); ``cross_attention`` modules
  attend to replicated keys (text) and stay local, with no communication; ``joint_attention`` modules (Flux, SD3,
  QwenImage) attend over ``[text ; image]`` and run through ``USPAttention`` too, with the text sharded like the
  image (see ``ringdit.attention.token_layout``): each rank's chunk is ``[its text shard ; its image shard]``
  (``text_first=False``: ``[image ; text]``), and ``text_mask`` names the input that marks the real text tokens
  where the model pads its text.
- **the shard / gather boundary**: ``split_inputs`` names module inputs that carry the full token sequence and are
  cut to this rank's chunk before the module runs (the first one seen in a forward also fixes the global length);
  ``split_outputs`` names module outputs cut the same way (a RoPE module's per-token rotations: every rank keeps the
  rotations of its own tokens' positions, its padded tail included); ``gather_outputs`` names module outputs
  gathered back to the whole sequence (the output projection), so the model's own unpatchify sees every token.
  ``text_inputs`` / ``text_outputs`` do the same for the text stream of joint attention (its states, its position
  ids or rotations, its mask), in text chunks; the text is never gathered (the models predict image tokens only).
  Where several patterns match one module, their keys are merged.

**Streams.** The fields above describe the two streams most models have: ``tokens`` (the patch tokens, predicted)
and ``text`` (joint attention's). A model whose attention sees more -- a control video (Wan VACE), audio beside the
video (LTX-2), a reference image -- names each further stream in ``streams``: a ``StreamPlan`` says where the stream
is cut over the ranks (``inputs``, ``outputs``), where it is gathered (``gather``: where it is predicted), and its
key mask (``mask``). Each stream has its own length, its own tail padding and its own mask. An attention module's
sequence is then named by ``attention_streams`` (the streams of every rank's chunk, in order: ``("control",)`` for
self-attention over a control video, ``("text", "tokens", "audio")`` for a joint attention over three), and
``stream_cross_attention`` names cross-attention modules whose keys are a sharded stream (video queries attending to
audio keys): every rank's keys of that stream are gathered, its queries stay local.

**Packed streams.** A model may carry a stream inside the tokens' own tensors, after the tokens along the sequence
dim: Qwen-Image-Edit embeds, rotates and projects ``[image ; reference image]`` as one sequence. ``packed`` names
those streams and where their lengths are read (``PackedStreams``); every cut and gather of the tokens then cuts /
joins each stream's part on its own, so each keeps its own length and tail padding and every rank holds ``[its
tokens ; its part of each packed stream]`` -- the order ``attention_streams`` then names (``("text", "tokens",
"reference")``).

``blocks`` names the ``ModuleList`` s of repeated transformer blocks: each block is a unit FSDP shards on its own and
a region ``compile=true`` compiles (one graph, reused by every block).

Module names are ``fnmatch`` patterns over ``model.named_modules()``, matched per dotted part (``"blocks.*.attn1"``;
``"blocks.*"`` is every block, not their submodules); ``""`` is the model itself. Input keys are positional indices
or keyword names; output keys index a tuple output (``None``: the output itself). Every value is the sequence
dimension.

A new model kind or family is a new plan (and a preset), not new machinery.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

Key = int | str | None

TOKENS, TEXT = "tokens", "text"  # the streams every plan has: the (image / video) tokens, and joint attention's text


@dataclass(frozen=True)
class StreamPlan:
    """Where one named stream of tokens meets sequence parallelism (tables as ``ParallelPlan``'s)."""

    inputs: dict[str, dict[Key, int]] = field(default_factory=dict)  # module inputs cut where the stream enters
    outputs: dict[str, dict[Key, int]] = field(default_factory=dict)  # module outputs cut like it (its positions)
    gather: dict[str, dict[Key, int]] = field(default_factory=dict)  # module outputs gathered (where it is predicted)
    mask: tuple[str, Key] | None = None  # (module, input): (B, L) True on its real tokens, read whole

    def under(self, name) -> StreamPlan:
        return StreamPlan(inputs=_table(self.inputs, name), outputs=_table(self.outputs, name),
                          gather=_table(self.gather, name),
                          mask=None if self.mask is None else (name(self.mask[0]), self.mask[1]))


@dataclass(frozen=True)
class PackedStreams:
    """Streams packed after the tokens in the tokens' tensors, and where their lengths are read: the input ``key`` of
    ``module`` (a pattern, as the plan's tables) when it runs, ``lengths(value) -> (tokens, *streams)``. It must run
    before the first cut of the tokens (the model itself, ``""``, does)."""

    streams: tuple[str, ...]  # after the tokens, in order
    module: str
    key: Key
    lengths: Callable[[object], tuple[int, ...]]

    def under(self, name) -> PackedStreams:
        return replace(self, module=name(self.module))


@dataclass(frozen=True)
class ParallelPlan:
    blocks: tuple[str, ...] = ()  # the ModuleLists of repeated blocks
    self_attention: tuple[str, ...] = ()
    cross_attention: tuple[str, ...] = ()
    joint_attention: tuple[str, ...] = ()
    split_inputs: dict[str, dict[Key, int]] = field(default_factory=dict)
    split_outputs: dict[str, dict[Key, int]] = field(default_factory=dict)
    gather_outputs: dict[str, dict[Key, int]] = field(default_factory=dict)
    text_inputs: dict[str, dict[Key, int]] = field(default_factory=dict)  # joint attention's text stream
    text_outputs: dict[str, dict[Key, int]] = field(default_factory=dict)
    text_mask: tuple[str, Key] | None = None  # (module, input): (B, L) True on real text tokens, read whole
    text_first: bool = True  # joint chunks are [text ; image] (False: [image ; text])
    streams: dict[str, StreamPlan] = field(default_factory=dict)  # further named streams (control, audio, ...)
    # self- / joint attention module pattern -> the streams of its sequence, in chunk order (default: the tokens for
    # self-attention, text and tokens in text_first's order for joint attention)
    attention_streams: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # cross-attention module pattern -> the sharded stream its keys come from (gathered from every rank)
    stream_cross_attention: dict[str, str] = field(default_factory=dict)
    packed: PackedStreams | None = None  # streams inside the tokens' tensors, after the tokens
    # streams the model's own forward packs into the one sequence this plan splits before it is cut (MiniMax-H3's
    # audio rows, packed with the video's): cut and gathered with the tokens, with no points of their own; what the
    # planner counts in the sequence
    forward_packed: tuple[str, ...] = ()

    def stream_plans(self) -> dict[str, StreamPlan]:
        """Every stream's plan: ``tokens`` and ``text`` from the fields that describe them, then ``streams``, then the
        packed streams (cut and gathered where the tokens are: no points of their own)."""
        plans = {TOKENS: StreamPlan(self.split_inputs, self.split_outputs, self.gather_outputs),
                 TEXT: StreamPlan(self.text_inputs, self.text_outputs, mask=self.text_mask)}
        packed = {} if self.packed is None else {name: StreamPlan() for name in self.packed.streams}
        for name in self.streams.keys() & plans.keys():
            raise ValueError(f"the parallel plan's streams name {name!r}, which its split_* / text_* fields describe")
        for name in packed.keys() & (plans.keys() | self.streams.keys()):
            raise ValueError(f"the parallel plan's packed streams name {name!r}, which it describes already")
        return {**plans, **self.streams, **packed}

    def default_streams(self, joint: bool) -> tuple[str, ...]:
        """The streams of an attention module's sequence, in chunk order, where ``attention_streams`` names none."""
        if not joint:
            return (TOKENS,)
        return (TEXT, TOKENS) if self.text_first else (TOKENS, TEXT)

    def under(self, prefix: str) -> ParallelPlan:
        """The same plan for a model that holds this plan's model as its submodule ``prefix``."""

        def name(pattern: str) -> str:
            return f"{prefix}.{pattern}" if pattern else prefix

        return replace(
            self,
            blocks=tuple(map(name, self.blocks)),
            self_attention=tuple(map(name, self.self_attention)),
            cross_attention=tuple(map(name, self.cross_attention)),
            joint_attention=tuple(map(name, self.joint_attention)),
            split_inputs=_table(self.split_inputs, name),
            split_outputs=_table(self.split_outputs, name),
            gather_outputs=_table(self.gather_outputs, name),
            text_inputs=_table(self.text_inputs, name),
            text_outputs=_table(self.text_outputs, name),
            text_mask=None if self.text_mask is None else (name(self.text_mask[0]), self.text_mask[1]),
            streams={stream: plan.under(name) for stream, plan in self.streams.items()},
            attention_streams=_table(self.attention_streams, name),
            stream_cross_attention=_table(self.stream_cross_attention, name),
            packed=None if self.packed is None else self.packed.under(name),
        )


def _table(entries: dict, name) -> dict:
    return {name(pattern): value for pattern, value in entries.items()}
