"""Two tiers of links: fast ones inside a node (``α_l, β_l``), one shared uplink per node (``α, β``).

On a cluster the links between nodes are the scarce ones, and every rank of a node shares its
node's uplink. What decides an algorithm's time there is how many bytes go through the
busiest uplink, in each direction, and how often::

    2 nodes x 2 ranks, n bytes each     bytes through each uplink, each way   ratio
    ring, ranks node by node             0 → 1 ⇒ 2 → 3 ⇒ 0    2(p-1)/p · n = 1.5 n   1
    ring, ranks across nodes             0 ⇒ 1 ⇒ 2 ⇒ 3 ⇒ 0    twice that   = 3 n     2
    hierarchical (G=2): rings inside the nodes, across them on a 1/G shard   n       0.67

The counts come from the schedule itself, given the node of every rank:

- :func:`uplink_traffic`: the bytes each node's uplink carries out and in, over the whole all-reduce;
- :func:`ring_crossings`: how many hops of a ring order cross a node boundary, and the most
  that leave one node (what its uplink carries per ring step, in chunks);
- :func:`uplink_terms`: the schedule's :class:`~ddp_ring_hooks.schedules.CostTerms` on two
  tiers: a step that uses an uplink costs ``α + β·(bytes through the busiest uplink
  direction)``, a step inside the nodes ``α_l + β_l·(bytes of its busiest link)``. Linear in
  the parameters, so :func:`~ddp_ring_hooks.cost_model.price` multiplies it out and a fit can
  calibrate it; equal to ``simulate(..., shared_uplinks=True)`` whenever the uplink is the
  slow part of every step that uses it (``α >= α_l``, ``β >= β_l``, and the busiest uplink
  carries at least what the busiest local link does: true of ring and hierarchical).

The closed forms (``p = N·G`` ranks on ``N`` nodes of ``G``; ``h`` the most ring hops that
leave one node, 1 when the ranks are placed node by node)::

    ring            2(p-1)α + 2(p-1)/p · h·nβ + (p-1)/p · nγ
    hierarchical    2(G-1)α_l + 2(G-1)/G · nβ_l + 2(N-1)α + 2(N-1)/N · nβ + (p-1)/p · nγ

The hierarchical's inter-node phase moves ``2(N-1)/N · n`` through each uplink: the ``G`` rings
across the nodes run side by side on shards of ``n/G``, and all ``G`` go through the same
uplink (with one NIC per rank instead, each carries its own ``2(N-1)/(NG) · n``: the
registry's ``hierarchical_cost``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ..schedules import CostTerms, Op, Schedule


@dataclass(frozen=True, slots=True)
class UplinkTraffic:
    """Bytes through each node's uplink over one all-reduce, by node: ``sent`` leave the node,
    ``received`` enter it."""

    sent: dict[int, float]
    received: dict[int, float]

    @property
    def busiest(self) -> float:
        """The most bytes one uplink carries in one direction."""
        return max([*self.sent.values(), *self.received.values()], default=0.0)


@dataclass(frozen=True, slots=True)
class RingCrossings:
    """How a ring order meets the node boundaries: ``total`` hops between nodes, and the most
    hops that leave one node (``busiest``: chunks through its uplink per ring step)."""

    total: int
    busiest: int


def uplink_traffic(schedule: Schedule, nbytes: float, placement: Sequence[int]) -> UplinkTraffic:
    """The bytes each node's uplink carries out and in while ``schedule`` all-reduces ``nbytes``."""
    _check_nodes(schedule, placement)
    chunk = nbytes / schedule.num_chunks
    sent: dict[int, float] = {node: 0.0 for node in placement}
    received: dict[int, float] = dict(sent)
    for step in schedule.steps:
        for t in step.transfers:
            if placement[t.src] != placement[t.dst]:
                sent[placement[t.src]] += chunk
                received[placement[t.dst]] += chunk
    return UplinkTraffic(sent, received)


def ring_crossings(order: Sequence[int], placement: Sequence[int]) -> RingCrossings:
    """How often the ring ``order[0] -> order[1] -> ... -> order[0]`` crosses a node boundary.

        >>> ring_crossings((0, 1, 2, 3), placement=(0, 1, 0, 1))
        RingCrossings(total=4, busiest=2)
        >>> ring_crossings((0, 2, 1, 3), placement=(0, 1, 0, 1))
        RingCrossings(total=2, busiest=1)
    """
    if sorted(order) != list(range(len(placement))):
        raise ValueError(f"order {tuple(order)} is not an order of the {len(placement)} ranks placement describes")
    leaving: dict[int, int] = defaultdict(int)
    for place, rank in enumerate(order):
        after = order[(place + 1) % len(order)]
        if placement[rank] != placement[after]:
            leaving[placement[rank]] += 1
    return RingCrossings(total=sum(leaving.values()), busiest=max(leaving.values(), default=0))


def uplink_terms(schedule: Schedule, placement: Sequence[int]) -> CostTerms:
    """The schedule's cost terms on two tiers, step by step (see the module docstring): per byte
    of the buffer, the bytes through the busiest uplink direction of each step that crosses
    nodes, and through the busiest link of each step that does not."""
    _check_nodes(schedule, placement)
    chunk = 1.0 / schedule.num_chunks
    messages = moved = reduced = local_messages = local_moved = 0.0
    for step in schedule.steps:
        links: dict[tuple[int, int], float] = defaultdict(float)
        uplinks: dict[tuple[str, int], float] = defaultdict(float)
        added: dict[tuple[int, int], float] = defaultdict(float)
        for t in step.transfers:
            links[(t.src, t.dst)] += chunk
            if t.op is Op.REDUCE:
                added[(t.src, t.dst)] += chunk
            if placement[t.src] != placement[t.dst]:
                uplinks[("out", placement[t.src])] += chunk
                uplinks[("in", placement[t.dst])] += chunk
        if not links:
            continue
        reduced += max(added.values(), default=0.0)
        if uplinks:
            messages += 1
            moved += max(uplinks.values())
        else:
            local_messages += 1
            local_moved += max(links.values())
    return CostTerms(messages=messages, bytes=moved, reduced=reduced, local_messages=local_messages, local_bytes=local_moved)


def ring_uplink_cost(world_size: int, *, crossings: RingCrossings) -> CostTerms:
    """The ring's closed form on two tiers: ``2(p-1)`` steps of ``n/p`` per link, ``h`` links of
    them through the busiest uplink (``h = crossings.busiest``; none: all steps inside one node)."""
    p = world_size
    steps, share = 2 * (p - 1), (p - 1) / p
    if crossings.busiest == 0:
        return CostTerms(reduced=share, local_messages=steps, local_bytes=2 * share)
    return CostTerms(messages=steps, bytes=2 * share * crossings.busiest, reduced=share)


def hierarchical_uplink_cost(world_size: int, *, ranks_per_node: int) -> CostTerms:
    """The hierarchical's closed form when each node's ``G`` ranks share its uplink: rings inside
    the nodes, then ``G`` rings across them whose shards all go through the same uplink."""
    p, g = world_size, ranks_per_node
    nodes = p // g
    return CostTerms(
        messages=2 * (nodes - 1), bytes=2 * (nodes - 1) / nodes, reduced=(p - 1) / p,
        local_messages=2 * (g - 1), local_bytes=2 * (g - 1) / g,
    )


def _check_nodes(schedule: Schedule, placement: Sequence[int]) -> None:
    if len(placement) != schedule.world_size:
        raise ValueError(
            f"placement names the nodes of {len(placement)} ranks but the {schedule.algorithm} schedule has "
            f"{schedule.world_size}: give one node per rank"
        )
