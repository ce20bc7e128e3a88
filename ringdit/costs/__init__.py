"""The memory one rank needs, estimated before anything is spawned: train.py's warning, ``python -m ringdit.plan``.

``ringdit.costs.estimate``: what the estimate models, term by term (its docstring), and the estimate itself;
``ringdit.costs.model_size``: the model's sizes it reads, from the model built on the meta device;
``ringdit.costs.check``: a run's settings as a ``Setup`` (``memory_setup``, from ``TrainSpec``'s parts) and its
warning, with a layout that fits.
"""

from ringdit.costs.check import (available_memory, check_memory, check_training_memory, layout_that_fits,
                                  memory_setup, setup_from_config, warn_if_memory_short)
from ringdit.costs.estimate import (DISTILL_METHODS, DTYPE_BYTES, FLOAT8, STATE_BLOCK, GiB, MemoryEstimate, ModelSize,
                                     Setup, estimate_memory, gathered_bytes_per_parameter, model_bytes)
from ringdit.costs.model_size import (estimate_model_memory, float8_parameters, lora_parameters, model_size,
                                  untargeted_linear_inputs)

__all__ = [
    "DISTILL_METHODS", "DTYPE_BYTES", "FLOAT8", "STATE_BLOCK", "GiB", "MemoryEstimate", "ModelSize", "Setup",
    "available_memory", "check_memory", "check_training_memory", "estimate_memory", "estimate_model_memory", "float8_parameters",
    "gathered_bytes_per_parameter", "layout_that_fits", "lora_parameters", "memory_setup", "model_bytes", "model_size",
    "setup_from_config", "untargeted_linear_inputs", "warn_if_memory_short",
]
