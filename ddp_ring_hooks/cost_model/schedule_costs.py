"""Counts taken from a schedule itself: steps, bytes each rank sends, and its α-β-γ time.

These read the same :class:`~ddp_ring_hooks.schedules.Schedule` the runtime executes, so the
closed forms in :mod:`.formulas` can be checked against what the algorithm really does.
Chunks are taken as ``nbytes / num_chunks`` bytes each (even chunks, as the textbook
formulas assume).

The time of one step is set by its slowest link, every ``src -> dst`` pair being its own
link (links are full duplex and a rank may use several at once)::

    step time = max over links ( α + bytes·β + [received bytes are added]·bytes·γ )
"""

from __future__ import annotations

from collections import defaultdict

from ..schedules import Op, Schedule


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
    *,
    alpha: float,
    beta: float,
    gamma: float = 0.0,
    ranks_per_node: int | None = None,
    local_alpha: float | None = None,
    local_beta: float | None = None,
) -> float:
    """Seconds the schedule takes in the α-β-γ model, step by step (see the module docstring).

    With ``ranks_per_node``, a link between ranks of the same node (``r // ranks_per_node``)
    costs ``local_alpha``/``local_beta`` (default: ``alpha``/``beta``).
    """
    chunk = nbytes / schedule.num_chunks
    total = 0.0
    for step in schedule.steps:
        links: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])  # [bytes, reduced]
        for t in step.transfers:
            link = links[(t.src, t.dst)]
            link[0] += chunk
            if t.op is Op.REDUCE:
                link[1] += chunk
        slowest = 0.0
        for (src, dst), (moved, reduced) in links.items():
            local = ranks_per_node is not None and src // ranks_per_node == dst // ranks_per_node
            a = local_alpha if local and local_alpha is not None else alpha
            b = local_beta if local and local_beta is not None else beta
            slowest = max(slowest, a + moved * b + reduced * gamma)
        total += slowest
    return total
