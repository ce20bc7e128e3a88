"""``ParallelPlan``: where a model meets sequence parallelism, said declaratively, as data next to the model.

Every model ringdit trains -- its own DiT and each diffusers family -- is written for one device and declares one plan
(``DiT.parallel_plan``, ``Family.plan``); ``ringdit.models.parallelize`` applies it. Parallelism attaches at two
places only:

- **attention**: the attention modules whose queries are the (sharded) token sequence. ``self_attention`` modules
  attend over the whole sequence and run through ``USPAttention`` (ring / Ulysses); ``cross_attention`` modules
  attend to replicated keys (text) and stay local, with no communication; ``joint_attention`` modules (Flux, SD3,
  QwenImage) attend over ``[text ; image]`` and run through ``USPAttention`` too, with the text sharded like the
  image (see ``ringdit.attention.layout``): each rank's chunk is ``[its text shard ; its image shard]``
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

``blocks`` names the ``ModuleList`` s of repeated transformer blocks: each block is a unit FSDP shards on its own and
a region ``compile=true`` compiles (one graph, reused by every block).

Module names are ``fnmatch`` patterns over ``model.named_modules()``, matched per dotted part (``"blocks.*.attn1"``;
``"blocks.*"`` is every block, not their submodules); ``""`` is the model itself. Input keys are positional indices
or keyword names; output keys index a tuple output (``None``: the output itself). Every value is the sequence
dimension.

A new model kind or family is a new plan (and a preset), not new machinery.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

Key = int | str | None


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

    def under(self, prefix: str) -> ParallelPlan:
        """The same plan for a model that holds this plan's model as its submodule ``prefix``."""

        def name(pattern: str) -> str:
            return f"{prefix}.{pattern}" if pattern else prefix

        def table(entries: dict) -> dict:
            return {name(pattern): keys for pattern, keys in entries.items()}

        return replace(
            self,
            blocks=tuple(map(name, self.blocks)),
            self_attention=tuple(map(name, self.self_attention)),
            cross_attention=tuple(map(name, self.cross_attention)),
            joint_attention=tuple(map(name, self.joint_attention)),
            split_inputs=table(self.split_inputs),
            split_outputs=table(self.split_outputs),
            gather_outputs=table(self.gather_outputs),
            text_inputs=table(self.text_inputs),
            text_outputs=table(self.text_outputs),
            text_mask=None if self.text_mask is None else (name(self.text_mask[0]), self.text_mask[1]),
        )
