"""One step's communication, replayed event by event: buckets through the lanes and the link.

Every prediction of the advisor (another bucket size, accumulation, algorithm, world size,
wire dtype, the run itself) replays the same queue. Its assumptions:

1. **DDP hands each bucket over when it is ready**, in order: bucket ``i`` is handed at
   ``handed[i] = max(ready[i], handed[i-1])``.
2. **A bucket costs two things** (:class:`BucketCost`, priced by
   :func:`~.network.bucket_cost`): ``fixed`` time on its own lane that needs no link (the
   messages' start-up latency α, the additions and casts γ), and ``link`` time holding the
   link (its bytes at the link's rate β). The link is the rank's one way out and one way in:
   every lane's bytes share it.
3. **The link is full duplex**: its way out and its way in are two resources. A bucket's link
   time is a sequence of parts, each holding the way out, the way in, or both, for its share
   of the time (``BucketCost.link_directions``, counted on the algorithm's schedule:
   :mod:`.link_directions`). A ring sends and receives in every step, both ways for its whole
   time; a tree's or the naive root's reduce comes in, then its broadcast goes out. So one
   bucket's broadcast runs beside the next one's reduce, where two rings' buckets take turns.
4. **Every communication resource serves the buckets in order.** The CPU hook's lanes: bucket
   ``i`` on worker lane ``i % lanes`` (a CUDA side stream is one lane), each lane one bucket at
   a time; each way of the link serves the buckets' parts in the order they reach it (first
   come, first served: two lanes' transfers interleave on the wire, and the one that got
   there first is taken to finish first; what the last bucket ends at, and so what is
   exposed, is the same either way when the link never idles). A part waits for every way it
   holds; a later bucket never slips into a gap before an earlier bucket's part.
5. A bucket starts ``pickup_ms`` after it is handed over (its worker's wake-up, measured on the
   run) once its lane is free, spends its ``fixed`` time on the lane, then its link parts one
   after the other, each once the ways it holds are free; it ends with its last part. Two
   lanes, rings (both ways) and trees (in, then out)::

       handed  h0  h1                                   | backward ends (last bucket handed)
       ring    lane 0  [f0][=== b0 both ===]
               lane 1  [f1]................[=== b1 both ===]       (b1 waits for both ways)
       tree    lane 0  [f0][= b0 in =][= b0 out =]
               lane 1  [f1]...........[= b1 in =][= b1 out =]      (b1's reduce comes in
                                                                    while b0's broadcast goes out)

6. **While backward runs, an exchange may go slower** (``backward_rate``, 1 by default): a
   part that holds both ways (a rank sending to its peers while it receives from them)
   progresses at that share of its price until backward ends, and at full price after. Where
   backward fills the cores, the communication threads wait for them: on the lab's hosts of a
   fifth of a core a ring's bucket during backward took 53-150 ms where the same bytes after it
   took 42, while a tree's one-way halves kept the link's rate (``docs/advisor.md``, the tenth
   series). The step model calibrates the rate on the run (:mod:`.step_model`)::

       backward  ======================|
       ring b0        [~~~~~~~ slowed ~~~~|=== full ===]     ~ : at backward_rate

7. Nothing else is modelled here: CPU contention with backward (hidden communication taking
   cores from backward) is the step model's (:mod:`.step_model`), and so is what the α-β
   prices leave out (calibrated on the run itself).

Because every resource is first come, first served and buckets reach them in hand-over order,
replaying the events in that order is the whole simulation: each bucket's start, parts and
end follow from the ones before it. Closed forms it reproduces (``tests/test_advisor.py``):
one bucket with nothing to overlap ends after ``fixed + link``; buckets handed early enough are
hidden, and only the last one's cost is exposed; a link-bound queue of rings ends after the
sum of the links' times; one of ``K`` equal trees (or naive all-reduces) of ``2·n·β`` each,
on two lanes, after ``(K+1)·n·β``; a ring of link time ``L`` that starts at 0 beside a
backward of ``B`` at rate ``r`` ends at ``L/r`` when ``r·B >= L``, else at ``B + L - r·B``.

What it reports uses one start for everything: **communication** is the time from a bucket's
hand-over to its end, queue included (the union over buckets), and **exposed** the part after
backward ended, so exposed never exceeds communication; the **queue** of a bucket is its wait
from hand-over to start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..telemetry.records import busy_ms
from ..schedules import BOTH
from .link_directions import BOTH_WAYS, HOLDS, Directions


@dataclass(frozen=True)
class BucketCost:
    """What one bucket's all-reduce costs (ms): ``fixed`` on its lane, ``link`` holding the link,
    spent in the parts ``link_directions`` names (the way out, the way in, or both; shares of
    ``link_ms`` in order; default both ways for all of it, as a ring)."""

    fixed_ms: float
    link_ms: float
    link_directions: Directions = BOTH_WAYS

    def __post_init__(self) -> None:
        unknown = [way for way, _ in self.link_directions if way not in HOLDS]
        total = sum(share for _, share in self.link_directions)
        if unknown or abs(total - 1.0) > 1e-9:
            raise ValueError(f"a bucket's link parts hold {', '.join(HOLDS)} and their shares add up to 1; "
                             f"got {self.link_directions!r}")

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
    #: time the link carried bytes (each bucket's link time, whichever ways it held)
    link_ms: float

    @property
    def queue_ms(self) -> tuple[float, ...]:
        """Each bucket's wait from hand-over to start (behind earlier buckets on its lane)."""
        return tuple(start - handed for start, handed in zip(self.starts, self.handed))


