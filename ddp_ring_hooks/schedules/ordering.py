"""The order the ring visits the ranks in: the ``ring_order`` and ``node_of`` options.

A ring is as fast as its slowest link, and on a cluster the slow links are the ones between
nodes. Numbered node by node, the ring crosses into each node once and out of it once; numbered
across nodes, every hop crosses, and each node's uplink carries twice the bytes
(``→`` a hop inside a node, ``⇒`` a hop between nodes)::

    nodes A = {0, 1}, B = {2, 3}                 nodes A = {0, 2}, B = {1, 3}
    ring_order="rank"   0 → 1 ⇒ 2 → 3 ⇒ 0        ring_order="rank"     0 ⇒ 1 ⇒ 2 ⇒ 3 ⇒ 0   4 crossings
                        2 crossings              ring_order="hosts"    0 → 2 ⇒ 1 → 3 ⇒ 0   2 crossings
                                                 (or (0, 2, 1, 3))

``ring_order`` takes:

1. ``"rank"`` (the default): ``0 -> 1 -> ... -> p-1 -> 0``, the group's own numbering.
2. ``"hosts"``: the ranks grouped by node, nodes in increasing node number, ranks in rank
   order inside a node. Which node a rank is on comes from ``node_of`` (one node number per
   rank of the group, e.g. every rank's ``GROUP_RANK``, the same tuple on every rank), the
   override for launchers that number ranks across nodes (``srun --distribution=cyclic``,
   ``mpirun --map-by node``) and for an emulated cluster whose hosts say nothing. Without
   ``node_of`` it needs torchrun (it sets ``GROUP_RANK``), which numbers the ranks of a job
   node by node in ``GROUP_RANK`` order (every subgroup keeps that order): there ``"hosts"``
   is the rank order, and saying so costs nothing.
3. ``"measured"``: the order whose slowest link is fastest, from a short probe of every link
   of the group when the hook state (or the first ``all_reduce`` on the group) is built
   (``ddp_ring_hooks.runtime.ring_orders``; the choice: ``ddp_ring_hooks.links.ring_order``).
   The probe needs the process group, so a schedule is never built with ``"measured"``: it
   is settled into the permutation it chose first.
4. A permutation of the group's ranks, e.g. ``(0, 2, 1, 3)``: the ring visits them in that
   order (a list works too; it is kept as a tuple). From a ``ddp-ring-hooks links --json``
   file: ``ring_order=load_link_matrix(path).best_ring()``.

What the group must say before an order is a permutation (:func:`group_needs`) and the options
once it has (:func:`settled`) are the runtime's to ask and this module's to spell: with
``"hosts"`` and no ``node_of``, each rank's node (its ``GROUP_RANK``, gathered across the
ranks: right under any launcher that sets it, not only where ranks are numbered node by node);
with ``"measured"``, the links.

The resolved order is part of the schedule: its steps (so the layout check, which compares
schedule checksums across ranks, stops ranks that disagree before any gradient moves) and its
``options``, which carry the permutation, so drawings and costs read it from there.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .ir import Schedule, Step, Transfer

RANK = "rank"
HOSTS = "hosts"
MEASURED = "measured"
NAMED_ORDERS = (RANK, HOSTS, MEASURED)

#: What :func:`group_needs` answers: the ranks' nodes, or their links measured.
NEEDS_NODES, NEEDS_LINKS = "nodes", "links"


def check_ring_order(value: object) -> str | None:
    """The registry's check of a ``ring_order`` value, before the world size is known."""
    if isinstance(value, str):
        return None if value in NAMED_ORDERS else f"is not one of {', '.join(map(repr, NAMED_ORDERS))} or a list of ranks"
    if not _is_int_sequence(value):
        return "must be 'rank', 'hosts', 'measured', or a list of the group's ranks in ring order, e.g. [0, 2, 1, 3]"
    if len(set(value)) != len(value):
        return "names a rank twice: list every rank of the group once"
    return None if min(value, default=0) >= 0 else "names a negative rank"


def parse_numbers(text: str) -> object:
    """A command-line value of ``ring_order`` or ``node_of``: ``"0,2,1,3"`` -> ``(0, 2, 1, 3)``;
    anything else (``"hosts"``) is kept as the word it is, for the option's check to judge."""
    try:
        return tuple(int(word) for word in text.split(","))
    except ValueError:
        return text


def check_node_of(value: object) -> str | None:
    """The registry's check of a ``node_of`` value: ``None`` or one node number per rank."""
    if value is None or (_is_int_sequence(value) and min(value, default=0) >= 0):
        return None
    return "must be one node number (an integer >= 0) per rank of the group, e.g. (0, 1, 0, 1)"


