"""The two directions of a pair of ranks on two gloo transports: the group, and the pair's own.

When messages cross a pair of ranks both ways (the ring at 2 ranks, halving-doubling's
exchanges, a tree's reduce up and broadcast down, two lanes' buckets in different phases), the
executor sends the message from the lower to the higher rank on a gloo transport of that pair
alone (a 2-rank gloo backend), and the message the other way on the group itself. Sender and
receiver decide alike (they compare the same two ranks, and both made the pair in the same
collective setup), so both ends post every message on the same transport, with its usual tag::

    rank 0  ══ pair (0, 1) ══>  rank 1      lower -> higher: the pair's own socket
    rank 0  <═══ group ═══════  rank 1      higher -> lower: the group's own socket

Why. gloo keeps one pair object per pair of ranks and transport: one TCP socket and one lock
(``gloo/transport/tcp/pair.cc``). A thread writing a payload holds the pair's lock; the event
loop that should read the payload coming the other way fails to take it and tries again at
once, spinning. Where copies set the pace (loopback) that alone made the 2-rank ring spend
measurably more CPU and time (``docs/benchmarks.md``); and when both payloads are large
enough to fill the sockets, both writers wait for readers that wait for their locks: two lanes
of a tree at 2 ranks on one socket each way hung for good (a bucket's broadcast, 0 to 1,
against the next one's reduce, 1 to 0; the stall watchdog named the cycle). On a socket per
direction each lock has one writer.

Which pairs (:func:`~.group_context.two_way_pairs`): those that some step of the schedules sends
on one way and some step the other, the same for every buffer size (the tests check it); a
ring at more than 2 ranks sends one way round and needs none, nor does ``native``.

Cost, per rank: one socket per such pair it is in (tree: its parent and children; naive's
root: every other rank; halving-doubling: log2 p), no thread (the pair shares the group's gloo
device, whose event loop serves both, and takes no worker threads: point-to-point never uses
them), a rendezvous of the two ranks through the group's store when it is made. Made by the
group's context (:mod:`~.group_context`) in its collective setup, in one order on every rank
(sorted pairs: a pair's two ranks both reach it, whatever the others do); only the pair's ranks
take part, on the group's store, with the group's timeout, so a hung peer fails after the same
time on either transport.
"""

from __future__ import annotations

import torch.distributed as dist

from .compat import gloo_options_like, group_store


def make_pair(group: dist.ProcessGroup, pair: tuple[int, int], *, generation: int) -> dist.ProcessGroupGloo:
    """The gloo transport of ``pair`` (two ranks of ``group``, low first), made now: a
    rendezvous with the other rank of the pair through the group's store, under a key prefix
    of its own (``generation``: how many times this context made it before, the same on both
    ranks, so a pair made again after a close never meets the old one's keys).

    Not ``dist.new_group``: a group made on some ranks only changes the names of every later
    such group on those ranks (see :func:`~.group_context.side_group`)."""
    low, high = pair
    me = group.rank()
    if me not in pair:
        raise ValueError(f"rank {me} is not in the pair {pair}")
    store = dist.PrefixStore(f"ddp_ring_hooks.pair/{low}-{high}/{generation}/", group_store(group))
    options = gloo_options_like(group)
    options._threads = 0  # point-to-point only: no worker thread
    return dist.ProcessGroupGloo(store, 0 if me == low else 1, 2, options)
