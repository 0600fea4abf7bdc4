"""The Chrome/Perfetto trace format: a window of steps as slices on per-bucket tracks.

:func:`trace_events` turns step records into Chrome trace events; :class:`TraceSink` keeps a
window of them and of every watcher record's events (:class:`~.records.Record`: the arrivals,
each link's spans, any watcher's counters) and writes ``comm_trace.json``. Rank 0's file holds
every rank once they were gathered, already on its clock; :mod:`.trace_merge` joins the files
of a ``per_rank`` run.
"""

from __future__ import annotations

import collections
import json
import math
import os
from collections.abc import Iterable

from .records import Record, StepRecord
from .sinks import Sink
from .trace_format import CLOCK, EXPOSED_TID, slice_event, track_names


class TraceSink(Sink):
    """A Chrome/Perfetto trace (``chrome://tracing``, ui.perfetto.dev) of a window of steps.

    One process per rank, one thread (track) per bucket, and on each track a ``queue`` slice
    followed by the bucket's slice with one slice per phase nested inside it; an ``exposed``
    track shows the part of each step backward could not hide; on steps whose arrivals were
    gathered, an ``arrival`` track shows the buckets being handed over and the wait for the
    rank that arrived last::

        rank 0
          bucket 0   [queue][ bucket 0 step 5              ]
                            [ reduce-scatter ][ all-gather ]
          bucket 1          [queue       ][ bucket 1 step 5 ...
          exposed                          [ exposed step 5 ]
          arrival   [handing over][wait for rank 2 step 5]
        links                                       (links=True: one track per directed link)
          link 1→2       [1→2][1→2]      [1→2]
          link 2→3            [2→3]  [2→3]

    ``steps`` limits the window (a ``range`` of optimizer steps, ``None`` for all) and
    ``max_steps`` bounds memory whatever the window. The file is (re)written on flush/close;
    with ``path=None`` the events are only kept (rank 0 gathers them into its file).

    Times are this rank's monotonic clock; the file says how it relates to rank 0's
    (``ddp_ring_hooks.clock_offset_ms``), so files of several ranks can be put on one axis
    (:func:`~.trace_merge.merge_trace_files`, ``ddp-ring-hooks trace merge``). Rank 0's file holds
    every rank once they were gathered (a record with ``merged_ranks``), already aligned.
    """

    def __init__(self, path: str | os.PathLike | None, *, steps: range | None = None, max_steps: int = 1000) -> None:
        self.path = None if path is None else os.fspath(path)
        self.steps = steps
        self._records: collections.deque[StepRecord] = collections.deque(maxlen=max_steps)
        self._watched: collections.deque[list[dict]] = collections.deque(maxlen=max_steps)  # each record's events
        self._peer_events: list[dict] = []
        self._merged_ranks: list[int] = []
        self._clock: dict | None = None  # the latest CLOCK event's arguments
        self._dirty = False

    def write(self, record: StepRecord) -> None:
        if self.steps is None or record.step in self.steps:
            self._records.append(record)
            self._dirty = True

    def write_record(self, record: Record) -> None:
        """A watcher record's events, in the window; the other ranks' (``merged_ranks``, rank 0's
        merged trace) kept apart; our clock metadata taken into the file's header."""
        if self.steps is not None and record.step not in self.steps:
            return
        events = record.trace_events()
        if not events:
            return
        if record.merged_ranks:
            self._peer_events.extend(events)
            self._merged_ranks.extend(record.merged_ranks)
        else:
            clocks = [event for event in events if event.get("name") == CLOCK]
            if clocks:
                self._clock = clocks[-1]["args"]
            self._watched.append([event for event in events if event.get("name") != CLOCK])
        self._dirty = True

    def events(self) -> list[dict]:
        """This rank's own events (its clock), each track named once."""
        events, named = trace_events(self._records), set()
        for event in (event for record in self._watched for event in record):
            if event["ph"] == "M":
                key = (event["name"], event["pid"], event["tid"])
                if key in named:
                    continue
                named.add(key)
            events.append(event)
        return events

    def clock(self) -> dict:
        """How this file's clock relates to rank 0's (from the last gathered arrivals)."""
        if self._clock is None:
            return {"clock_offset_ms": 0.0, "clock_error_ms": 0.0, "clock_known": False}
        return {**self._clock, "clock_known": True}

    def flush(self) -> None:
        if not self._dirty or self.path is None:
            return
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        rank = self._records[-1].rank if self._records else 0
        metadata = {"rank": rank, **self.clock(), "merged_ranks": sorted({rank, *self._merged_ranks})}
        temporary = f"{self.path}.tmp"
        with open(temporary, "w") as file:
            json.dump({"traceEvents": [*self.events(), *self._peer_events], "displayTimeUnit": "ms",
                       "ddp_ring_hooks": metadata}, file)
        os.replace(temporary, self.path)  # readers never see half a file
        self._dirty = False


def trace_events(records: Iterable[StepRecord]) -> list[dict]:
    """Chrome trace events (complete ``"X"`` slices, µs) for ``records``, on the recording
    rank's clock: a track per bucket (its queue, its slice, a slice per phase) and the step's
    exposed part."""
    events: list[dict] = []
    named: set[tuple[int, int]] = set()

    def name_track(pid: int, tid: int, name: str) -> None:
        if (pid, tid) not in named:
            events.extend(track_names(pid, tid, f"rank {pid}", name)[0 if (pid, -1) not in named else 2:])
            named.update({(pid, tid), (pid, -1)})

    for record in records:
        pid = record.rank
        for bucket in record.buckets:
            tid = bucket.index
            name_track(pid, tid, f"bucket {tid}")
            if bucket.queue_ms > 0.0:
                events.append(slice_event("queue", pid, tid, bucket.start_ms - bucket.queue_ms, bucket.queue_ms,
                                          {"step": record.step}))
            events.append(slice_event(
                f"bucket {bucket.index} step {record.step}", pid, tid, bucket.start_ms, bucket.time_ms,
                {
                    "step": record.step, "bytes": bucket.nbytes, "wire_bytes": bucket.bytes_on_wire,
                    "wire": bucket.wire or bucket.dtype, "numel": bucket.numel, "dtype": bucket.dtype,
                    "algorithm": bucket.algorithm, "world_size": bucket.world_size, "kind": bucket.kind,
                    **({} if bucket.nnz is None else {"nnz": bucket.nnz}),
                    "busbw_GBps": _finite(bucket.busbw_GBps), "algbw_GBps": _finite(bucket.algbw_GBps),
                },
            ))
            for phase, offset in bucket.phase_offsets_ms.items():
                events.append(slice_event(phase, pid, tid, bucket.start_ms + offset, bucket.phases_ms[phase],
                                          {"step": record.step}))
        if record.buckets:
            name_track(pid, EXPOSED_TID, "exposed")
            end_ms = max(b.start_ms + b.time_ms for b in record.buckets)  # the last to finish
            events.append(slice_event(f"exposed step {record.step}", pid, EXPOSED_TID, end_ms - record.exposed_ms,
                                      record.exposed_ms, {"comm_ms": record.comm_ms, "total_ms": record.total_ms,
                                       "num_buckets": record.num_buckets}))
    return events


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0
