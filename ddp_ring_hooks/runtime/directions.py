"""The two directions of every pair of ranks on two gloo transports: the group, and one more.

On CPU the executor sends a message from a lower to a higher rank of the group on the group's
*upward* transport (:func:`upward_transport`: a gloo backend with the same ranks), and from a higher
to a lower rank on the group itself. Sender and receiver decide alike (they compare the same
two ranks), so both ends post every message on the same transport, with its usual tag::

    rank 0  ══ upward ════>  rank 1      lower -> higher: the upward transport's socket
    rank 0  <═══ group ════  rank 1      higher -> lower: the group's own socket

Why. gloo keeps one pair object per pair of ranks and transport: one TCP socket and one lock
(``gloo/transport/tcp/pair.cc``). When a step exchanges chunks with one peer (the ring at 2
ranks, every step of halving-doubling, hierarchical's leaders) and both payloads cross one
pair at once, whichever thread writes a payload holds the pair's lock, and the event loop that
should read the other payload fails to take it and tries again at once, spinning. On a network
the wire sets the pace and this does not show (what matters there is posting receives first,
see :mod:`~ddp_ring_hooks.runtime.executor`); where copies set it (loopback, ranks on one
machine) the receives-first order alone made the 2-rank ring spend measurably more CPU and
time than posting sends first, and on two transports it is back to where it was
(``docs/benchmarks.md`` has the measurements' commands). Collectives on the group (DDP's own,
the arrivals gather) never touch the upward transport.

Cost: ``p - 1`` more sockets on every rank per process group the executor runs on; no thread
(the upward backend shares the group's gloo device, whose event loop serves both). It is made
where every rank of the group is present: by :func:`prepare` when a hook state is built (a
first bucket making it would put a store round trip into the first backward pass), or at the
first CPU all-reduce on the group (every rank of the group runs that one). Only the group's
members take part, on the group's store, and it has the group's timeout, so a hung peer fails
after the same time on either transport.
"""

from __future__ import annotations

import threading
import weakref

import torch.distributed as dist

from .collectives import backend_for
from .compat import gloo_options_like, group_store

_LOCK = threading.Lock()  # guards the two maps
# Weak keys: holding a process group here would keep it alive past destroy_process_group.
_UPWARD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# One lock per group while its upward transport is made: two lanes' first buckets must not make
# two (every rank must make the same one), and making one group's (a rendezvous with its
# peers) must not hold up another group's.
_MAKING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def upward_transport(group: dist.ProcessGroup) -> dist.ProcessGroup | dist.ProcessGroupGloo:
    """What carries ``group``'s messages from a lower to a higher rank: a gloo backend with
    the same ranks, made once (collective over the members of ``group`` the first time), or
    ``group`` itself where it has one rank or no gloo for the CPU (another backend's
    point-to-point is its own affair). Both have the ``send``/``recv`` the executor calls."""
    with _LOCK:
        made = _UPWARD.get(group)
        if made is not None:
            return made
        making = _MAKING.setdefault(group, threading.Lock())
    with making:
        with _LOCK:
            made = _UPWARD.get(group)
        if made is None:
            made = _make_upward(group)
            with _LOCK:
                _UPWARD[group] = made
        return made


def prepare(group: dist.ProcessGroup | None) -> None:
    """At registration, on every rank: make the upward transport of a CPU (gloo) hook group
    while every rank is known to be here (see the module docstring)."""
    # A state built before init_process_group makes it at its first bucket instead; a group
    # that also carries CUDA tensors makes it only if a CPU bucket ever comes.
    if not (dist.is_available() and dist.is_initialized()):
        return
    group = group if group is not None else dist.group.WORLD
    backend = str(dist.get_backend(group))
    if backend_for(backend, "cpu") == "gloo" and backend_for(backend, "cuda") is None:
        upward_transport(group)


def _make_upward(group: dist.ProcessGroup) -> dist.ProcessGroup | dist.ProcessGroupGloo:
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) < 2 or backend_for(str(dist.get_backend(group)), "cpu") != "gloo":
        return group
    # Not dist.new_group: over a subset of ranks it needs use_local_synchronization, whose
    # name counts the groups *this* process has, so making one on some ranks only would give
    # every later such group (the user's too) a different name on those ranks: a hang. A gloo
    # backend of its own on the group's store (whose prefix is the group's name, the same on
    # every member) under a key prefix of its own needs only the members, and takes the
    # group's ranks as they are. It shares the group's gloo device: its sockets are other
    # sockets, with other locks, served by the same event-loop thread.
    store = dist.PrefixStore("ddp_ring_hooks.upward/", group_store(group))
    return dist.ProcessGroupGloo(store, dist.get_rank(group), len(ranks), gloo_options_like(group))
