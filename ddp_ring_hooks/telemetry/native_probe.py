"""The slow link under ``native``: a small probe between ring neighbours, after a gathered step.

``native`` runs the group's own all-reduce, whose transfers the hook cannot see, so per-link
timing (:mod:`.link_timing`) has nothing of training's to time. Instead, every
:data:`PROBE_EVERY`-th step it times whose buckets all ran ``native``, the exchange worker
sends a probe of its own::

    hook thread      the step's buckets: the group's own all-reduce (never waits for the probe)
    exchange worker  after the step (phase 1 of :mod:`.exchange`), on every rank:
      1. post the receive from the ring predecessor (rank - 1), then the send of PROBE_BYTES
         to the successor (rank + 1), on the group context's probe group: a gloo side group
         with sockets of its own (``GroupContext.probe_group``), so the probe never queues
         behind the group's all-reduce nor inside its message order; it is aborted and closed
         with the context
      2. three marks (this rank's clock, in ms): the send posted, the receive posted, the
         receive landed; they join the hook's transfer marks in the link timing's trade and
         timing (its steps 2.-5.): the same rule names a slow link
      3. the probe's wall time is charged to the exchange's cost (``Peers.charge``): the
         cadence (``spread_every="auto"``) spaces gathers by it, bytes on the links included

:data:`PROBE_BYTES` is a few hundred KiB above the lab shaper's smallest burst (128 KiB: a
token bucket lets a burst through at line rate, and a probe inside it would time the burst,
not the link) and above the link rule's :data:`~.link_timing.MIN_JUDGED_BYTES`. The summary
says such links were seen by the probe only (``links (probe): ...``), not by training traffic.
On CUDA the probe stays on the CPU (gloo), so it adds no event and no host sync.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

#: The probe's bytes, each way between ring neighbours.
PROBE_BYTES = 512 << 10
#: Every this-many-th step whose links are timed under ``native`` carries a probe.
PROBE_EVERY = 2
#: The probe group's message tag (the group is the probe's own: nothing else talks on it).
PROBE_TAG = 0


@dataclass(frozen=True)
class ProbeMarks:
    """One probe on this rank: it sent ``nbytes`` to ``successor`` (posted at ``sent_ms``) and
    received ``nbytes`` from ``predecessor`` (posted at ``posted_ms``, landed at
    ``received_ms``), in ms on this rank's clock; ``took_ms`` its wall time here."""

    successor: int
    predecessor: int
    sent_ms: float
    posted_ms: float
    received_ms: float
    nbytes: int
    took_ms: float


def probe_ring(group, *, rank: int, world_size: int, nbytes: int = PROBE_BYTES) -> ProbeMarks:
    """Send ``nbytes`` to the next rank of ``group`` and receive as many from the previous one,
    both at once (step 1 of the module docstring). Every rank of ``group`` must call it together."""
    successor, predecessor = (rank + 1) % world_size, (rank - 1) % world_size
    outgoing = torch.empty(nbytes, dtype=torch.uint8)
    incoming = torch.empty(nbytes, dtype=torch.uint8)
    began = time.perf_counter()
    # Receive first: gloo queues a rank's "receive posted" notice behind a payload it is already
    # writing to that peer (runtime/link_probe.py, 3.); posted first, the two ways share the link.
    posted = time.perf_counter()
    receive = group.recv([incoming], predecessor, PROBE_TAG)
    sent = time.perf_counter()
    send = group.send([outgoing], successor, PROBE_TAG)
    receive.wait()
    received = time.perf_counter()
    send.wait()
    return ProbeMarks(successor=successor, predecessor=predecessor, sent_ms=sent * 1e3, posted_ms=posted * 1e3,
                      received_ms=received * 1e3, nbytes=nbytes, took_ms=(time.perf_counter() - began) * 1e3)
