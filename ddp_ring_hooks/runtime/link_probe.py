"""Measure the bandwidth of every directed link between the ranks of a (gloo) group.

Pairs of ranks that share no rank use separate links, so they are timed at the same time,
in the rounds of the circle method (:func:`ddp_ring_hooks.links.exchange_rounds`)::

    p = 4:   round 0: 0⇄3 1⇄2    round 1: 0⇄2 1⇄3    round 2: 0⇄1 2⇄3

(``one_pair_at_a_time``: each pair in a round of its own, ``p(p-1)/2`` rounds. On two tiers
pairs of one round that cross the same uplink share it, and a link then reads slower than
the same link alone: what ``ring_order="measured"`` must not mistake for a slower link.)

1. **Warm up.** Every pair exchanges one message untimed (gloo may open its connections on
   first use; the kernel sizes its TCP buffers).
2. **Each repeat, each round:** all ranks meet at a barrier, so rounds never overlap (on
   two tiers a pair of the next round would share an uplink with one still running). Then
   each pair shakes hands (a one-byte exchange: both ends start within one message's latency
   of each other) and exchanges ``message_bytes`` in both directions at once.
3. **Receive first.** Each rank posts the receive from its partner *before* the send to it:
   gloo queues a rank's "receive posted" notice behind a payload it is already writing to
   that peer, so with the send first the two directions would take turns instead of sharing
   the full-duplex link.
4. **Time by the receiver:** the seconds from the post until this rank's receive completed
   are the partner→rank link's time (the send may finish a little later: its bytes were in
   the partner's socket buffer).
5. Every rank's times are gathered, with each rank's node (``GROUP_RANK``, else
   ``rank // LOCAL_WORLD_SIZE``, torchrun's variables) and host name, into the same
   :class:`~ddp_ring_hooks.links.LinkMatrix` on every rank.

gloo only (TCP between hosts, the CPU's memory): the probe measures the hosts' network, as
the hook's gloo transfers see it.
"""

from __future__ import annotations

import math
import os
import socket
import time

import torch
import torch.distributed as dist

from ..links import LinkMatrix, LinkSample, exchange_rounds, partner_in
from .collectives import all_gather_ints

#: Where the ranks' nodes came from, as the link matrix records it (index: the code gathered).
_NODE_SOURCES = (None, "GROUP_RANK", "LOCAL_WORLD_SIZE")


def measure_links(
    *, message_bytes: int, repeats: int, group: dist.ProcessGroup | None = None, one_pair_at_a_time: bool = False,
) -> LinkMatrix:
    """Time ``repeats`` exchanges of ``message_bytes`` on every pair of ranks of ``group``
    (default: the default group; gloo), both directions at once; every rank returns the same
    matrix, in the group's ranks. Collective over ``group``."""
    if not isinstance(message_bytes, int) or message_bytes < 1:
        raise ValueError(f"message_bytes must be a whole number of bytes >= 1, got {message_bytes!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a whole number >= 1, got {repeats!r}")
    group = group if group is not None else dist.group.WORLD
    backend = _backend_name(group)
    if backend != "gloo":
        raise ValueError(f"the link probe runs on gloo (TCP between hosts), not {backend!r}: "
                         "initialize the process group with backend='gloo'")
    rank, world_size = group.rank(), group.size()
    if world_size < 2:
        raise ValueError("measuring links needs 2 ranks or more; start it under torchrun with several ranks")
    rounds = exchange_rounds(world_size)
    if one_pair_at_a_time:
        rounds = tuple((pair,) for pairs in rounds for pair in pairs)
    outgoing = torch.full((message_bytes,), rank % 256, dtype=torch.uint8)
    incoming = torch.empty_like(outgoing)
    for pairs in rounds:  # 1. warm up
        partner = partner_in(pairs, rank)
        dist.barrier(group=group)
        if partner is not None:
            _exchange(outgoing, incoming, partner, group)
    seconds = torch.full((repeats, len(rounds)), math.nan, dtype=torch.float64)
    for repeat in range(repeats):  # 2.
        for index, pairs in enumerate(rounds):
            partner = partner_in(pairs, rank)
            dist.barrier(group=group)
            if partner is not None:
                seconds[repeat, index] = _exchange(outgoing, incoming, partner, group)
    gathered = [torch.empty_like(seconds) for _ in range(world_size)]  # 5.
    dist.all_gather(gathered, seconds, group=group)
    samples = tuple(
        LinkSample(src=partner, dst=receiver, nbytes=message_bytes, seconds=float(times[repeat, index]))
        for receiver, times in enumerate(gathered) for repeat in range(repeats)
        for index, pairs in enumerate(rounds) if (partner := partner_in(pairs, receiver)) is not None
    )
    nodes, nodes_from = group_nodes(group)
    hosts = _host_names(group)
    return LinkMatrix(world_size=world_size, samples=samples, message_bytes=message_bytes, repeats=repeats,
                      nodes=nodes, nodes_from=nodes_from, hosts=tuple(hosts), backend=backend)


