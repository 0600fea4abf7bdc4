"""The two directions of an exchanging pair of ranks on two gloo transports: the group, and a pair.

When a step of a schedule exchanges chunks with one peer (both ranks send to each other: the
ring at 2 ranks, every step of halving-doubling, hierarchical's leaders), the executor sends the
message from the lower to the higher rank on a gloo transport of that pair alone (its *upward*
transport: a 2-rank gloo backend), and the message the other way on the group itself. Sender
and receiver decide alike (they compare the same two ranks, and both made the pair in the same
collective setup), so both ends post every message on the same transport, with its usual tag::

    rank 0  ══ pair (0, 1) ══>  rank 1      lower -> higher: the pair's own socket
    rank 0  <═══ group ═══════  rank 1      higher -> lower: the group's own socket

Why. gloo keeps one pair object per pair of ranks and transport: one TCP socket and one lock
(``gloo/transport/tcp/pair.cc``). When both payloads of an exchange cross one pair at once,
whichever thread writes a payload holds the pair's lock, and the event loop that should read
the other payload fails to take it and tries again at once, spinning. On a network the wire
sets the pace and this does not show (what matters there is posting receives first, see
:mod:`~ddp_ring_hooks.runtime.executor`); where copies set it (loopback, ranks on one machine)
the receives-first order alone made the 2-rank ring spend measurably more CPU and time than
posting sends first, and on two transports it is back to where it was (``docs/benchmarks.md``
has the measurements' commands). Only pairs that exchange need it: a ring at more than 2 ranks
sends to ``rank + 1`` and receives from ``rank - 1``, one direction per pair, so it gets none.
Collectives on the group (DDP's own, the layout check) never touch a pair.

Cost, per rank: one socket per exchanging pair it is in (:meth:`Schedule.two_way_pairs`:
none for the ring at p > 2 and for ``native``; ``log2 p`` for halving-doubling), no thread (the
pair shares the group's gloo device, whose event loop serves both, and takes no worker
threads: point-to-point never uses them), a rendezvous of the two ranks through the group's
store when it is made. Made by the group's context (:mod:`~.group_context`) in its collective
setup, in one order on every rank (sorted pairs: a pair's two ranks both reach it, whatever
the others do); only the pair's ranks take part, on the group's store, with the group's
timeout, so a hung peer fails after the same time on either transport.
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
