"""The Chrome/Perfetto trace format: a window of steps as slices on per-bucket tracks.

:func:`trace_events` turns step records (and gathered arrivals) into Chrome trace events;
:class:`TraceSink` keeps a window of them and writes ``comm_trace.json``. Rank 0's file holds
every rank once they were gathered, already on its clock; :mod:`.trace_merge` joins the files
of a ``per_rank`` run.
"""

from __future__ import annotations

import collections
import json
import math
import os
from collections.abc import Iterable

from .records import LinkTimes, RankArrivals, StepRecord
from .sinks import Sink
from .trace_merge import shift_events


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
    every rank once they were gathered (:meth:`add_peer_traces`), already aligned.
    """

    def __init__(self, path: str | os.PathLike | None, *, steps: range | None = None, max_steps: int = 1000) -> None:
        self.path = None if path is None else os.fspath(path)
        self.steps = steps
        self._records: collections.deque[StepRecord] = collections.deque(maxlen=max_steps)
        self._arrivals: collections.deque[RankArrivals] = collections.deque(maxlen=max_steps)
        self._links: collections.deque[LinkTimes] = collections.deque(maxlen=max_steps)
        self._peer_events: list[dict] = []
        self._merged_ranks: list[int] = []
        self._dirty = False

    def write(self, record: StepRecord) -> None:
        if self.steps is None or record.step in self.steps:
            self._records.append(record)
            self._dirty = True

    def write_ranks(self, record: RankArrivals) -> None:
        if self.steps is None or record.step in self.steps:
            self._arrivals.append(record)
            self._dirty = True

    def write_links(self, record: LinkTimes) -> None:
        if record.spans and (self.steps is None or record.step in self.steps):
            self._links.append(record)
            self._dirty = True

    def add_peer_traces(self, traces) -> None:
        """Other ranks' events ``(rank, events, clock offset ms)``, moved onto this rank's clock
        (this is rank 0: offset 0)."""
        for rank, events, offset_ms in traces:
            self._peer_events.extend(shift_events(events, -offset_ms))
            self._merged_ranks.append(rank)
        self._dirty = True

    def events(self) -> list[dict]:
        """This rank's own events (its clock)."""
        return trace_events(self._records, self._arrivals) + link_events(self._links)

    def clock(self) -> dict:
        """How this file's clock relates to rank 0's (from the last gathered arrivals)."""
        if not self._arrivals:
            return {"clock_offset_ms": 0.0, "clock_error_ms": 0.0, "clock_known": False}
        last = self._arrivals[-1]
        return {"clock_offset_ms": last.offsets_ms[last.rank], "clock_error_ms": last.clock_error_ms,
                "clock_known": True}

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


#: Track numbers after every bucket's (bucket i is track i).
EXPOSED_TID, ARRIVAL_TID = 1_000_000, 1_000_001


def trace_events(records: Iterable[StepRecord], arrivals: Iterable[RankArrivals] = ()) -> list[dict]:
    """Chrome trace events (complete ``"X"`` slices, µs) for ``records``, and the recording
    rank's arrival and wait in ``arrivals``, on that rank's clock."""
    events: list[dict] = []
    named: set[tuple[int, int]] = set()

    def name_track(pid: int, tid: int, name: str) -> None:
        if (pid, -1) not in named:
            named.add((pid, -1))
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"rank {pid}"}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        if (pid, tid) not in named:
            named.add((pid, tid))
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})

    def slice_(name: str, pid: int, tid: int, start_ms: float, dur_ms: float, args: dict | None = None) -> None:
        event = {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": start_ms * 1e3, "dur": max(dur_ms, 0.0) * 1e3}
        if args:
            event["args"] = args
        events.append(event)

    for record in records:
        pid = record.rank
        for bucket in record.buckets:
            tid = bucket.index
            name_track(pid, tid, f"bucket {tid}")
            if bucket.queue_ms > 0.0:
                slice_("queue", pid, tid, bucket.start_ms - bucket.queue_ms, bucket.queue_ms, {"step": record.step})
            slice_(
                f"bucket {bucket.index} step {record.step}", pid, tid, bucket.start_ms, bucket.time_ms,
                {
                    "step": record.step, "bytes": bucket.nbytes, "wire_bytes": bucket.bytes_on_wire,
                    "wire": bucket.wire or bucket.dtype, "numel": bucket.numel, "dtype": bucket.dtype,
                    "algorithm": bucket.algorithm, "world_size": bucket.world_size,
                    "busbw_GBps": _finite(bucket.busbw_GBps), "algbw_GBps": _finite(bucket.algbw_GBps),
                },
            )
            for phase, offset in bucket.phase_offsets_ms.items():
                slice_(phase, pid, tid, bucket.start_ms + offset, bucket.phases_ms[phase], {"step": record.step})
        if record.buckets:
            name_track(pid, EXPOSED_TID, "exposed")
            end_ms = max(b.start_ms + b.time_ms for b in record.buckets)  # the last to finish
            slice_(f"exposed step {record.step}", pid, EXPOSED_TID, end_ms - record.exposed_ms, record.exposed_ms,
                   {"total_ms": record.total_ms, "num_buckets": record.num_buckets})
    for arrival in arrivals:
        pid, offset = arrival.rank, arrival.offsets_ms[arrival.rank]  # back onto this rank's clock
        name_track(pid, ARRIVAL_TID, "arrival")
        first, last = arrival.first_ms[pid] + offset, arrival.last_ms[pid] + offset
        args = {"step": arrival.step, "straggler": arrival.straggler, "clock_error_ms": arrival.clock_error_ms}
        slice_(f"handing over step {arrival.step}", pid, ARRIVAL_TID, first, last - first, args)
        wait = arrival.waits_ms[pid]
        if pid != arrival.straggler:
            slice_(f"wait for rank {arrival.straggler} step {arrival.step}", pid, ARRIVAL_TID, last, wait,
                   {**args, "wait_ms": wait})
    return events


#: The process that holds every link's track, sorted after the ranks; link ``s→d``'s track.
LINKS_PID = 1_000_000


def link_tid(src: int, dst: int) -> int:
    return src * 100_000 + dst


def link_events(records: Iterable[LinkTimes]) -> list[dict]:
    """Chrome trace events for the recording rank's incoming links in ``records`` (its clock):
    one track per directed link in a ``links`` process, a slice per busy span."""
    events: list[dict] = []
    named: set[int] = set()
    for record in records:
        for span in record.spans:
            tid = link_tid(span.src, span.dst)
            if not named:
                events.append({"ph": "M", "name": "process_name", "pid": LINKS_PID, "tid": 0, "args": {"name": "links"}})
                events.append({"ph": "M", "name": "process_sort_index", "pid": LINKS_PID, "tid": 0,
                               "args": {"sort_index": LINKS_PID}})
            if tid not in named:
                named.add(tid)
                events.append({"ph": "M", "name": "thread_name", "pid": LINKS_PID, "tid": tid,
                               "args": {"name": f"link {span.src}→{span.dst}"}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": LINKS_PID, "tid": tid,
                               "args": {"sort_index": tid}})
            duration_ms = span.end_ms - span.start_ms
            events.append({
                "ph": "X", "name": f"{span.src}→{span.dst}", "pid": LINKS_PID, "tid": tid, "ts": span.start_ms * 1e3,
                "dur": max(duration_ms, 0.0) * 1e3,
                "args": {"step": record.step, "bytes": span.nbytes, "transfers": span.transfers,
                         "MBps": span.nbytes / (duration_ms * 1e3) if duration_ms > 0 else 0.0,
                         "waited_ms": span.waited_ms},
            })
    return events


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0