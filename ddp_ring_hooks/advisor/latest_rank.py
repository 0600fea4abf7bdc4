"""The wait for the latest rank: what a larger world adds to every step, from the run's arrivals.

No all-reduce ends before its last contributor has handed its bucket over, so every step waits
for the latest of the ``p`` ranks to finish backward. Ranks scatter from step to step (a busy
core, a page fault, a throttled quota), and the latest of more ranks is later: a run of 2 ranks
waits for the later of 2 draws, one of 8 for the latest of 8. The run's own step already holds
its own world's wait (the calibration reproduces it), so a row of another world size moves by
the difference::

    wait(p) = E[latest of p ranks' lateness] - E[latest of the run's p]

From the run's arrivals (:class:`~ddp_ring_hooks.telemetry.timeline_records.TimelineArrivals`,
the steps that gathered them: ``spread_every``, ``diagnose=True``): each step's ranks, their
last hand-over less the step's mean, are draws of one rank's lateness. Deviations from the mean
of ``n`` ranks scatter by ``sqrt((n-1)/n)`` of a rank's own (their mean moves with them), so they
are scaled back by ``sqrt(n/(n-1))``: at 2 ranks, each step's difference over ``sqrt(2)``. The
expectation is taken over those draws as they are (no distribution assumed), so a world far
larger than the samples waits at most the latest lateness seen: a floor for 64 or 512 ranks,
whose tail no run of 2 can show. Ranks whose lateness is not independent (a slow host that is
always late, a shared core two ranks fight for) are outside it: the straggler diagnosis names
the first; the lab's shared cores are the second (``docs/advisor.md``).

Without arrivals (a run that gathered none) the term is 0 and the advice says it is not priced.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

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


def expected_latest_ms(lateness: Sequence[float], ranks: int) -> float:
    """E[the latest of ``ranks`` independent draws] from ``lateness`` (each sample equally likely):
    the ``k``-th smallest of ``n`` is the latest with probability ``(k/n)^ranks - ((k-1)/n)^ranks``."""
    ordered, n = sorted(lateness), len(lateness)
    return sum(x * (((k + 1) / n) ** ranks - (k / n) ** ranks) for k, x in enumerate(ordered))


def latest_rank_wait_ms(lateness: Sequence[float] | None, world_size: int, run_world_size: int) -> float:
    """What waiting for the latest of ``world_size`` ranks adds to a step over the run's own
    ``run_world_size`` (negative for a smaller world); 0 without arrivals."""
    if not lateness or world_size == run_world_size:
        return 0.0
    return expected_latest_ms(lateness, world_size) - expected_latest_ms(lateness, run_world_size)
