"""Ring orders that the process group settles: ``"hosts"`` by the ranks' nodes, ``"measured"`` by its links.

A schedule is data, built without a process group, so an order that depends on the group is
made a permutation first, when the hook state is built (or on ``all_reduce``'s first call on
a group), on every rank at once::

    ring_order="hosts", no node_of     each rank's node (GROUP_RANK, else rank // LOCAL_WORLD_SIZE),
                                       all-gathered: node_of=(0, 1, 0, 1)
    ring_order="measured"              every link of the group timed, one pair at a time
                                       (measure_links: 1 MiB both ways at once, 2 repeats), then
                                       the order whose slowest link is fastest (links.best_ring):
                                       ring_order=(0, 2, 1, 3)

1. Every rank gathers the same facts (the all-gathered nodes; the probe's matrix, the same on
   every rank), and the choice is a deterministic function of them, so every rank settles on
   the same order; the layout check compares the schedules across ranks before any gradient
   moves, should they not.
2. One pair at a time, because pairs timed together that cross the same uplink share it: a
   link would read slower than it is alone, and the ring would be chosen by the probe's own
   traffic. That is ``p(p-1)/2`` rounds of one 1 MiB exchange (6 at 4 ranks, 120 at 16; on
   the lab's 400 Mbit/s uplinks about 20 ms each); for large groups measure once with
   ``ddp-ring-hooks links --json`` and pass ``ring_order=load_link_matrix(path).best_ring()``.
   1 MiB, because a shaped or congested link lets its first bytes through at once (the lab's
   ``tbf`` passes 5 ms of its rate, 250 KB at 400 Mbit/s): smaller messages hide the slow link.
3. What the group said is kept per group, in its context
   (:class:`~ddp_ring_hooks.runtime.group_context.GroupContext`: ``nodes``, ``measured``):
   ``all_reduce(t, ring_order="measured")`` probes on its first call only (collective, like that
   call), and ``auto``'s ring and hierarchical candidates share one probe. The nodes are gathered the first time a group is met, whatever
   the options: the summary and the advisor say from them what a ring order costs
   (:func:`known_nodes`).

On NCCL the probe runs on the group's gloo control group (the same ranks, over TCP: the
hosts' network). Nothing here spells an option: :func:`~ddp_ring_hooks.schedules.group_needs`
and :func:`~ddp_ring_hooks.schedules.settled` read and write the options.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch.distributed as dist

from ..schedules import NEEDS_LINKS, NEEDS_NODES, group_needs, settled
from .collectives import all_gather_ints
from .group_context import GroupContext, context_of
from .link_probe import group_nodes, measure_links

#: The probe of ``"measured"``: bytes each way per pair, and timed exchanges per pair (the median counts).
PROBE_BYTES = 1 << 20
PROBE_REPEATS = 2

logger = logging.getLogger("ddp_ring_hooks.ring_order")


def settle_ring_order(options: Mapping[str, object], group: dist.ProcessGroup | None = None) -> dict:
    """``options`` (an algorithm's, or ``auto``'s for its candidates) with a ring order that needs
    ``group`` made a permutation (see the module docstring).

    Collective over ``group`` the first time it meets the group, whatever the options (so ranks
    whose options differ still meet in the same collectives: the layout check then names the
    difference): one small all-gather of every rank's node and of whether it wants the links
    measured, refused on every rank when only some do; then the probe, if they all do. After
    that, local and free, but for a first ``"measured"`` on a group met before (which probes:
    every rank must ask for it, as every rank must make a call it is in). Before
    ``init_process_group``: the options as they are (an order that needs the group then fails
    where its schedule is built, naming the fix)."""
    if not (dist.is_available() and dist.is_initialized()):
        return dict(options)
    context = context_of(group)
    need = group_needs(options)
    with context.lock:
        met = context.met
    if not met:
        _meet(context, wants_links=need == NEEDS_LINKS)
    if need == NEEDS_NODES:
        return settled(options, nodes=known_nodes(group))
    if need == NEEDS_LINKS:
        with context.lock:
            order = context.measured
        if order is None:
            order = _measure(context)
        return settled(options, measured=order)
    return dict(options)


def known_nodes(group: dist.ProcessGroup | None = None) -> tuple[int, ...] | None:
    """The node of each rank of ``group`` as its ranks said when a hook state or ``all_reduce``
    first met it (``GROUP_RANK``, else ``rank // LOCAL_WORLD_SIZE``); ``None`` when they did
    not say, or the group was not met. Local: no collective."""
    context = context_of(group)
    with context.lock:
        return context.nodes


def _meet(context: GroupContext, *, wants_links: bool) -> None:
    group = context.group
    if dist.get_world_size(group) == 1:
        nodes, wanting = (0,), [wants_links]
    else:
        probe = context.control_group()
        nodes, _ = group_nodes(probe)
        wanting = [bool(row[0]) for row in all_gather_ints([int(wants_links)], probe, device="cpu")]
    with context.lock:
        context.met, context.nodes = True, nodes
    if any(wanting) and not all(wanting):
        asking = [rank for rank, wants in enumerate(wanting) if wants]
        raise ValueError(
            f"ring_order='measured' on ranks {', '.join(map(str, asking))} only: the probe of the links needs every "
            "rank of the group; pass the same ring_order on every rank"
        )
    if all(wanting):
        _measure(context)


def _measure(context: GroupContext) -> tuple[int, ...]:
    """The probe (collective) and its order, kept for the group."""
    group = context.group
    if dist.get_world_size(group) <= 3:  # one ring, up to its direction: nothing to measure
        order: tuple[int, ...] = tuple(range(dist.get_world_size(group)))
    else:
        matrix = measure_links(
            message_bytes=PROBE_BYTES, repeats=PROBE_REPEATS, group=context.control_group(), one_pair_at_a_time=True,
        )
        order = matrix.best_ring()
        rows = matrix.rows()
        slowest = min(rows[src][dst] for src, dst in zip(order, (*order[1:], order[0])))
        logger.info(
            "measured ring order %s (its slowest hop %.1f MB/s; %d links timed one pair at a time)",
            ", ".join(map(str, order)), slowest / 1e6, len(rows) * (len(rows) - 1),
        )
    with context.lock:
        context.measured = order
    return order
