"""Hierarchical ring all-reduce: rings inside each node, and rings across nodes on a shard.

``p = N·G`` ranks on ``N`` nodes of ``G`` ranks (rank ``r`` is local rank ``r mod G`` of node
``r // G``). Slow links between nodes carry only a ``1/G`` shard of the buffer, and a ring
over ``p`` ranks pays ``2(p - 1)`` latency terms where this pays ``2(G - 1) + 2(N - 1)``::

    node 0    0 ⇄ 1       ⇄  intra-node rings over the G local ranks, every node at once
              │   │
    node 1    2 ⇄ 3       │  inter-node rings over the N ranks with the same local rank
              │   │          (0-2-4, 1-3-5), each on its own shard
    node 2    4 ⇄ 5

The buffer is split in ``k`` segments (the ``segments`` option), each in ``G`` shards of ``N``
chunks (chunk ``j·p + l·N + i`` is piece ``i`` of shard ``l`` of segment ``j``). Each segment
goes through three phases:

1. Intra-node reduce-scatter, ``G - 1`` steps: a ring reduce-scatter over whole shards inside
   every node at once; local rank ``l`` ends with shard ``l`` summed over its node.
2. Inter-node all-reduce, ``2(N - 1)`` steps: the ``N`` ranks with local rank ``l`` (one per
   node) run a ring all-reduce on shard ``l``, as ``N`` pieces; ``G`` such rings run side by side.
3. Intra-node all-gather, ``G - 1`` steps: a ring all-gather of the shards inside each node.

4. Pipelining: segment ``j`` starts ``2(N - 1)`` steps after segment ``j - 1``, so the
   segments' inter-node phases follow each other back to back and the links between nodes,
   the slow ones, never wait for a phase inside the nodes: while segment ``j`` crosses them,
   segment ``j + 1`` reduces inside the nodes and segment ``j - 1`` gathers there::

       step        0    1    2    3    4    5    6    7    8  ...    (2 nodes: 2(N-1) = 2)
       segment 0   RS   X    X    AG
       segment 1             RS   X    X    AG                       X: across the nodes
       segment 2                       RS   X    X    AG

   Only the first ``G - 1`` steps (segment 0's reduce-scatter) and the last ``G - 1`` (the last
   segment's all-gather) are left outside the uplink's busy time; they are the schedule's
   phases 1 and 3, and every step between is phase 2. Without ``segments`` given the number
   grows with the buffer (:func:`segments_for`): one segment per :data:`SEGMENT_BYTES`, at
   most :data:`MAX_SEGMENTS`, since each segment costs ``2(N - 1)`` more message latencies.

Cost with intra-node ``α_l, β_l`` and inter-node ``α, β`` (one NIC per rank), when the links
between nodes are the slow part of every step they are in (what a hierarchy is for):
``2(G-1)α_l + 2(G-1)/(kG)·nβ_l + 2(N-1)k·α + 2(N-1)/(NG)·nβ + ((G-1)/(kG) + (N-1)/(NG))·nγ``
(when ``G - 1 > 2(N - 1)``, the first and last steps carry several segments' shards; the
counts say so). With ``k = 1`` it is the textbook sum of the three rings. Each piece is
summed along one chain and then copied: bit-identical on every rank.

``G`` is the ``local_size`` option; without it, ``LOCAL_WORLD_SIZE`` (set by torchrun) is used.
``ring_order`` (see :mod:`.ordering`) says which rank plays which place: rank ``order[i]`` is
local rank ``i mod G`` of node ``i // G``, so ``"hosts"`` (with ``node_of`` where the launcher
does not number the ranks node by node) makes the nodes of the schedule the real nodes, and a
permutation can put any ranks together.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Sequence

from .ir import Op, Schedule, Step, Transfer
from .ordering import HOSTS, RANK, ordered_options, relabel, ring_positions
from .registry import CostTerms

INTRA_REDUCE_SCATTER = "intra-node reduce-scatter"
INTER_ALL_REDUCE = "inter-node all-reduce"
INTRA_ALL_GATHER = "intra-node all-gather"


#: Without ``segments`` given: one segment per this many bytes of the buffer ...
SEGMENT_BYTES = 1 << 20
#: ... and at most this many (each costs ``2(N - 1)`` more message latencies).
MAX_SEGMENTS = 8


def segments_for(nbytes: int) -> int:
    """The pipeline depth for an ``nbytes`` buffer when none is given (measured on the lab's
    two-tier network, 400 Mbit/s uplinks: one segment up to 1 MiB, where a step's latency
    outweighs the overlap; 4 at 4 MiB; 8 from 8 MiB; see ``docs/algorithms.md``)."""
    return max(1, min(MAX_SEGMENTS, nbytes // SEGMENT_BYTES))


def build_hierarchical_schedule(
    world_size: int, *, local_size: int | None = None, segments: int | None = None, ring_order: object = RANK,
    node_of: Sequence[int] | None = None,
) -> Schedule:
    """The three-phase ring over ``world_size // local_size`` nodes of ``local_size`` ranks, the
    ranks placed in ``ring_order``, pipelined in ``segments`` (default 1)."""
    g = resolve_local_size(world_size, local_size)
    k = 1 if segments is None else segments
    p, n = world_size, world_size // g
    order = ring_positions(p, ring_order, node_of)
    if ring_order == HOSTS and node_of is not None:
        _check_nodes_hold(g, node_of)
    one = _one_segment(n, g)
    lag = 2 * (n - 1)
    span = len(one) + (k - 1) * lag
    steps = []
    for t in range(span):
        active = [(j, t - j * lag) for j in range(k) if 0 <= t - j * lag < len(one)]
        steps.append(Step(_pipelined_phase(t, g, span), tuple(
            Transfer(x.src, x.dst, j * p + x.chunk, x.op) for j, local in active for x in one[local].transfers
        )))
    return Schedule("hierarchical", p, k * p, relabel(steps, order), options=ordered_options(ring_order, node_of, order))


def _one_segment(n: int, g: int) -> list[Step]:
    """The three phases on one segment of ``p`` chunks, for ring positions (rank ``node·g + l``)."""

    def rank(node: int, local: int) -> int:
        return (node % n) * g + local % g

    def shard(local: int) -> range:
        return range((local % g) * n, (local % g + 1) * n)

    steps = [
        Step(INTRA_REDUCE_SCATTER, tuple(
            Transfer(rank(node, l), rank(node, l + 1), c, Op.REDUCE)
            for node in range(n) for l in range(g) for c in shard(l - 1 - s)
        ))
        for s in range(g - 1)
    ]
    for s in range(2 * (n - 1)):
        reducing = s < n - 1
        offset = -1 - s if reducing else -(s - (n - 1))  # ring.py's chunk indexing
        steps.append(Step(INTER_ALL_REDUCE, tuple(
            Transfer(rank(node, l), rank(node + 1, l), l * n + (node + offset) % n, Op.REDUCE if reducing else Op.COPY)
            for node in range(n) for l in range(g)
        )))
    steps += [
        Step(INTRA_ALL_GATHER, tuple(
            Transfer(rank(node, l), rank(node, l + 1), c, Op.COPY)
            for node in range(n) for l in range(g) for c in shard(l - s)
        ))
        for s in range(g - 1)
    ]
    return steps


def _pipelined_phase(step: int, local_size: int, span: int) -> str:
    """Steps before the first segment crosses the nodes are its reduce-scatter, steps after the
    last one crossed are its all-gather; every step between crosses the nodes."""
    if step < local_size - 1:
        return INTRA_REDUCE_SCATTER
    if step >= span - (local_size - 1):
        return INTRA_ALL_GATHER
    return INTER_ALL_REDUCE


def _check_nodes_hold(local_size: int, node_of: Sequence[int]) -> None:
    """Grouped by node, the ranks fill nodes of ``local_size`` only if every node has that many."""
    sizes = Counter(node_of)
    if set(sizes.values()) != {local_size}:
        shown = ", ".join(f"node {node}: {count}" for node, count in sorted(sizes.items()))
        raise ValueError(
            f"hierarchical: node_of puts {shown} ranks, but local_size={local_size}: every node must "
            "hold local_size ranks (pass the local_size the nodes have)"
        )


def resolve_local_size(world_size: int, local_size: int | None) -> int:
    """``local_size``, or ``LOCAL_WORLD_SIZE`` from the environment; checked to divide ``world_size``."""
    if local_size is None:
        from_env = os.environ.get("LOCAL_WORLD_SIZE")
        if from_env is None:
            raise ValueError(
                "hierarchical needs the number of ranks per node: pass local_size=G, or run "
                "under torchrun, which sets LOCAL_WORLD_SIZE"
            )
        local_size = int(from_env)
    if not isinstance(local_size, int) or local_size < 1 or world_size % local_size:
        raise ValueError(
            f"hierarchical: local_size={local_size!r} ranks per node does not divide the world size "
            f"{world_size}; pass a local_size that divides it (every node must have the same size)"
        )
    return local_size


def hierarchical_cost(
    world_size: int, *, local_size: int, segments: int | None = None, ring_order: object = RANK,
    node_of: Sequence[int] | None = None,
) -> CostTerms:
    """``2(G-1)α_l + 2(G-1)/(kG)·nβ_l + 2(N-1)k·α + 2(N-1)/(NG)·nβ + ((G-1)/(kG) + (N-1)/(NG))·nγ``:
    rings inside the nodes on local links (only the first segment's reduce-scatter and the last
    one's all-gather are not hidden behind the links between nodes), a ring across the ``N``
    nodes on a ``1/G`` shard per segment (one NIC per rank; nodes that share one uplink:
    :mod:`~ddp_ring_hooks.cost_model.two_tier`). The order places ranks; it does not change
    the counts."""
    p, g = world_size, resolve_local_size(world_size, local_size)
    k, nodes = 1 if segments is None else segments, p // g
    # Shards on a local link in each of the first (and last) G-1 steps: one per segment started.
    lag = 2 * (nodes - 1)
    shards = sum(k if lag == 0 else min(k, t // lag + 1) for t in range(g - 1)) / (k * g)
    return CostTerms(
        messages=2 * (nodes - 1) * k, bytes=2 * (nodes - 1) / p, reduced=shards + (nodes - 1) / p,
        local_messages=2 * (g - 1), local_bytes=2 * shards,
    )


def hierarchical_uplink_cost(world_size: int, *, ranks_per_node: int, segments: int = 1) -> CostTerms:
    """The closed form when each node's ``G`` ranks share its uplink: rings inside the nodes, then
    ``G`` rings across them whose shards all go through the same uplink, ``2(N-1)/N · n`` each
    way, in ``segments`` pipelined pieces (the terms inside the nodes are :func:`hierarchical_cost`'s)."""
    per_nic = hierarchical_cost(world_size, local_size=ranks_per_node, segments=segments)
    nodes = world_size // ranks_per_node
    return dataclasses.replace(per_nic, bytes=2 * (nodes - 1) / nodes)


def hierarchical_shared_uplink_cost(
    world_size: int, placement: Sequence[int], *, local_size: int, segments: int | None = None,
    ring_order: object = RANK, node_of: Sequence[int] | None = None,
) -> CostTerms | None:
    """The registry's ``uplink_cost``: :func:`hierarchical_uplink_cost` when the schedule's nodes
    are the real ones (``placement``); ``None`` (count the schedule) when they are not."""
    g = resolve_local_size(world_size, local_size)
    order = ring_positions(world_size, ring_order, node_of)
    nodes = [0] * world_size
    for place, rank in enumerate(order):
        nodes[rank] = place // g
    if tuple(nodes) != tuple(placement):
        return None
    return hierarchical_uplink_cost(world_size, ranks_per_node=g, segments=1 if segments is None else segments)
