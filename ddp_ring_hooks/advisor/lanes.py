"""Buckets through the communication lanes: when each starts, ends, and what backward cannot hide.

The CPU hook runs ``concurrent_buckets`` lanes (default 2); bucket ``i`` goes to lane
``i % lanes`` and each lane takes its buckets in order. A bucket starts when it is ready
(DDP handed it over) and its lane is free::

    ready      r0  r1      r2 r3                 | backward ends (last bucket ready)
    lane 0     [== b0 ==]  [==== b2 ====]        |
    lane 1         [== b1 ==]   [==== b3 ====]   |
                                                 |<- exposed ->| = last end - backward end

``comm`` is the time at least one bucket was in flight; ``hidden`` the part of it before
backward ended (on CPU that part still takes cores from backward, see :mod:`.step_model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LaneSchedule:
    """Start and end (ms from backward start) of every bucket, and what they add up to."""

    starts: tuple[float, ...]
    ends: tuple[float, ...]
    comm_ms: float
    hidden_ms: float
    exposed_ms: float


def busy_ms(intervals, *, until: float = float("inf")) -> float:
    """Length of the union of ``(start, end)`` intervals, counted up to ``until``."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, until)
        if end > start:
            busy += end - start
        reach = max(reach, end)
    return busy


def run_lanes(
    ready_ms: Sequence[float], cost_ms: Sequence[float], *, lanes: int, backward_ms: float
) -> LaneSchedule:
    """Queue buckets (in DDP's launch order) through ``lanes`` lanes.

    ``ready_ms[i]``: when bucket ``i`` is handed over; ``cost_ms[i]``: its all-reduce time;
    ``backward_ms``: when backward ends (the last gradient is ready)::

        >>> run_lanes([0, 0], [4, 4], lanes=1, backward_ms=2).exposed_ms
        6.0
    """
    if lanes < 1:
        raise ValueError(f"lanes must be >= 1, got {lanes}")
    if len(ready_ms) != len(cost_ms):
        raise ValueError(f"{len(ready_ms)} ready times but {len(cost_ms)} costs")
    free = [float("-inf")] * lanes
    handed = float("-inf")
    starts, ends = [], []
    for i, (ready, cost) in enumerate(zip(ready_ms, cost_ms)):
        handed = max(handed, ready)  # DDP hands buckets over in order
        start = max(handed, free[i % lanes])
        starts.append(start)
        ends.append(start + cost)
        free[i % lanes] = start + cost
    intervals = list(zip(starts, ends))
    last = max(ends, default=backward_ms)
    return LaneSchedule(
        starts=tuple(starts),
        ends=tuple(ends),
        comm_ms=busy_ms(intervals),
        hidden_ms=busy_ms(intervals, until=backward_ms),
        exposed_ms=max(0.0, last - backward_ms),
    )
