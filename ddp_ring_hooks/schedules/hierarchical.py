"""Hierarchical ring all-reduce: rings inside each node, and rings across nodes on a shard.

``p = N·G`` ranks on ``N`` nodes of ``G`` ranks (rank ``r`` is local rank ``r mod G`` of node
``r // G``). Slow links between nodes carry only a ``1/G`` shard of the buffer, and a ring
over ``p`` ranks pays ``2(p - 1)`` latency terms where this pays ``2(G - 1) + 2(N - 1)``::

    node 0    0 ⇄ 1       ⇄  intra-node rings over the G local ranks, every node at once
              │   │
    node 1    2 ⇄ 3       │  inter-node rings over the N ranks with the same local rank
              │   │          (0-2-4, 1-3-5), each on its own shard
    node 2    4 ⇄ 5

The buffer is split in ``G`` shards of ``N`` chunks each (chunk ``l·N + i`` is piece ``i`` of
shard ``l``):

1. Intra-node reduce-scatter, ``G - 1`` steps: a ring reduce-scatter over whole shards inside
   every node at once; local rank ``l`` ends with shard ``l`` summed over its node.
2. Inter-node all-reduce, ``2(N - 1)`` steps: the ``N`` ranks with local rank ``l`` (one per
   node) run a ring all-reduce on shard ``l``, as ``N`` pieces; ``G`` such rings run side by side.
3. Intra-node all-gather, ``G - 1`` steps: a ring all-gather of the shards inside each node.

Cost with intra-node ``α_l, β_l`` and inter-node ``α, β`` (one NIC per rank):
``2(G-1)α_l + 2(G-1)/G·nβ_l + 2(N-1)α + 2(N-1)/(NG)·nβ + (p-1)/p·nγ``. Each piece is summed
along one chain and then copied: bit-identical on every rank.

``G`` is the ``local_size`` option; without it, ``LOCAL_WORLD_SIZE`` (set by torchrun) is used.
``ring_order`` (see :mod:`.ordering`) says which rank plays which place: rank ``order[i]`` is
local rank ``i mod G`` of node ``i // G``, so ``"hosts"`` (with ``node_of`` where the launcher
does not number the ranks node by node) makes the nodes of the schedule the real nodes, and a
permutation can put any ranks together.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence

from .ir import Op, Schedule, Step, Transfer
from .ordering import HOSTS, RANK, ordered_options, relabel, ring_positions
from .registry import CostTerms

INTRA_REDUCE_SCATTER = "intra-node reduce-scatter"
INTER_ALL_REDUCE = "inter-node all-reduce"
INTRA_ALL_GATHER = "intra-node all-gather"


def build_hierarchical_schedule(
    world_size: int, *, local_size: int | None = None, ring_order: object = RANK, node_of: Sequence[int] | None = None,
) -> Schedule:
    """The three-phase ring over ``world_size // local_size`` nodes of ``local_size`` ranks, the
    ranks placed in ``ring_order``."""
    g = resolve_local_size(world_size, local_size)
    p, n = world_size, world_size // g
    order = ring_positions(p, ring_order, node_of)
    if ring_order == HOSTS and node_of is not None:
        _check_nodes_hold(g, node_of)

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
    return Schedule("hierarchical", p, p, relabel(steps, order), options=ordered_options(ring_order, node_of, order))


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


def hierarchical_cost(world_size: int, *, local_size: int, ring_order: object = RANK, node_of: Sequence[int] | None = None) -> CostTerms:
    """``2(G-1)α_l + 2(G-1)/G·nβ_l + 2(N-1)α + 2(N-1)/(NG)·nβ + (p-1)/p·nγ``: rings inside the
    nodes on local links, a ring across the ``N`` nodes on a ``1/G`` shard (one NIC per rank;
    nodes that share one uplink: :mod:`~ddp_ring_hooks.cost_model.two_tier`). The order places
    ranks; it does not change the counts."""
    p, g = world_size, resolve_local_size(world_size, local_size)
    nodes = p // g
    return CostTerms(
        messages=2 * (nodes - 1), bytes=2 * (nodes - 1) / p, reduced=(p - 1) / p,
        local_messages=2 * (g - 1), local_bytes=2 * (g - 1) / g,
    )
