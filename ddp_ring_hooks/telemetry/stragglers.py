"""Who keeps the others waiting, over many steps: a tally of :class:`~.records.RankArrivals`.

One step's straggler can be noise (a page fault, another process on the core); a rank that
arrives last in most steps *and* costs the others real time is worth a sentence::

    rank 2 arrived last in 96% of 24 steps, costing the others 29 ms per step (median wait)

A rank is named only when, over at least :data:`MIN_STEPS` gathered steps, it arrived last in
at least :data:`CONSISTENT_SHARE` of them (well above chance: with two balanced ranks one of
them is last in half the steps anyway) and the median wait it caused is at least
:data:`NOISE_FLOOR_MS` and twice the clock alignment's error; otherwise the line says there
was no consistent straggler and gives the median arrival spread, so a balanced run reads as
balanced.
"""

from __future__ import annotations

import collections
import statistics

from .records import RankArrivals

#: A rank is a consistent straggler when it arrived last in at least this share of the steps,
CONSISTENT_SHARE = 0.75
#: ... of at least this many steps,
MIN_STEPS = 5
#: ... and the median wait it caused is at least this long (shorter is scheduling noise).
NOISE_FLOOR_MS = 1.0


class StragglerTally:
    """Counts, per rank, the steps it arrived last, and keeps recent waits and spreads
    (``window`` of each, so memory stays flat) for the summary line."""

    def __init__(self, window: int = 4096) -> None:
        self.steps = 0
        self.last_counts: collections.Counter[int] = collections.Counter()
        self._waits: dict[int, collections.deque[float]] = {}
        self._spreads: collections.deque[float] = collections.deque(maxlen=window)
        self._window = window
        self.clock_error_ms = 0.0

    def add(self, record: RankArrivals) -> None:
        straggler = record.straggler
        self.steps += 1
        self.last_counts[straggler] += 1
        waits = self._waits.setdefault(straggler, collections.deque(maxlen=self._window))
        waits.append(record.straggler_wait_ms)
        self._spreads.append(record.arrival_spread_ms)
        self.clock_error_ms = record.clock_error_ms

    def leader(self) -> tuple[int, float, float] | None:
        """``(rank, share of steps it arrived last, median wait it caused in ms)`` of the
        rank that arrived last most often; None before any step."""
        if not self.steps:
            return None
        rank, count = self.last_counts.most_common(1)[0]
        return rank, count / self.steps, statistics.median(self._waits[rank])

    def is_consistent(self) -> bool:
        """Whether :meth:`leader` is a real straggler (see the module docstring)."""
        leader = self.leader()
        if leader is None:
            return False
        _, share, wait_ms = leader
        return (
            self.steps >= MIN_STEPS and share >= CONSISTENT_SHARE
            and wait_ms >= max(NOISE_FLOOR_MS, 2 * self.clock_error_ms)
        )

    def render(self) -> str:
        """The summary line."""
        leader = self.leader()
        if leader is None:
            return "stragglers: no step's arrivals gathered yet (spread_every=N gathers them every N-th step)"
        rank, share, wait_ms = leader
        clocks = (
            "one host, exact clocks" if self.clock_error_ms == 0.0
            else f"clocks aligned to within {self.clock_error_ms:.3g} ms"
        )
        if self.is_consistent():
            return (
                f"stragglers: rank {rank} arrived last in {share:.0%} of {self.steps} steps, costing the "
                f"others {wait_ms:.3g} ms per step (median wait; {clocks})"
            )
        return (
            f"stragglers: no consistent straggler over {self.steps} steps (most often last: rank {rank}, "
            f"{share:.0%}, {wait_ms:.3g} ms); median arrival spread {statistics.median(self._spreads):.3g} ms ({clocks})"
        )
