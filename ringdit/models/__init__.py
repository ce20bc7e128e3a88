"""The models ringdit trains, each single-device code with a ``ParallelPlan``: ringdit's DiT (its sizes are the
presets in ``conf/model``: ``model=dit_xl`` ...) and the diffusers families (``ringdit.models.diffusers``);
``parallelize`` applies a plan."""

from ringdit.models.dit import DiT, DiTBlock, FinalLayer, modulate
from ringdit.models.embeddings import LabelEmbedder, PatchEmbed, TimestepEmbedder, sincos_pos_embed
from ringdit.models.parallelize import parallelize, repeated_blocks
from ringdit.models.parallel_plan import ParallelPlan

__all__ = [
    "DiT",
    "DiTBlock",
    "FinalLayer",
    "LabelEmbedder",
    "ParallelPlan",
    "PatchEmbed",
    "TimestepEmbedder",
    "modulate",
    "parallelize",
    "repeated_blocks",
    "sincos_pos_embed",
]
