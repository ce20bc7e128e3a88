"""The DiT model family (``DiT``) and its presets (``DIT_MODELS["DiT-XL/2"](...)``)."""

from ringdit.models.dit import DiT, DiTBlock, FinalLayer, modulate
from ringdit.models.embeddings import LabelEmbedder, PatchEmbed, TimestepEmbedder, sincos_pos_embed
from ringdit.models.presets import DIT_MODELS, SIZES

__all__ = [
    "DIT_MODELS",
    "DiT",
    "DiTBlock",
    "FinalLayer",
    "LabelEmbedder",
    "PatchEmbed",
    "SIZES",
    "TimestepEmbedder",
    "modulate",
    "sincos_pos_embed",
]
