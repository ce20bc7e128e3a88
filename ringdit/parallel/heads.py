"""How Ulysses places the heads on its ranks, for any head count.

Ulysses trades a sequence shard for a head shard: after its all-to-all each rank holds the whole sequence for some
of the heads, whole. With ``H`` heads over ``U`` ranks the first ``H % U`` ranks take ``ceil(H / U)`` heads and the
others ``floor(H / U)`` (56 heads over 16 ranks: 8 ranks of 4, 8 of 3). Attention is independent per head, so any
split is exact; the all-to-all moves the unequal shares as they are (``ringdit.parallel.collectives.all_to_all``
with split sizes; why not padding the heads to a multiple: see there).

The cost of an uneven split is time, not accuracy: every rank waits for the busiest one, which attends over
``ceil(H / U)`` heads while the mean is ``H / U``. ``head_imbalance`` is that ratio, the factor by which the
attention of a layout is slower than a perfectly even split of the same heads (1.0 when ``U`` divides ``H``).

A degree above the head count would leave ranks with no head at all: pure waste (they hold a sequence shard that
they hand away and get nothing to attend to), so it is refused, with the degrees that keep the same ranks busy.
"""

from __future__ import annotations


def head_counts(num_heads: int, ulysses_degree: int) -> tuple[int, ...]:
    """The heads of each Ulysses rank, in rank order: consecutive runs, the first ``num_heads % ulysses_degree``
    ranks one head more. Rank ``u`` holds heads ``sum(counts[:u]) .. sum(counts[:u + 1]) - 1``."""
    base, extra = divmod(num_heads, ulysses_degree)
    return tuple(base + (rank < extra) for rank in range(ulysses_degree))


def head_imbalance(num_heads: int, ulysses_degree: int) -> float:
    """The busiest Ulysses rank's heads over the mean, ``ceil(H / U) * U / H``: how much longer a layout's attention
    takes than an even split of the same work (1.0 when ``U`` divides ``H``; 56 heads over 16 ranks: 8/7 = 1.143,
    24 over 5: 25/24 = 1.042). The planner multiplies the attention time of a layout by it."""
    return max(head_counts(num_heads, ulysses_degree)) * ulysses_degree / num_heads


def check_heads_placeable(num_heads: int, ulysses_degree: int) -> None:
    """Raise a ValueError, one line with the values and a fix, when ``ulysses_degree`` ranks cannot all hold a
    head (more ranks than heads). Any degree up to the head count is placed (unevenly where it does not divide).

    The fix keeps the same ranks: the largest divisor ``d`` of the degree that is at most the head count, the rest
    of the degree moved to the ring (``ring_degree x ulysses_degree`` unchanged, so the world size still fits). It
    says by how much to multiply the ring degree rather than a value: the model is checked where only the Ulysses
    degree is known (``ringdit.spec.model.build_on_meta``)."""
    if ulysses_degree <= num_heads:
        return
    fit = max(d for d in range(1, num_heads + 1) if ulysses_degree % d == 0)
    raise ValueError(
        f"ulysses_degree={ulysses_degree} is more than the model's num_heads={num_heads}: Ulysses gives each rank "
        f"whole heads, so {ulysses_degree - num_heads} of its ranks would hold none; use ulysses_degree={fit} with "
        f"ring_degree multiplied by {ulysses_degree // fit} (the same ranks), or any ulysses_degree up to {num_heads}"
    )
