"""The wait for the latest rank: what a larger world adds to every step, from the run's arrivals.

No all-reduce ends before its last contributor has handed its bucket over, so every step waits
for the latest of the ``p`` ranks to finish backward. Ranks scatter from step to step (a busy
core, a page fault, a throttled quota), and the latest of more ranks is later: a run of 2 ranks
waits for the later of 2 draws, one of 8 for the latest of 8. The run's own step already holds
its own world's wait (the calibration reproduces it), so a row of another world size moves by
the difference::

    wait(p) = σ · (e(p) - e(the run's p)),    e(p) = E[the latest of p standard normal draws]

From the run's arrivals (:class:`~ddp_ring_hooks.telemetry.timeline_records.TimelineArrivals`,
the steps that gathered them: ``spread_every``, ``diagnose=True``): each step's ranks, their
last hand-over less the step's mean, are draws of one rank's lateness. Deviations from the mean
of ``n`` ranks scatter by ``sqrt((n-1)/n)`` of a rank's own (their mean moves with them), so they
are scaled back by ``sqrt(n/(n-1))``: at 2 ranks, each step's difference over ``sqrt(2)``.

The lateness is read as normal, its scale ``σ`` from the draws' median distance from 0 (a
normal's is ``0.6745 σ``): a few disturbed steps cannot move a median. A run gathers a dozen
steps or so. In one lab run 3 of 13 had their 2 ranks 173-652 ms apart (the others 0-57 ms);
the expectation over the draws as they were weighed the largest by 27% at 8 ranks, priced
+132 ms there and over-predicted the 8-rank step by 15%, where the median reads σ = 30 ms and
+26 ms (``docs/advisor.md``, the fourteenth series). ``e(p)`` grows like ``sqrt(2 ln p)``, so 64 or 512
ranks are priced the normal's tail; a rare long stall is outside it (a dozen steps cannot price
it), and so are ranks whose lateness is not independent (a slow host that is always late, a
shared core two ranks fight for): the straggler diagnosis names the first; the lab's shared
cores are the second.

Without arrivals (a run that gathered none) the term is 0 and the advice says it is not priced.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from statistics import NormalDist

from ..telemetry.timeline_records import TimelineArrivals

#: Steps of arrivals the term needs: fewer, and one disturbed step would be the whole tail.
MIN_ARRIVAL_STEPS = 3


def arrival_lateness(arrivals: Sequence[TimelineArrivals], world_size: int, first_step: int) -> tuple[float, ...] | None:
    """One rank's lateness, as draws: every rank's last hand-over less its step's mean, scaled by
    ``sqrt(p/(p-1))`` (see the module docstring), over the steps from ``first_step`` on whose
    arrivals are whole (every rank's, none unknown). ``None`` when fewer than
    :data:`MIN_ARRIVAL_STEPS` steps gathered them, or on one rank."""
    if world_size < 2:
        return None
    steps = [a.last_ms for a in arrivals if a.step >= first_step and len(a.last_ms) == world_size
             and all(math.isfinite(t) for t in a.last_ms)]
    if len(steps) < MIN_ARRIVAL_STEPS:
        return None
    spread = math.sqrt(world_size / (world_size - 1))
    return tuple(sorted((t - statistics.fmean(last)) * spread for last in steps for t in last))


#: The median of ``|x|`` for a standard normal ``x``: a normal's median distance from its mean is
#: this many standard deviations.
NORMAL_MEDIAN_DISTANCE = NormalDist().inv_cdf(0.75)


def lateness_scale_ms(lateness: Sequence[float]) -> float:
    """``σ`` of one rank's lateness: the draws' median distance from 0 (their mean, by
    construction) over :data:`NORMAL_MEDIAN_DISTANCE`."""
    return statistics.median(abs(x) for x in lateness) / NORMAL_MEDIAN_DISTANCE


@functools.cache
def expected_latest_of_normals(ranks: int) -> float:
    """``e(p)``: E[the latest of ``ranks`` independent standard normal draws], integrated over
    the density of the latest, ``p Φ(x)^(p-1) φ(x)``: 0 for one rank, ``1/sqrt(π)`` for two,
    ``3/(2 sqrt(π))`` for three."""
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a whole number of at least 1, got {ranks!r}")
    normal, low, high, points = NormalDist(), -10.0, 10.0, 8001
    width = (high - low) / (points - 1)
    total = 0.0
    for i in range(points):
        x = low + i * width
        weight = 0.5 if i in (0, points - 1) else 1.0  # the trapezoid rule
        total += weight * x * ranks * normal.cdf(x) ** (ranks - 1) * normal.pdf(x)
    return total * width


def latest_rank_wait_ms(lateness: Sequence[float] | None, world_size: int, run_world_size: int) -> float:
    """What waiting for the latest of ``world_size`` ranks adds to a step over the run's own
    ``run_world_size`` (negative for a smaller world); 0 without arrivals."""
    if not lateness or world_size == run_world_size:
        return 0.0
    return lateness_scale_ms(lateness) * (expected_latest_of_normals(world_size) - expected_latest_of_normals(run_world_size))
