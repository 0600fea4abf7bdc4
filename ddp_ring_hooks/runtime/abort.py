"""A process group's own timeout, and failing every transfer it has in flight, now.

The stall watchdog (``telemetry/stall.py``) gives up on a peer that stopped answering before
the group itself would; then the threads blocked in the group's waits must be let go, or the
process cannot finish (``HookState.close`` joins its workers) and torchrun cannot restart it.

gloo has no abort: ``ProcessGroup.abort()`` is a no-op for it in torch 2.13 (it overrides
``abort`` only on its send and receive *works*, which Python cannot reach). What it has is its
own timeout path (``gloo/transport/tcp/unbound_buffer.cc``): a wait that times out calls
``context->signalException("Application timeout caused pair closure")``, which closes every
pair (socket) of the context, and every pending operation on it fails at once. So
:func:`abort_transfers` posts a receive nobody will answer and waits 1 ms for it::

    worker thread:   recv(peer 2).wait()  ........ blocked ........ RuntimeError: pair closure
    watchdog:        recv(probe).wait(1 ms) -> timeout -> every pair of the context closed
    the peers:       their transfers with this rank fail at once ("Connection closed by peer")

On CPU a group's messages travel on two gloo transports, the group and its upward one
(:mod:`~ddp_ring_hooks.runtime.directions`), each with contexts of its own: both are probed, or
a thread waiting on a lower rank (the upward transport) would stay blocked.

NCCL has an abort of its own (``ProcessGroup.abort()``: ``ncclCommAbort``, kernels exit).
Either way the group is unusable afterwards, as after a dead peer: restart from a checkpoint.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from .directions import made_upward

#: A point-to-point tag no schedule uses (lanes are small integers): the probe's receive.
PROBE_TAG = 0x7FFF0000
#: What ``init_process_group`` uses when nothing else is known (torch's ``default_pg_timeout``).
DEFAULT_GROUP_TIMEOUT_S = 1800.0


def group_timeout_s(group: dist.ProcessGroup) -> float:
    """``group``'s own timeout in seconds (``init_process_group(timeout=...)``, or the backend's
    default); torch's 30 minutes when the backend does not say."""
    device = torch.device("cuda" if "nccl" in str(dist.get_backend(group)) else "cpu")
    try:
        return group._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):  # a backend without options (a custom one)
        return DEFAULT_GROUP_TIMEOUT_S


def abort_transfers(group: dist.ProcessGroup, *, peer: int | None = None) -> None:
    """Fail every operation ``group`` has in flight on this rank, and its connections with it:
    gloo through its own timeout path (see the module docstring), NCCL with its abort.

    ``peer``: the rank (of the group) a transfer is stuck on, whose connection is surely still
    open; a probe on a connection that a peer already closed fails at once, without the
    timeout that closes the others, so the probes go to ``peer`` first, then to every other
    rank until one times out."""
    if group.size() == 1:
        return
    if "nccl" in str(dist.get_backend(group)):
        group.abort()
        return
    for transport in (group, made_upward(group)):
        if transport is not None:
            _close_gloo_contexts(transport, peer=peer)


def _close_gloo_contexts(transport, *, peer: int | None) -> None:
    """Close every context of one gloo ``transport`` (a group or a gloo backend) by a probe
    that times out, tried on ``peer`` first."""
    rank = transport.rank()
    others = [other for other in range(transport.size()) if other != rank]
    if peer in others:
        others.remove(peer)
        others.insert(0, peer)
    # gloo uses one context per network interface (GLOO_SOCKET_IFNAME=a,b), by tag modulo
    # their number: each is closed by a probe of its own.
    contexts = max(1, len(os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")))
    for context in range(contexts):
        tag = PROBE_TAG - PROBE_TAG % contexts + context
        for other in others:
            if _probe_timed_out(transport, other, tag):
                break


def _probe_timed_out(transport, peer: int, tag: int) -> bool:
    """Post a receive from ``peer`` nobody answers and wait 1 ms: whether it timed out (and so
    closed the context's pairs) rather than failing on a closed connection."""
    try:
        transport.recv([torch.empty(1)], peer, tag).wait(datetime.timedelta(milliseconds=1))
    except RuntimeError as error:
        return "Timed out" in str(error)
    return False  # it was answered: no one sends with this tag, but never wait on it again
