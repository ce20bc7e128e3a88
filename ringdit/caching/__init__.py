"""Step caching for sampling: First-Block Cache and TeaCache, exact about *when* to reuse under context parallelism.

Consecutive sampling steps change a transformer's output little, mostly in its middle blocks. Both methods run the
model's repeated blocks (``ringdit.models.parallelize.repeated_blocks``: ``plan.blocks``) in full only when a cheap
probe says the step changed enough, and otherwise add a cached *residual* (what the skipped blocks added at the last
full evaluation):

- ``fbcache`` (First-Block Cache, ParaAttention / diffusers): run the first block; if the relative L1 change of its
  output residual (output - input) against the one of the last full evaluation is below ``threshold``, skip the other
  blocks and add the cached residual (last block's output - first block's output).
- ``teacache`` (TeaCache, Liu et al. 2024): before any block, measure the relative L1 change of the first block's
  timestep-modulated input against the previous evaluation, rescale it with a polynomial fitted per model
  (``coefficients``), and accumulate; while the sum stays below ``threshold`` skip every block (cached residual: last
  block's output - first block's input), else run them and reset the sum.

Under sequence parallelism every tensor a block sees is this rank's shard of the tokens. The decision therefore comes
from ONE all-reduce of a ``(2, samples)`` tensor -- the sums of ``|change|`` and of ``|previous|`` over this rank's
real tokens (tail padding excluded) -- over the sequence-parallel group, joined for CFG parallel by the rank holding
the other guidance half: every rank gets the same sums, so the same decisions, by construction (no rank can run
blocks whose collectives its peers skip). Decisions are per sample (both guidance halves of a sample together):
sample i reuses only its own residual, so its result does not depend on the batch it is in or on the layout; the
blocks are skipped (the saving) when every sample of the batch reuses. ``scope=batch`` takes one decision from the
whole batch's sums instead: more skips in a large batch, but a sample then depends on its batch (not on the ring /
Ulysses layout, which keeps the batch). The state lives for one ``attached`` block -- one ``generate`` call, one
batch -- and never crosses batches.

Under FSDP a skipped block still runs its hooks (FSDP's all-gather of its weights, the plan's split hooks): every rank
skips the same blocks, so the collectives match, but only the block's compute is saved.

With ``cache=none`` nothing here runs: sampling is bit-identical to sampling without this module. ``threshold=0``
never reuses (a relative change is never below 0), and then every block's output is returned untouched.

TeaCache's coefficients for a model: ``python -m ringdit.caching calibrate`` (``ringdit.caching.calibrate``, a
command: not imported here, as it imports the training module that samples).
"""

from ringdit.caching.blocks import BlockIO, block_io, check_model, modulated_input_of
from ringdit.caching.cache import CacheCounts, StepCache
from ringdit.caching.cache_settings import (
    COEFFICIENTS_FILE,
    KINDS,
    SCOPES,
    CacheSettings,
    model_fingerprint,
    read_coefficients,
    teacache_coefficients,
)

__all__ = [
    "COEFFICIENTS_FILE",
    "KINDS",
    "SCOPES",
    "BlockIO",
    "CacheCounts",
    "CacheSettings",
    "StepCache",
    "block_io",
    "check_model",
    "model_fingerprint",
    "modulated_input_of",
    "read_coefficients",
    "teacache_coefficients",
]
