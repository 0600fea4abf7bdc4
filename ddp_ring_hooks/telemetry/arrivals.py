"""Who arrived last: every rank's bucket hand-over times, gathered after the step.

A watcher (:class:`~.watcher.Watcher`). On the steps the recorder asks for (``spread_every``,
the trace window) the buckets are marked, and after the step, on the exchange worker
(:mod:`.exchange`), each rank shares when DDP handed its first and last bucket over (its
*arrival*) and its communication time; the recorder gets the gathered
:class:`~.records.RankArrivals`::

    hook thread       hand-over marks (the observation's, one per bucket)
    exchange worker   the step's marks read -> this rank's (first, last, total_ms) in the
                      step's one gather (:mod:`.exchange`) -> every rank's,
                      on rank 0's clock -> recorder.record(RankArrivals) on spread steps (its
                      comm/ranks/* scalars, its arrival track), its trace events alone on the
                      window's other steps; spread steps -> the tally (the summary's line)
    (after the other watchers' exchanges, the window's last step: TraceGather, every rank's
     trace events -> rank 0's merged file)

The times come from the hook's hand-over, not from the executor, so this works the same for
every algorithm, whatever runs the bucket.
"""

from __future__ import annotations

import json
import math
import threading

from .bucket_marks import clocks_busy_ms
from .records import RankArrivals, Trace
from .stragglers import StragglerTally
from .trace_merge import shift_events
from .watcher import Watcher


class ArrivalGather(Watcher):
    """Every rank's arrival, recorded through the recorder ``recorder`` (a :class:`~.recorder.Telemetry`),
    and the tally of who arrived last (:class:`~.stragglers.StragglerTally`) for the summary."""

    def __init__(self, recorder, timeline=None) -> None:
        self.recorder = recorder
        #: the advisor's :class:`~.timeline.Timeline` (the observation sets it): told each spread
        #: step's arrivals, for the wait a larger world adds
        self.timeline = timeline
        self._tally = StragglerTally(window=recorder.options.summary_window)
        self._lock = threading.Lock()  # the exchange worker adds, the summary reads

    def wants_marks(self, step: int) -> bool:
        return self.recorder.gathers_ranks(step)

    def exchanges_after(self, step: int) -> bool:
        return self.recorder.gathers_ranks(step)

    def share(self, step, peers) -> tuple[float, float, float]:
        clocks = step.read()
        if clocks is None:  # a CUDA event never completed: the others still need this rank's row
            return (math.nan,) * 3
        return clocks[0].handed, clocks[-1].handed, clocks_busy_ms(clocks)

    def shared(self, step, peers, rows) -> None:
        offsets = peers.clocks.offsets_ms
        arrivals = RankArrivals(
            step=step.step,
            first_ms=tuple(r[0] - offsets[i] for i, r in enumerate(rows)),
            last_ms=tuple(r[1] - offsets[i] for i, r in enumerate(rows)),
            total_ms=tuple(r[2] for r in rows),
            offsets_ms=offsets,
            clock_error_ms=peers.clocks.max_error_ms,
            rank=peers.rank,
        )
        if self.recorder.spreads_at(step.step):
            with self._lock:
                self._tally.add(arrivals)
            if self.timeline is not None:
                self.timeline.arrived(step.step, arrivals.last_ms)
            self.recorder.record(arrivals, group=step.group)
        else:  # a trace step only: its arrival track, no scalars
            self.recorder.record(Trace(step.step, tuple(arrivals.trace_events())), group=step.group)

    def summary_line(self) -> str | None:
        """With ``spread_every``: who kept the others waiting (:class:`~.stragglers.StragglerTally`),
        after how often steps gather when the cadence is chosen from its cost (``"auto"``)."""
        if not self.recorder.options.spread_every:
            return None
        with self._lock:
            line = self._tally.render()
        cadence = self.recorder.cadence.summary_line()
        return line if cadence is None else f"{cadence}\n{line}"


class TraceGather(Watcher):
    """At the trace window's last step, rank 0 receives every rank's trace events (the buckets',
    the arrivals', the links') and records them, on its clock, for one merged file. After every
    other watcher's exchange: their events of that step are in."""

    def __init__(self, recorder) -> None:
        self.recorder = recorder

    def exchanges_after(self, step: int) -> bool:
        return self.recorder.gathers_ranks(step) and self.recorder.merges_trace_at(step)

    def exchange(self, step, peers) -> None:
        payloads = peers.bytes_to_rank0(json.dumps(self.recorder.local_trace_events()).encode())
        if payloads is not None:
            offsets, events, ranks = peers.clocks.offsets_ms, [], []
            for rank, payload in enumerate(payloads):
                if rank != 0:  # onto rank 0's clock
                    events += shift_events(json.loads(payload), -offsets[rank])
                    ranks.append(rank)
            self.recorder.record(Trace(step.step, tuple(events), merged_ranks=tuple(ranks)), group=step.group)
