"""ringdit: context-parallel Diffusion Transformers."""

__version__ = "0.1.0"
