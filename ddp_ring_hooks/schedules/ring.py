"""Ring all-reduce: a reduce-scatter, then an all-gather, around a logical ring.

Each of the ``p`` ranks splits its buffer into ``p`` chunks and talks only to its neighbours:
it sends to ``r + 1`` and receives from ``r - 1`` (mod ``p``)::

        0 ──▶ 1
        ▲     │
        │     ▼
        3 ◀── 2

1. Reduce-scatter, ``p - 1`` steps. In step ``s`` rank ``r`` sends chunk ``(r - 1 - s) mod p``
   to its right neighbour, which adds it to its own copy. A partial sum travels around the
   ring like a wave, gaining one contribution per hop; after the last step rank ``r`` holds
   the complete sum of chunk ``r`` (the MPICH/NCCL convention). The other chunks hold partial
   sums, not zeros: no rank ever "holds the total while the others hold 0".
2. All-gather, ``p - 1`` steps. In step ``s`` rank ``r`` sends chunk ``(r - s) mod p``, and the
   receiver overwrites its copy: the finished chunks travel once more around the ring.

The ring visits the ranks in ``ring_order`` (default: ``0, 1, ..., p-1``; ``"hosts"`` groups
them by node, or give a permutation; see :mod:`.ordering`): above, read ``r`` as the rank at
position ``r`` of that order.

Every rank sends ``2(p - 1)`` messages of ``n / p`` bytes, ``2(p - 1)/p · n`` bytes in all, the
lower bound for all-reduce: the time ``2(p-1)α + 2(p-1)/p · nβ`` barely grows with ``p`` once
the buffer is large. Each chunk is summed along one chain and then only copied, so every rank
ends with bit-identical values.
"""

from __future__ import annotations

from collections.abc import Sequence

from .ir import Op, Schedule, Step, Transfer
from .ordering import RANK, RingCrossings, ordered_options, relabel, ring_crossings, ring_positions
from .registry import CostTerms

REDUCE_SCATTER = "reduce-scatter"
ALL_GATHER = "all-gather"


def build_ring_schedule(world_size: int, *, ring_order: object = RANK, node_of: Sequence[int] | None = None) -> Schedule:
    """The ring all-reduce over ``world_size`` ranks, one chunk per rank, visiting the ranks in
    ``ring_order`` (``"rank"``, ``"hosts"`` with ``node_of``, or a permutation)."""
    p = world_size
    order = ring_positions(p, ring_order, node_of)
    reduce_scatter = [
        Step(REDUCE_SCATTER, tuple(Transfer(r, (r + 1) % p, (r - 1 - s) % p, Op.REDUCE) for r in range(p)))
        for s in range(p - 1)
    ]
    all_gather = [
        Step(ALL_GATHER, tuple(Transfer(r, (r + 1) % p, (r - s) % p, Op.COPY) for r in range(p)))
        for s in range(p - 1)
    ]
    steps = relabel(reduce_scatter + all_gather, order)
    return Schedule("ring", p, p, steps, options=ordered_options(ring_order, node_of, order))


def ring_cost(world_size: int, *, ring_order: object = RANK, node_of: Sequence[int] | None = None) -> CostTerms:
    """``2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ``: ``2(p - 1)`` messages of ``n/p`` bytes, half of them
    added. The order does not change it when every link costs the same (on two tiers it does:
    :mod:`~ddp_ring_hooks.cost_model.two_tier`)."""
    p = world_size
    return CostTerms(messages=2 * (p - 1), bytes=2 * (p - 1) / p, reduced=(p - 1) / p)


def ring_busiest_sends(world_size: int, **_ordering) -> float:
    """``2(p-1)/p``: every rank sends ``2(p - 1)`` chunks of ``n/p``, whatever the order."""
    return 2 * (world_size - 1) / world_size


def ring_uplink_cost(world_size: int, *, crossings: RingCrossings) -> CostTerms:
    """The ring's closed form on two tiers: ``2(p-1)`` steps of ``n/p`` per link, ``h`` links of
    them through the busiest uplink (``h = crossings.busiest``; none: all steps inside one node)."""
    p = world_size
    steps, share = 2 * (p - 1), (p - 1) / p
    if crossings.busiest == 0:
        return CostTerms(reduced=share, local_messages=steps, local_bytes=2 * share)
    return CostTerms(messages=steps, bytes=2 * share * crossings.busiest, reduced=share)


def ring_shared_uplink_cost(
    world_size: int, placement: Sequence[int], *, ring_order: object = RANK, node_of: Sequence[int] | None = None,
) -> CostTerms:
    """The registry's ``uplink_cost``: :func:`ring_uplink_cost` for the crossings of this order."""
    return ring_uplink_cost(world_size, crossings=ring_crossings(ring_positions(world_size, ring_order, node_of), placement))