def ring_positions(world_size: int, ring_order: object, node_of: Sequence[int] | None) -> tuple[int, ...]:
    """``order[i]``: the rank at position ``i`` of the ring (see the module docstring)."""
    if node_of is not None:
        if ring_order != HOSTS:
            raise ValueError(
                f"node_of is read only by ring_order='hosts' (got ring_order={ring_order!r}): "
                "pass ring_order='hosts' to group the ranks by node, or drop node_of"
            )
        if len(node_of) != world_size:
            raise ValueError(f"node_of names the nodes of {len(node_of)} ranks but the group has {world_size}: give one per rank")
    if ring_order == RANK:
        return tuple(range(world_size))
    if ring_order == MEASURED:
        raise ValueError(
            "ring_order='measured' is chosen on the process group, by a probe of its links when the hook "
            "state (or all_reduce's first call) is built; to draw or price a ring, give its order, e.g. "
            "ring_order=load_link_matrix('links.json').best_ring() (ddp_ring_hooks.links) or 0,2,1,3"
        )
    if ring_order == HOSTS:
        if node_of is not None:
            return tuple(sorted(range(world_size), key=lambda rank: (node_of[rank], rank)))
        if "GROUP_RANK" not in os.environ:
            raise ValueError(
                "ring_order='hosts' needs to know which node each rank runs on: pass node_of=(node of "
                "rank 0, node of rank 1, ...), the same on every rank, or launch with torchrun (which "
                "numbers the ranks node by node, so that 'hosts' is the rank order)"
            )
        return tuple(range(world_size))
    order = tuple(ring_order)
    if sorted(order) != list(range(world_size)):
        raise ValueError(
            f"ring_order={order!r} is not an order of the group's {world_size} ranks: list each of "
            f"0..{world_size - 1} once"
        )
    return order


def group_needs(options: Mapping[str, object]) -> str | None:
    """What resolved ``options`` need from the process group before their ring order is a
    permutation: :data:`NEEDS_LINKS` (``"measured"``), :data:`NEEDS_NODES` (``"hosts"`` without
    ``node_of``), or ``None`` (options without a ring order, too)."""
    order = options.get("ring_order")
    if order == MEASURED:
        return NEEDS_LINKS
    if order == HOSTS and options.get("node_of") is None:
        return NEEDS_NODES
    return None


def settled(
    options: Mapping[str, object], *, nodes: Sequence[int] | None = None, measured: Sequence[int] | None = None,
) -> dict[str, object]:
    """``options`` with what the group said: ``"hosts"`` gets ``node_of=nodes`` (left as it is
    when the nodes are unknown, ``None``: building it then names the fix), ``"measured"``
    becomes the ``measured`` order."""
    need = group_needs(options)
    if need == NEEDS_NODES and nodes is not None:
        return {**options, "node_of": tuple(nodes)}
    if need == NEEDS_LINKS:
        if measured is None:
            raise ValueError("ring_order='measured' needs the order the probe measured")
        return {**options, "ring_order": tuple(measured)}
    return dict(options)


def has_ring_order(options: Mapping[str, object]) -> bool:
    """Whether resolved ``options`` have a ring order (their algorithm's record declares one)."""
    return "ring_order" in options


def ring_order_of(options: Mapping[str, object], world_size: int) -> tuple[int, ...] | None:
    """The permutation resolved ``options`` make the ring visit (``None``: the options have no
    ring order, or one not yet settled on the group)."""
    if "ring_order" not in options:
        return None
    try:
        return ring_positions(world_size, options["ring_order"], options.get("node_of"))
    except ValueError:
        return None


def ordered_options(ring_order: object, node_of: Sequence[int] | None, order: tuple[int, ...]) -> tuple[tuple[str, object], ...]:
    """What the schedule records: the permutation itself, unless the caller kept the rank order."""
    if ring_order == RANK:
        return ()
    return (("node_of", None if node_of is None else tuple(node_of)), ("ring_order", order))


def schedule_order(schedule: Schedule) -> tuple[int, ...]:
    """The ring order a schedule was built with (the rank order when it has none)."""
    order = dict(schedule.options).get("ring_order")
    return order if isinstance(order, tuple) else tuple(range(schedule.world_size))


def schedule_nodes(schedule: Schedule) -> tuple[int, ...] | None:
    """The node of each rank as the schedule's options say: ``node_of`` when it was given, else
    ``local_size`` consecutive places of the ring order per node (hierarchical); ``None`` when
    the options say nothing about nodes."""
    options = dict(schedule.options)
    if options.get("node_of") is not None:
        return tuple(options["node_of"])
    local_size = options.get("local_size")
    if not local_size:
        return None
    nodes = [0] * schedule.world_size
    for place, rank in enumerate(schedule_order(schedule)):
        nodes[rank] = place // local_size
    return tuple(nodes)


def grouped_by_size(schedule: Schedule) -> bool:
    """Whether the schedule groups its ranks into nodes of a size of its own (``local_size``:
    hierarchical) rather than by what the ranks said (``node_of``) or not at all."""
    options = dict(schedule.options)
    return options.get("node_of") is None and bool(options.get("local_size"))


@dataclass(frozen=True, slots=True)
class RingCrossings:
    """How a ring order meets the node boundaries: ``total`` hops between nodes, and the most
    hops that leave one node (``busiest``: chunks through its uplink per ring step)."""

    total: int
    busiest: int


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


def relabel(steps: Sequence[Step], order: tuple[int, ...]) -> tuple[Step, ...]:
    """``steps`` written for ring positions, with position ``i`` played by rank ``order[i]``."""
    if order == tuple(range(len(order))):
        return tuple(steps)
    return tuple(
        Step(step.phase, tuple(Transfer(order[t.src], order[t.dst], t.chunk, t.op) for t in step.transfers))
        for step in steps
    )


def _is_int_sequence(value: object) -> bool:
    return isinstance(value, (tuple, list)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
