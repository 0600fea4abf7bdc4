"""Counts taken from a schedule itself: steps, bytes each rank sends, and its α-β-γ time.

These read the same :class:`~ddp_ring_hooks.schedules.Schedule` the runtime executes, so the
closed forms in :mod:`.formulas` can be checked against what the algorithm really does.
Chunks are taken as ``nbytes / num_chunks`` bytes each (even chunks, as the textbook
formulas assume).

The time of one step is set by its slowest link, every ``src -> dst`` pair being its own
link (links are full duplex and a rank may use several at once)::

    step time = max over links ( α + bytes·β + [received bytes are added]·bytes·γ )

Given the node of every rank, links inside a node cost ``α_l, β_l``; with ``shared_uplinks``,
each node has one uplink each way that every link leaving (entering) it shares, so a link
between nodes waits for the busier of the two uplinks it crosses::

    node A                         node B      link a -> b costs
      a ──┐                      ┌──▶ b          α + β · max(bytes out of A, bytes into B)
      c ──┴═══ A's uplink out ═══┴──▶ d        (a -> b and c -> d share A's uplink)

With every rank its own node that is the per-NIC model: a rank's links share its NIC.

A schedule that carries a narrower wire dtype (``wire_dtype="bf16"`` in its options) moves
:func:`~ddp_ring_hooks.schedules.wire_ratio` of the bytes on every link and casts its buffer
down and up once, as :func:`~.formulas.on_the_wire` prices the closed forms; the byte counts
(:func:`bytes_sent_per_rank`) stay those of the buffer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from ..schedules import Op, Schedule, is_narrow, wire_ratio
from ..schedules.wire import CAST_PASSES
from .formulas import Links, links_of


def count_steps(schedule: Schedule) -> int:
    """Latency terms: the number of steps (each waits for the one before)."""
    return len(schedule.steps)


def bytes_sent_per_rank(schedule: Schedule, nbytes: float) -> tuple[float, ...]:
    """Total bytes each rank sends during the whole all-reduce of ``nbytes`` per rank."""
    chunk = nbytes / schedule.num_chunks
    sent = [0.0] * schedule.world_size
    for step in schedule.steps:
        for transfer in step.transfers:
            sent[transfer.src] += chunk
    return tuple(sent)


def simulate(
    schedule: Schedule,
    nbytes: float,
    links: Links | None = None,
    *,
    alpha: float | None = None,
    beta: float | None = None,
    gamma: float = 0.0,
    placement: Sequence[int] | None = None,
    shared_uplinks: bool = False,
) -> float:
    """Seconds the schedule takes in the α-β-γ model on ``links`` (or ``alpha=``, ``beta=``,
    ``gamma=`` on one tier), step by step (see the module docstring).

    With ``placement`` (the node of each rank: ``placement[r]``; nodes of ``G`` consecutive
    ranks are ``[r // G for r in range(p)]``), a link between ranks of the same node costs
    ``links.inside`` (``links.local``, default the same); with ``shared_uplinks`` too, the
    links between nodes share each node's uplink (``links``' α, β are the uplink's).
    """
    links = links_of(links, alpha, beta, gamma)
    alpha, beta, gamma, inside = links.alpha, links.beta, links.gamma, links.inside
    if shared_uplinks and placement is None:
        raise ValueError("shared_uplinks needs placement: the node of each rank (range(p) for one NIC per rank)")
    chunk = nbytes / schedule.num_chunks
    narrow = is_narrow(schedule.options)
    wire = chunk * wire_ratio(schedule.options)  # the bytes a chunk's transfer carries
    total = CAST_PASSES * nbytes * gamma if narrow else 0.0
    for step in schedule.steps:
        links: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])  # [bytes, reduced]
        for t in step.transfers:
            link = links[(t.src, t.dst)]
            link[0] += wire
            if t.op is Op.REDUCE:
                link[1] += chunk
        leaving: dict[int, float] = defaultdict(float)  # bytes through each node's uplink, out and in
        entering: dict[int, float] = defaultdict(float)
        if shared_uplinks:
            for (src, dst), (moved, _) in links.items():
                if placement[src] != placement[dst]:
                    leaving[placement[src]] += moved
                    entering[placement[dst]] += moved
        slowest = 0.0
        for (src, dst), (moved, reduced) in links.items():
            local = placement is not None and placement[src] == placement[dst]
            a = inside.alpha if local else alpha
            b = inside.beta if local else beta
            if shared_uplinks and not local:
                moved = max(leaving[placement[src]], entering[placement[dst]])
            slowest = max(slowest, a + moved * b + reduced * gamma)
        total += slowest
    return total