def _backend_name(group: dist.ProcessGroup) -> str:
    """The group's backend as c10d names it; for a side group c10d does not know (the control
    group of an NCCL group, :mod:`.group_context`), its own backend's name."""
    try:
        return str(dist.get_backend(group))
    except ValueError:
        return group.name()


#: Bytes of a host name in the probe's gather (longer names are cut: they only label the matrix).
HOST_NAME_BYTES = 64


def _host_names(group: dist.ProcessGroup) -> tuple[str, ...]:
    """Every rank's host name, by group rank (one all-gather of fixed-size byte rows: the
    group's own call, which a side group has too)."""
    name = socket.gethostname().encode()[:HOST_NAME_BYTES]
    row = torch.zeros(HOST_NAME_BYTES, dtype=torch.uint8)
    row[: len(name)] = torch.tensor(list(name), dtype=torch.uint8)
    table = [torch.empty_like(row) for _ in range(group.size())]
    dist.all_gather(table, row, group=group)
    return tuple(bytes(r.tolist()).rstrip(b"\0").decode(errors="replace") for r in table)


def _exchange(outgoing: torch.Tensor, incoming: torch.Tensor, partner: int, group) -> float:
    """Both directions with ``partner`` (a rank of ``group``) at once (3.); seconds until this
    rank had its message (4.)."""
    _both_ways(torch.zeros(1, dtype=torch.uint8), torch.empty(1, dtype=torch.uint8), partner, group)  # the handshake
    start = time.perf_counter()
    return _both_ways(outgoing, incoming, partner, group) - start


def _both_ways(outgoing: torch.Tensor, incoming: torch.Tensor, partner: int, group) -> float:
    """Receive from ``partner`` and send to it, the receive posted first; the clock when the
    receive completed (then the send is waited for too)."""
    receive = group.recv([incoming], partner, 0)  # the group's own calls: group ranks, and a side group has them
    send = group.send([outgoing], partner, 0)
    receive.wait()
    received = time.perf_counter()
    send.wait()
    return received


def group_nodes(group: dist.ProcessGroup | None = None) -> tuple[tuple[int, ...] | None, str | None]:
    """Each rank's node (``GROUP_RANK``, else ``rank // LOCAL_WORLD_SIZE``: torchrun's variables)
    and where it came from, the same source on every rank of ``group``, else ``None``s.
    Collective over ``group`` (one small all-gather)."""
    return nodes_of(all_gather_ints(node_row(dist.get_rank()), group, device="cpu"))


def node_row(rank: int) -> list[int]:
    """This process's ``[node, source]`` to gather (``rank``: its global rank, as torchrun's
    ``LOCAL_WORLD_SIZE`` counts): the node from ``GROUP_RANK``, else ``rank // LOCAL_WORLD_SIZE``;
    ``source`` the code of where it came from (an index of :data:`_NODE_SOURCES`, 0: unknown)."""
    if "GROUP_RANK" in os.environ:
        return [int(os.environ["GROUP_RANK"]), 1]
    if "LOCAL_WORLD_SIZE" in os.environ:
        return [rank // int(os.environ["LOCAL_WORLD_SIZE"]), 2]
    return [-1, 0]


def nodes_of(rows) -> tuple[tuple[int, ...] | None, str | None]:
    """Every rank's gathered :func:`node_row`: the nodes and their source, when every rank
    knew its node the same way, else ``None``s."""
    sources = {int(source) for _, source in rows}
    if len(sources) != 1 or 0 in sources:
        return None, None
    return tuple(int(node) for node, _ in rows), _NODE_SOURCES[sources.pop()]
