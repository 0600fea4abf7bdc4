"""A process group's own timeout, and failing every transfer a transport has in flight, now.

The stall watchdog (``telemetry/stall.py``) gives up on a peer that stopped answering before
the group itself would; then the threads blocked in the group's waits must be let go, or the
process cannot finish (``HookState.close`` joins its workers) and torchrun cannot restart it.
What to abort is the group's context's to know
(:meth:`~ddp_ring_hooks.runtime.group_context.GroupContext.abort`: the group, each two-way
pair's transport, the CUDA side groups, per device); this module aborts one transport.

gloo has no abort: ``ProcessGroup.abort()`` is a no-op for it in torch 2.13 (it overrides
``abort`` only on its send and receive *works*, which Python cannot reach). What it has is its
own timeout path (``gloo/transport/tcp/unbound_buffer.cc``): a wait that times out calls
``context->signalException("Application timeout caused pair closure")``, which closes every
pair (socket) of the context, and every pending operation on it fails at once. So
:func:`close_gloo_contexts` posts a receive nobody will answer and waits 1 ms for it::

    worker thread:   recv(peer 2).wait()  ........ blocked ........ RuntimeError: pair closure
    watchdog:        recv(probe).wait(1 ms) -> timeout -> every pair of the context closed
    the peers:       their transfers with this rank fail at once ("Connection closed by peer")

NCCL has an abort of its own (``ProcessGroup.abort()``: ``ncclCommAbort``, kernels exit),
:func:`abort_nccl`. A mixed group (``"cpu:gloo,cuda:nccl"``) needs both: NCCL's abort is a
no-op for its gloo side. Either way the transport is unusable afterwards, as after a dead
peer: restart from a checkpoint (``docs/reliability.md``).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from .compat import group_timeout
from .lanes import ABORT_PROBE_TAG

def group_timeout_s(group: dist.ProcessGroup) -> float:
    """``group``'s own timeout in seconds (``init_process_group(timeout=...)``, or the backend's
    default); torch's 30 minutes when the backend does not say."""
    return group_timeout(group).total_seconds()


def abort_nccl(group) -> None:
    """NCCL's own abort of ``group`` (a group or side group that carries CUDA tensors): its
    kernels exit and every wait on it fails (on a mixed group a no-op for its gloo side)."""
    group.abort()


def close_gloo_contexts(transport, *, peer: int | None = None) -> None:
    """Fail every operation one gloo ``transport`` (a group, a mixed group's CPU side, or a
    gloo backend) has in flight on this rank, and its connections, by a probe that times out
    (see the module docstring).

    ``peer``: the rank (of the transport) a transfer is stuck on, whose connection is surely
    still open; a probe on a connection that a peer already closed fails at once, without the
    timeout that closes the others, so the probes go to ``peer`` first, then to every other
    rank until one times out."""
    if transport.size() == 1:
        return
    rank = transport.rank()
    others = [other for other in range(transport.size()) if other != rank]
    if peer in others:
        others.remove(peer)
        others.insert(0, peer)
    # gloo uses one context per network interface (GLOO_SOCKET_IFNAME=a,b), by tag modulo
    # their number: each is closed by a probe of its own.
    contexts = max(1, len(os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")))
    for context in range(contexts):
        tag = ABORT_PROBE_TAG - ABORT_PROBE_TAG % contexts + context
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
