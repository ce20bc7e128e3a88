"""Learning-rate schedules (Hydra ``_partial_`` targets that take the optimizer)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from ringdit.common.errors import require_count


@dataclass
class WarmupCosine:
    """Linear warmup to the base LR over ``warmup_steps``, then cosine decay to ``final_lr_fraction`` of it at
    ``total_steps`` (constant after). A callable object rather than a lambda, so LambdaLR checkpoints its state."""

    warmup_steps: int
    total_steps: int
    final_lr_fraction: float = 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.final_lr_fraction + (1 - self.final_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: Optimizer, warmup_steps: int = 100, total_steps: int = 1000,
                  final_lr_fraction: float = 0.0) -> LambdaLR:
    require_count("scheduler.warmup_steps", warmup_steps, minimum=0)
    require_count("scheduler.total_steps", total_steps)
    return LambdaLR(optimizer, WarmupCosine(max(1, warmup_steps), total_steps, final_lr_fraction))
