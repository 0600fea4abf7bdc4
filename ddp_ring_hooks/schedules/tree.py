"""Tree all-reduce: reduce up a binomial tree to rank 0, broadcast back down, pipelined.

The tree is MPICH's binomial tree: rank ``r`` hangs below ``r`` with its lowest set bit
cleared, so after ``⌈lg p⌉`` rounds every contribution has reached rank 0::

    round 0: 1─▶0  3─▶2  5─▶4  7─▶6          0
    round 1: 2─▶0  6─▶4                    ╱ │ ╲
    round 2: 4─▶0                         1  2   4
                                             │  ╱ ╲
                                             3 5   6
                                                   │
                                                   7

1. Reduce, rounds ``m = 0, 1, ..., ⌈lg p⌉ - 1``: a rank whose lowest set bit is ``m`` sends
   its partial sum to ``r - 2^m``, which adds it. Children with a smaller lowest bit have
   reported first, so each rank adds its children in a fixed order and the total is formed
   once, at rank 0.
2. Broadcast, the same rounds backwards: in round ``m`` a rank that has the sum sends it to
   ``r + 2^m``, which copies it.
3. Pipelining (``segments=k``): the buffer is split in ``k`` segments that follow each other
   one step apart, so segment ``j`` does round ``m`` in step ``j + m``. A rank then receives
   different segments from different children in the same step (one per link), and each
   phase takes ``⌈lg p⌉ + k - 1`` steps of ``n/k`` bytes instead of ``⌈lg p⌉`` steps of ``n``.

Cost, counting each link separately (a pipelined rank talks to several children at once):
``2(⌈lg p⌉ + k - 1)(α + nβ/k) + (⌈lg p⌉ + k - 1)nγ/k``. With ``k = 1`` this is the textbook
``2⌈lg p⌉(α + nβ) + ⌈lg p⌉nγ``: only ``2 lg p`` latency terms where the ring pays ``2(p - 1)``,
so the tree wins for small buffers on many ranks and loses on bandwidth for large ones (the
root sends ``⌈lg p⌉`` whole buffers). We chose the binomial tree over NCCL's double binary
tree because it is the one the textbook formulas describe and the one a reader can check by
hand. ``segments`` trades latency terms for overlap; the model's gain assumes the root's
links are independent, which they are not when they share one NIC: measure before relying
on it (``ddp-ring-hooks bench``).
"""

from __future__ import annotations

import math

from .ir import Op, Schedule, Step, Transfer
from .registry import CostTerms

REDUCE = "reduce"
BROADCAST = "broadcast"


def build_tree_schedule(world_size: int, *, segments: int = 1) -> Schedule:
    """Binomial-tree reduce to rank 0 then broadcast, with the buffer in ``segments`` pieces."""
    if not isinstance(segments, int) or segments < 1:
        raise ValueError(f"tree needs segments >= 1 (the number of pipelined pieces), got {segments!r}")
    p, k = world_size, segments
    rounds = (p - 1).bit_length()  # ⌈lg p⌉
    edges = [_binomial_edges(p, m) for m in range(rounds)]  # (child, parent) per round
    span = rounds + k - 1 if rounds else 0
    reduce_steps = [
        Step(REDUCE, tuple(
            Transfer(child, parent, t - m, Op.REDUCE)
            for m in range(rounds) if 0 <= t - m < k
            for child, parent in edges[m]
        ))
        for t in range(span)
    ]
    # Broadcast round i uses the reduce round rounds-1-i backwards, from the root outwards.
    broadcast_steps = [
        Step(BROADCAST, tuple(
            Transfer(parent, child, t - i, Op.COPY)
            for i in range(rounds) if 0 <= t - i < k
            for child, parent in edges[rounds - 1 - i]
        ))
        for t in range(span)
    ]
    return Schedule("tree", p, k, tuple(reduce_steps + broadcast_steps))


def _binomial_edges(world_size: int, round_: int) -> tuple[tuple[int, int], ...]:
    """``(child, parent)`` pairs of round ``round_``: ranks whose lowest set bit is that round."""
    bit = 1 << round_
    return tuple((child, child - bit) for child in range(bit, world_size, 2 * bit))


def tree_cost(world_size: int, *, segments: int = 1) -> CostTerms:
    """``2(L+k-1)(α + nβ/k) + (L+k-1)·nγ/k`` with ``L = ⌈lg p⌉``: each of the two phases takes
    ``L + k - 1`` steps of one ``n/k`` segment."""
    if world_size == 1:
        return CostTerms()
    span = math.ceil(math.log2(world_size)) + segments - 1
    return CostTerms(messages=2 * span, bytes=2 * span / segments, reduced=span / segments)
