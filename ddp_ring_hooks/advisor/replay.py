"""One step's communication, replayed event by event: buckets through the lanes and the link.

Every prediction of the advisor (another bucket size, accumulation, algorithm, world size,
wire dtype, the run itself) replays the same queue. Its assumptions:

1. **DDP hands each bucket over when it is ready**, in order: bucket ``i`` is handed at
   ``handed[i] = max(ready[i], handed[i-1])``.
2. **A bucket costs two things** (:class:`BucketCost`, priced by
   :func:`~.network.bucket_cost`): ``fixed`` time on its own lane that needs no link (the
   messages' start-up latency α, the additions and casts γ), and ``link`` time holding the
   link (its bytes at the link's rate β). The link is the rank's one way out: every lane's
   bytes share it.
3. **Every communication resource serves the buckets in order.** The CPU hook's lanes: bucket
   ``i`` on worker lane ``i % lanes`` (a CUDA side stream is one lane), each lane one bucket at
   a time; the link serves the buckets' bytes in the order they reach it (first come, first
   served: two lanes' transfers interleave on the wire, and the one that got there first is
   taken to finish first; what the last bucket ends at, and so what is exposed, is the same
   either way when the link never idles).
4. A bucket starts when it is handed over and its lane is free, spends its ``fixed`` time on
   the lane, then holds the link for ``link`` once the link is free; it ends there::

       handed  h0      h1  h2                          | backward ends (last bucket handed)
       lane 0  [f0][== link b0 ==]      [f2]...[== link b2 ==]
       lane 1          [f1]...........[== link b1 ==]         |<- exposed ->|
                           (b1 waits for the link)

5. Nothing else is modelled here: CPU contention with backward (hidden communication taking
   cores from backward) is the step model's (:mod:`.step_model`), and so is what the α-β
   prices leave out (calibrated on the run itself).

Because every resource is first come, first served and buckets reach them in hand-over order,
replaying the events in that order is the whole simulation: each bucket's start, link start
and end follow from the ones before it. Closed forms it reproduces (``tests/test_advisor.py``):
one bucket with nothing to overlap ends after ``fixed + link``; buckets handed early enough are
hidden, and only the last one's cost is exposed; a link-bound queue ends after the sum of the
links' times.

What it reports uses one start for everything: **communication** is the time from a bucket's
hand-over to its end, queue included (the union over buckets), and **exposed** the part after
backward ended, so exposed never exceeds communication; the **queue** of a bucket is its wait
from hand-over to start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..telemetry.records import busy_ms


@dataclass(frozen=True)
class BucketCost:
    """What one bucket's all-reduce costs (ms): ``fixed`` on its lane, ``link`` holding the link."""

    fixed_ms: float
    link_ms: float

    @property
    def total_ms(self) -> float:
        """The all-reduce alone, with nothing else on the link: ``fixed + link``."""
        return self.fixed_ms + self.link_ms


@dataclass(frozen=True)
class Replayed:
    """Each bucket's hand-over, start and end (ms from backward start), and what they add up to."""

    handed: tuple[float, ...]
    starts: tuple[float, ...]
    ends: tuple[float, ...]
    #: from hand-over to end, queue included (the union over buckets)
    comm_ms: float
    #: the part of ``comm_ms`` before backward ended
    hidden_ms: float
    #: after backward ended, until the last bucket ended
    exposed_ms: float
    #: time the link carried bytes
    link_ms: float

    @property
    def queue_ms(self) -> tuple[float, ...]:
        """Each bucket's wait from hand-over to start (behind earlier buckets on its lane)."""
        return tuple(start - handed for start, handed in zip(self.starts, self.handed))


def replay(ready_ms: Sequence[float], costs: Sequence[BucketCost], *, lanes: int, backward_ms: float) -> Replayed:
    """Replay buckets (in DDP's launch order) through ``lanes`` lanes and one link.

    ``ready_ms[i]``: when bucket ``i`` is ready; ``costs[i]``: its :class:`BucketCost`;
    ``backward_ms``: when backward ends (the last gradient is ready)::

        >>> replay([0, 0], [BucketCost(0, 4), BucketCost(0, 4)], lanes=2, backward_ms=2).exposed_ms
        6.0
    """
    if lanes < 1:
        raise ValueError(f"lanes must be >= 1, got {lanes}")
    if len(ready_ms) != len(costs):
        raise ValueError(f"{len(ready_ms)} ready times but {len(costs)} costs")
    lane_free = [float("-inf")] * lanes
    link_free = handed = float("-inf")
    handed_at, starts, ends = [], [], []
    for i, (ready, cost) in enumerate(zip(ready_ms, costs)):
        handed = max(handed, ready)  # DDP hands buckets over in order
        start = max(handed, lane_free[i % lanes])
        end = max(start + cost.fixed_ms, link_free) + cost.link_ms
        if cost.link_ms > 0:
            link_free = end
        lane_free[i % lanes] = end
        handed_at.append(handed)
        starts.append(start)
        ends.append(end)
    spans = list(zip(handed_at, ends))
    return Replayed(
        handed=tuple(handed_at), starts=tuple(starts), ends=tuple(ends),
        comm_ms=busy_ms(spans), hidden_ms=busy_ms(spans, until=backward_ms),
        exposed_ms=max(0.0, max(ends, default=backward_ms) - backward_ms),
        link_ms=sum(cost.link_ms for cost in costs),
    )
