"""``ParallelPlan``: what one diffusers model family needs to run sequence-parallel, said declaratively.

A diffusers transformer is left exactly as diffusers wrote it: its projections, norms, RoPE and output layer run
unchanged. Parallelism attaches at the places the plan names (the same two places as in ringdit's own DiT):

- **attention**: the attention modules whose queries are the (sharded) token sequence. ``self_attention`` modules
  attend over the whole sequence and run through ``USPAttention`` (ring / Ulysses); ``cross_attention`` modules
  attend to replicated keys (text) and stay local, with no communication; ``joint_attention`` modules (Flux, SD3,
  QwenImage) attend over ``[text ; image]``, where the text tokens are replicated on every rank: they run through
  ``USPAttention`` with ``joint_prefix`` = the text length, which ``text_prefix`` names (a module input and its
  sequence dim), and ``prefix_mask`` from the ``text_mask`` input where the model pads its text.
- **the shard / gather boundary**: ``split_inputs`` names module inputs that carry the full token sequence and are
  cut to this rank's chunk before the module runs (the first one seen in a forward also fixes the global length);
  ``split_outputs`` names module outputs cut the same way (a RoPE module's per-token rotations: every rank keeps the
  rotations of its own tokens' positions, its padded tail included); ``gather_outputs`` names module outputs
  gathered back to the whole sequence (the output projection), so the model's own unpatchify sees every token.

Module names are ``fnmatch`` patterns over ``model.named_modules()`` (``"blocks.*.attn1"``); ``""`` is the model
itself. Input keys are positional indices or keyword names; output keys index a tuple output (``None``: the output
itself). Every value is the sequence dimension.

A new family is a new plan (see ``ringdit/models/diffusers/families.py``), not new machinery.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Key = int | str | None


@dataclass(frozen=True)
class ParallelPlan:
    self_attention: tuple[str, ...] = ()
    cross_attention: tuple[str, ...] = ()
    joint_attention: tuple[str, ...] = ()
    text_prefix: tuple[str, Key, int] | None = None  # (module, input, dim): the replicated text tokens
    text_mask: tuple[str, Key] | None = None  # (module, input): (B, L) True on real text tokens
    split_inputs: dict[str, dict[Key, int]] = field(default_factory=dict)
    split_outputs: dict[str, dict[Key, int]] = field(default_factory=dict)
    gather_outputs: dict[str, dict[Key, int]] = field(default_factory=dict)
