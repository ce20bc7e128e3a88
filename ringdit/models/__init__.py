"""The DiT model family (``DiT``); its sizes are the presets in ``conf/model`` (``model=dit_xl`` ...)."""

from ringdit.models.dit import DiT, DiTBlock, FinalLayer, modulate
from ringdit.models.embeddings import LabelEmbedder, PatchEmbed, TimestepEmbedder, sincos_pos_embed

__all__ = [
    "DiT",
    "DiTBlock",
    "FinalLayer",
    "LabelEmbedder",
    "PatchEmbed",
    "TimestepEmbedder",
    "modulate",
    "sincos_pos_embed",
]