def replay(ready_ms: Sequence[float], costs: Sequence[BucketCost], *, lanes: int, backward_ms: float,
           shared_ways: float | None = None, pickup_ms: float = 0.0, backward_rate: float = 1.0) -> Replayed:
    """Replay buckets (in DDP's launch order) through ``lanes`` lanes and one full-duplex link.

    ``ready_ms[i]``: when bucket ``i`` is ready; ``costs[i]``: its :class:`BucketCost`;
    ``backward_ms``: when backward ends (the last gradient is ready). Two rings' buckets take
    turns on the link; two trees' overlap by their halves.

    ``shared_ways``: ranks on one host (loopback) have no wire: the same cores copy the bytes
    out and in, so the two ways are one resource, and a part that holds one way has it all. Its
    time is then its price times the ways it holds over ``shared_ways``, the ways held on
    average by the algorithm the network was fitted to (2 for a ring, both at once): a tree's
    one-way half takes half its price where a ring's both-ways part takes all of it. (Measured
    on loopback, 2 ranks: the tree's step 0.93-1.14x the ring's, where full duplex said 1.3x.)

    ``pickup_ms``: each bucket starts that long after its hand-over (when its lane is free);
    ``backward_rate``: the share of its price at which a both-ways part progresses before
    ``backward_ms`` (the module docstring's 5 and 6)::

        >>> replay([0, 0], [BucketCost(0, 4), BucketCost(0, 4)], lanes=2, backward_ms=2).exposed_ms
        6.0
        >>> tree = BucketCost(0, 4, (("in", 0.5), ("out", 0.5)))
        >>> replay([0, 0], [tree, tree], lanes=2, backward_ms=2).exposed_ms
        4.0
    """
    if lanes < 1:
        raise ValueError(f"lanes must be >= 1, got {lanes}")
    if not 0 < backward_rate <= 1:
        raise ValueError(f"backward_rate is a share of the link's price, in (0, 1]; got {backward_rate}")
    if len(ready_ms) != len(costs):
        raise ValueError(f"{len(ready_ms)} ready times but {len(costs)} costs")
    lane_free = [float("-inf")] * lanes
    way_free = dict.fromkeys(HOLDS[BOTH], float("-inf"))  # each way of the link (out, in): free from then on
    handed = float("-inf")
    handed_at, starts, ends = [], [], []
    for i, (ready, cost) in enumerate(zip(ready_ms, costs)):
        handed = max(handed, ready)  # DDP hands buckets over in order
        start = max(handed + pickup_ms, lane_free[i % lanes])
        end = start + cost.fixed_ms
        for way, share in cost.link_directions:
            held, rate = share * cost.link_ms, backward_rate if way == BOTH else 1.0
            if shared_ways:
                held, way = held * len(HOLDS[way]) / shared_ways, BOTH
            if held <= 0:
                continue
            end = _progressed(max(end, *(way_free[w] for w in HOLDS[way])), held, until=backward_ms, rate=rate)
            way_free.update(dict.fromkeys(HOLDS[way], end))
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


def _progressed(begin: float, work: float, *, until: float, rate: float) -> float:
    """When ``work`` ms of link time started at ``begin`` is done: at ``rate`` of its price before
    ``until`` (backward's end), at full price after."""
    if rate >= 1.0 or begin >= until:
        return begin + work
    slowed = (until - begin) * rate  # the work done by the time backward ends
    return begin + work / rate if work <= slowed else until + work - slowed
