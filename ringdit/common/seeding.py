"""Where every random draw of a run comes from: one named stream per purpose, keyed by what the draw is for.

A draw is seeded by ``(stream, seed, *key)`` where the key names the draw in terms of the run -- the step and the
sample's position in the global batch, the sample's index in an ``infer.py`` job, an epoch -- never in terms of the
process that makes it. Hence every rank of a sequence-parallel group draws the same values, a resumed run draws
what the uninterrupted run would have, and neither the rank layout, nor the batch size, nor the number of samples
changes what one sample gets. Streams are independent of each other: the stream is part of the hashed key.

A model's initial weights are drawn per module (``INIT``), so any rank layout starts from the same ones; dropout
and a model built outside ``ringdit.models.build`` use the global generators that ``L.seed_everything(seed)`` seeds; procedural
datasets (moving digits, synthetic text latents) draw their content from their own ``data.seed``.
"""

from __future__ import annotations

import enum

import numpy as np
import torch


class Stream(enum.IntEnum):
    """The purposes a run draws random numbers for, and the key that picks one draw (the values are part of the
    hash: never renumber them, or every run's draws change)."""

    TRAIN = 1  # (step, micro-batch, position in the global batch): a sample's diffusion time, noise and label drop
    VALIDATION = 2  # (batch, position in the global batch): the same draws at every validation, so val/loss compares
    PREVIEW = 3  # (cell): the noise of a training preview grid's cell, the same at every step
    INFERENCE = 4  # (sample index): infer.py's sample i, whatever num_samples, batch size or layout
    DATA_ORDER = 5  # (epoch[, bucket]): the permutation of the training set (of one bucket's samples) in that epoch
    DATA_SPLIT = 6  # (): which samples are held out for validation
    INIT = 7  # (crc32 of a module's name): that module's initial weights (ringdit.models.materialize)
    DATA_BUCKET = 8  # (block of 1024 steps): which bucket each of those steps reads (ringdit.data.steps)
    EXPERT = 9  # (step, micro-batch) in training, (batch,) in validation: the expert a two-expert model runs then
    DISTILL = 10  # (generator step, phase, role[, position in the global batch]): a distillation's draws (the student's
    # noise, the critic's and the distribution-matching loss's times and noise, the backward-simulated step)


def seed_of(stream: Stream, seed: int, *key: int) -> int:
    """The torch seed of one draw: a hash of (stream, seed, key).

    The key's length is hashed too because SeedSequence ignores trailing zeros ([s] and [s, 0] would collide). The
    hash is cut to 63 bits so the seed fits an int64 tensor (infer.py's batches carry it).
    """
    entropy = [int(stream), seed, len(key), *key]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> 1)


def generator(stream: Stream, seed: int, *key: int) -> torch.Generator:
    """A CPU generator for one draw; see ``Stream`` for each stream's key."""
    return torch.Generator().manual_seed(seed_of(stream, seed, *key))
