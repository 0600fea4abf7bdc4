"""Who arrived last: every rank's bucket hand-over times, gathered after the step.

A watcher (:class:`~.watcher.Watcher`). On the steps the recorder asks for (``spread_every``,
the trace window) the buckets are marked, and after the step, on the exchange worker
(:mod:`.exchange`), each rank shares when DDP handed its first and last bucket over (its
*arrival*) and its communication time; the recorder gets the gathered
:class:`~.records.RankArrivals`::

    hook thread       hand-over marks (the observation's, one per bucket)
    exchange worker   the step's marks read -> rows of (first, last, total_ms) of every rank,
                      on rank 0's clock -> recorder.record_ranks(RankArrivals)
                      [window's last step: every rank's trace events -> rank 0's merged file]

The times come from the hook's hand-over, not from the executor, so this works the same for
every algorithm, whatever runs the bucket.
"""

from __future__ import annotations

import json
import math

from .bucket_marks import clocks_busy_ms
from .records import RankArrivals
from .watcher import Watcher


class ArrivalGather(Watcher):
    """Every rank's arrival, for the recorder ``recorder`` (a :class:`~.recorder.Telemetry`)."""

    def __init__(self, recorder) -> None:
        self.recorder = recorder

    def wants_marks(self, step: int) -> bool:
        return self.recorder.gathers_ranks(step)

    def exchanges_after(self, step: int) -> bool:
        return self.recorder.gathers_ranks(step)

    def exchange(self, step, peers) -> None:
        clocks = step.read()
        if clocks is None:  # a CUDA event never completed: the others still need this rank's row
            row = [math.nan] * 3
        else:
            row = [clocks[0].handed, clocks[-1].handed, clocks_busy_ms(clocks)]
        rows = peers.rows(row)
        offsets = peers.clocks.offsets_ms
        self.recorder.record_ranks(RankArrivals(
            step=step.step,
            first_ms=tuple(r[0] - offsets[i] for i, r in enumerate(rows)),
            last_ms=tuple(r[1] - offsets[i] for i, r in enumerate(rows)),
            total_ms=tuple(r[2] for r in rows),
            offsets_ms=offsets,
            clock_error_ms=peers.clocks.max_error_ms,
            rank=peers.rank,
        ))
        if self.recorder.merges_trace_at(step.step):
            self._gather_trace(peers)

    def _gather_trace(self, peers) -> None:
        """Rank 0 receives every rank's trace events of the window, for one merged file."""
        payloads = peers.bytes_to_rank0(json.dumps(self.recorder.local_trace_events()).encode())
        if payloads is not None:
            offsets = peers.clocks.offsets_ms
            self.recorder.add_peer_traces(
                [(rank, json.loads(payload), offsets[rank]) for rank, payload in enumerate(payloads) if rank != 0]
            )
