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
registry's ``hierarchical_cost``). Pipelined in ``k`` segments it pays ``2(N-1)k`` uplink
latencies and hides all but ``2(G-1)/k`` of its intra-node bytes behind the uplink.

A network of this shape is described by :class:`TwoTier` (its :class:`~.formulas.Links`: the
uplink's ``α, β``, the links inside a node; which rank is on which node); ``TwoTier.predict`` prices any algorithm on it,
for ``model --placement``, ``auto``'s ``network=`` and the advisor.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ..schedules import (
    CostTerms, Op, RingCrossings, Schedule, build_schedule, formula_for, get_algorithm, hierarchical_uplink_cost,
    resolve_options, ring_crossings, ring_uplink_cost, shape_options,
)
from .formulas import Links, on_the_wire, price

__all__ = [
    "RingCrossings", "TwoTier", "UplinkTraffic", "hierarchical_uplink_cost", "ring_crossings", "ring_uplink_cost",
    "two_tier_terms", "uplink_terms", "uplink_traffic",
]


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
        if uplinks:  # the uplink sets the step's pace: its links' additions are the ones that count
            messages += 1
            moved += max(uplinks.values())
            reduced += max((v for (src, dst), v in added.items() if placement[src] != placement[dst]), default=0.0)
        else:
            reduced += max(added.values(), default=0.0)
            local_messages += 1
            local_moved += max(links.values())
    return CostTerms(messages=messages, bytes=moved, reduced=reduced, local_messages=local_messages, local_bytes=local_moved)


@dataclass(frozen=True, slots=True)
class TwoTier:
    """A two-tier network: ``links`` (:class:`~.formulas.Links`), whose α, β are each node's
    uplink, shared by the node's ranks, and whose ``local`` are the links inside a node.

    Which rank is on which node: ``placement`` (the node of each rank, e.g. ``(0, 1, 0, 1)``),
    or ``ranks_per_node`` (nodes of that many consecutive ranks, for any world size). The
    lab's two-tier network at 400 Mbit/s, nodes of 2::

        >>> TwoTier(Links(100e-6, 1 / 50e6, local=Links(20e-6, 1 / 1e9)), ranks_per_node=2)
    """

    links: Links
    placement: tuple[int, ...] | None = None
    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        if (self.placement is None) == (self.ranks_per_node is None):
            raise ValueError("TwoTier needs the ranks' nodes: give placement=(node of each rank) or ranks_per_node=G, not both")
        if not isinstance(self.links, Links):
            raise TypeError(f"TwoTier takes its links as a Links(alpha, beta, local=Links(...)), got {self.links!r}")
        if self.placement is not None:
            object.__setattr__(self, "placement", tuple(self.placement))

    def nodes(self, world_size: int) -> tuple[int, ...]:
        """The node of each of ``world_size`` ranks (a ``ValueError`` when the placement is of
        another world size, or the node size does not divide it)."""
        if self.placement is not None:
            if len(self.placement) != world_size:
                raise ValueError(f"this network places {len(self.placement)} ranks, not {world_size}")
            return self.placement
        if world_size % self.ranks_per_node:
            raise ValueError(f"nodes of {self.ranks_per_node} ranks do not divide {world_size} ranks")
        return tuple(rank // self.ranks_per_node for rank in range(world_size))

    def terms(self, algorithm: str, nbytes: float, world_size: int, **options) -> CostTerms:
        """The algorithm's cost terms on this network (:func:`two_tier_terms`)."""
        return two_tier_terms(algorithm, world_size, self.nodes(world_size), nbytes=nbytes, **options)

    def predict(self, algorithm: str, nbytes: float, world_size: int, **options) -> float:
        """Predicted seconds to all-reduce ``nbytes`` with ``algorithm`` (its ``options``) here."""
        return price(self.terms(algorithm, nbytes, world_size, **options), nbytes, self.links)


def two_tier_terms(algorithm: str, world_size: int, placement: Sequence[int], *, nbytes: float = 0, **options) -> CostTerms:
    """``algorithm``'s cost terms when the ranks' nodes are ``placement`` and each node's ranks
    share its uplink: the registry's closed form (``uplink_cost``: the ring's and the
    hierarchical's, any world size at once) where it has one, else counted from the schedule
    (:func:`uplink_terms`). An algorithm without a schedule is priced as the one it is fitted
    as (``native`` as the ring); options chosen by size, for an ``nbytes`` buffer."""
    name = formula_for(algorithm)
    if len(placement) != world_size:
        raise ValueError(f"placement names the nodes of {len(placement)} ranks, not {world_size}: give one node per rank")
    resolved = resolve_options(name, options, nbytes=int(nbytes))
    shaping = shape_options(name, resolved)  # the wire is priced on top, as for every algorithm
    closed = get_algorithm(name).uplink_cost
    terms = closed(world_size, tuple(placement), **shaping) if closed is not None else None
    if terms is None:
        frozen = tuple(sorted((key, tuple(value) if isinstance(value, list) else value) for key, value in shaping.items()))
        terms = _counted_terms(name, world_size, tuple(placement), frozen)
    return on_the_wire(terms, resolved)


@functools.lru_cache(maxsize=256)
def _counted_terms(algorithm: str, world_size: int, placement: tuple[int, ...], options: tuple) -> CostTerms:
    return uplink_terms(build_schedule(algorithm, world_size, **dict(options)), placement)


def _check_nodes(schedule: Schedule, placement: Sequence[int]) -> None:
    if len(placement) != schedule.world_size:
        raise ValueError(
            f"placement names the nodes of {len(placement)} ranks but the {schedule.algorithm} schedule has "
            f"{schedule.world_size}: give one node per rank"
        )
