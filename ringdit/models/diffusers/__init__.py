"""diffusers model families (Wan, ...) run by ringdit: one generic adapter, one declarative plan per family."""

from ringdit.models.diffusers.families import FAMILIES, Family, get_family
from ringdit.models.diffusers.transformer import DiffusersTransformer
from ringdit.models.parallel_plan import ParallelPlan

__all__ = ["FAMILIES", "DiffusersTransformer", "Family", "ParallelPlan", "get_family"]
