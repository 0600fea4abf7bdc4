"""Where step records go: TensorBoard, a Chrome/Perfetto trace, memory, a summary table.

A sink gets finished :class:`~.records.StepRecord` s through ``write`` on the recorder's
writer thread, never on the training path, so a slow disk slows nobody. ``flush`` and
``close`` are called on that thread too (or after it stopped); sinks need no locks.

TensorBoard tags (stable: dashboards are built on them)::

    comm/bucket_{i}/time_ms  bytes  busbw_GBps  algbw_GBps  queue_ms  {phase}_ms
    comm/step/total_ms  exposed_ms  num_buckets  bucket_time_ms (histogram)
    comm/telemetry/dropped
    comm/ranks/straggler_rank  straggler_wait_ms  arrival_spread_ms  clock_error_ms
    comm/ranks/total_ms_min  total_ms_max  total_ms_spread                 (with spread_every)

``straggler_rank`` is the rank that arrived last (handed its last bucket over last) and
``straggler_wait_ms`` the median over the other ranks of how long they waited for it (see
:class:`~.records.RankArrivals`). There is no "slowest rank by communication time": the rank
that communicates longest is the one that waited longest, a victim, not the culprit.
"""

from __future__ import annotations

import collections
import json
import math
import os
from collections.abc import Iterable

from .fast_checksum import use_fast_checksum
from .records import RankArrivals, StepRecord


class Sink:
    """Receives step records. Override ``write``; ``flush`` and ``close`` default to nothing."""

    def write(self, record: StepRecord) -> None:
        raise NotImplementedError

    def write_ranks(self, record: RankArrivals) -> None:
        """Every rank's arrival in one step (gathered with ``spread_every``); ignored by default."""

    def flush(self) -> None:
        """Make everything written so far durable or visible."""

    def close(self) -> None:
        """Flush and release resources; called once, at the end."""
        self.flush()


class NullSink(Sink):
    """Discards every record: a stand-in where a sink is required but nothing should be kept."""

    def write(self, record: StepRecord) -> None:
        pass


class MemorySink(Sink):
    """Keeps the latest ``maxlen`` step records in memory, for programs that want the numbers.

    Example::

        >>> memory = MemorySink()
        >>> state = ddp_ring_hooks.register(model, sinks=[memory])
        >>> ...train...; state.telemetry.flush()
        >>> [r.exposed_ms for r in memory.records]
    """

    def __init__(self, maxlen: int = 10_000) -> None:
        self._records: collections.deque[StepRecord] = collections.deque(maxlen=maxlen)
        self._ranks: collections.deque[RankArrivals] = collections.deque(maxlen=maxlen)

    @property
    def records(self) -> list[StepRecord]:
        return list(self._records)

    @property
    def ranks(self) -> list[RankArrivals]:
        """The gathered arrivals of every rank, one per gathered step."""
        return list(self._ranks)

    def write(self, record: StepRecord) -> None:
        self._records.append(record)

    def write_ranks(self, record: RankArrivals) -> None:
        self._ranks.append(record)


class TensorBoardSink(Sink):
    """Writes the fixed ``comm/...`` tags with ``torch.utils.tensorboard.SummaryWriter``.

    Args:
        log_dir: the run directory for a writer of its own (closed with the sink).
        writer: an existing ``SummaryWriter`` to write into instead (e.g. Lightning's
            ``trainer.logger.experiment``); it is flushed but never closed here.
        step_offset: added to the optimizer step to get TensorBoard's ``global_step``.
        custom_scalars: write a custom-scalars layout (grouped charts) once, on the first
            record. A writer takes only one layout; pass False if yours already has one.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike | None = None,
        *,
        writer=None,
        step_offset: int = 0,
        custom_scalars: bool = True,
    ) -> None:
        if (log_dir is None) == (writer is None):
            raise ValueError("TensorBoardSink needs exactly one of log_dir=PATH or writer=SummaryWriter")
        use_fast_checksum()  # tensorboard's own record checksum is pure Python (fast_checksum.py)
        if writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:  # tensorboard is an optional extra
                raise ImportError(
                    "TensorBoardSink needs tensorboard; pip install 'ddp_ring_hooks[tensorboard]'"
                ) from error
            writer = SummaryWriter(log_dir=os.fspath(log_dir))
            self._owns_writer = True
        else:
            self._owns_writer = False
        self.writer = writer
        self.step_offset = step_offset
        self._layout_pending = custom_scalars

    def write(self, record: StepRecord) -> None:
        if self._layout_pending:
            self.writer.add_custom_scalars(custom_scalars_layout())
            self._layout_pending = False
        from tensorboard.compat.proto.summary_pb2 import Summary

        # All scalars of a step go into one event: what ``add_scalar`` writes per value
        # (a ``simple_value``), at a fifth of the cost of one event per value.
        values: list[Summary.Value] = []

        def add(tag: str, value: float) -> None:
            values.append(Summary.Value(tag=tag, simple_value=float(value)))

        step = record.step + self.step_offset
        for bucket in record.buckets:
            prefix = f"comm/bucket_{bucket.index}"
            add(f"{prefix}/time_ms", bucket.time_ms)
            add(f"{prefix}/bytes", bucket.nbytes)
            add(f"{prefix}/busbw_GBps", bucket.busbw_GBps)
            add(f"{prefix}/algbw_GBps", bucket.algbw_GBps)
            add(f"{prefix}/queue_ms", bucket.queue_ms)
            for phase, ms in bucket.phases_ms.items():
                add(f"{prefix}/{phase}_ms", ms)
        if record.buckets:
            add("comm/step/total_ms", record.total_ms)
            add("comm/step/exposed_ms", record.exposed_ms)
            add("comm/step/num_buckets", record.num_buckets)
            times = [bucket.time_ms for bucket in record.buckets]
            values.append(Summary.Value(tag="comm/step/bucket_time_ms", histo=_histogram(times)))
        add("comm/telemetry/dropped", record.dropped)
        self._write_values(values, step)

    def write_ranks(self, record: RankArrivals) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [
            Summary.Value(tag=f"comm/ranks/{tag}", simple_value=float(value))
            for tag, value in (
                ("straggler_rank", record.straggler),
                ("straggler_wait_ms", record.straggler_wait_ms),
                ("arrival_spread_ms", record.arrival_spread_ms),
                ("clock_error_ms", record.clock_error_ms),
            )
        ]
        if record.total_ms_known:
            totals = record.total_ms
            values += [
                Summary.Value(tag="comm/ranks/total_ms_min", simple_value=min(totals)),
                Summary.Value(tag="comm/ranks/total_ms_max", simple_value=max(totals)),
                Summary.Value(tag="comm/ranks/total_ms_spread", simple_value=max(totals) - min(totals)),
            ]
        self._write_values(values, record.step + self.step_offset)

    def _write_values(self, values: list, step: int) -> None:
        if self._layout_pending:
            self.writer.add_custom_scalars(custom_scalars_layout())
            self._layout_pending = False
        from tensorboard.compat.proto.summary_pb2 import Summary

        # SummaryWriter's own add_scalar goes through this same (underscored) accessor, which
        # torch's and tensorboardX's writers both have.
        self.writer._get_file_writer().add_summary(Summary(value=values), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        if self._owns_writer:
            self.writer.close()
        else:
            self.writer.flush()


def custom_scalars_layout() -> dict:
    """TensorBoard's custom-scalars layout: one chart per metric, all buckets on it.

    Multiline charts take regular expressions, so buckets that appear after DDP rebuilt its
    buckets (after step 1) join the charts without a second layout.
    """
    per_bucket = {
        f"bucket {name}": ["Multiline", [rf"comm/bucket_\d+/{tag}"]]
        for name, tag in (
            ("time (ms)", "time_ms"),
            ("busbw (GB/s)", "busbw_GBps"),
            ("bytes", "bytes"),
            ("queue (ms)", "queue_ms"),
        )
    }
    per_step = {
        "step: total vs exposed (ms)": ["Multiline", ["comm/step/total_ms", "comm/step/exposed_ms"]],
        "ranks: total min / max (ms)": ["Multiline", [r"comm/ranks/total_ms_(min|max)"]],
        "ranks: straggler wait / arrival spread (ms)": [
            "Multiline", ["comm/ranks/straggler_wait_ms", "comm/ranks/arrival_spread_ms"]
        ],
    }
    return {"comm buckets": per_bucket, "comm steps": per_step}


def _histogram(values: list[float], bins: int = 10):
    """A TensorBoard histogram of ``values`` in ``bins`` equal bins (a few values: pure Python
    is far cheaper than ``add_histogram``'s thousands of default bins)."""
    from tensorboard.compat.proto.summary_pb2 import HistogramProto

    low, high = min(values), max(values)
    width = (high - low) / bins or 1.0
    counts = [0] * bins
    for value in values:
        counts[min(bins - 1, int((value - low) / width))] += 1
    return HistogramProto(
        min=low, max=high, num=len(values), sum=sum(values), sum_squares=sum(v * v for v in values),
        bucket_limit=[low + width * (i + 1) for i in range(bins)], bucket=counts,
    )


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

    def add_peer_traces(self, traces) -> None:
        """Other ranks' events ``(rank, events, clock offset ms)``, moved onto this rank's clock
        (this is rank 0: offset 0)."""
        from .trace_merge import shift_events

        for rank, events, offset_ms in traces:
            self._peer_events.extend(shift_events(events, -offset_ms))
            self._merged_ranks.append(rank)
        self._dirty = True

    def events(self) -> list[dict]:
        """This rank's own events (its clock)."""
        return trace_events(self._records, self._arrivals)

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
                    "step": record.step, "bytes": bucket.nbytes, "numel": bucket.numel, "dtype": bucket.dtype,
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


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


class SummaryTable(Sink):
    """Per-bucket percentiles for a text table at the end, like nccl-tests and DeepSpeed print.

    One row per (bucket, size, dtype): DDP rebuilds its buckets after the first step, so the
    first step's layout gets rows of its own instead of blurring the others. Each row keeps
    at most ``window`` recent samples for its percentiles (memory stays flat); counts are exact.
    """

    def __init__(self, window: int = 4096) -> None:
        self.window = window
        self._rows: dict[tuple[int, int, str], _Row] = {}
        self._steps = _Row(window)
        self._exposed = _Row(window)
        self._last: StepRecord | None = None
        self._first_step_keys: set[tuple[int, int, str]] = set()

    def write(self, record: StepRecord) -> None:
        for bucket in record.buckets:
            key = (bucket.index, bucket.nbytes, bucket.dtype)
            if record.step == 1:
                self._first_step_keys.add(key)
            row = self._rows.get(key)
            if row is None:
                row = self._rows[key] = _Row(self.window)
            row.add(bucket.time_ms, bucket.busbw_GBps, bucket.queue_ms)
        if record.buckets:
            self._steps.add(record.total_ms, 0.0, 0.0)
            self._exposed.add(record.exposed_ms, 0.0, 0.0)
            self._last = record

    def render(self, *, dropped: int = 0) -> str:
        """The table as text (a header line, one row per bucket, a per-step footer)."""
        if self._last is None:
            return "no communication recorded yet (no logged step has finished)"
        first = self._last.buckets[0]
        lines = [
            f"communication per bucket, rank {self._last.rank}: {first.algorithm} over "
            f"{first.world_size} ranks, {self._steps.count} steps logged, {dropped} dropped",
            f"{'bucket':>6} {'bytes':>14} {'dtype':>9} {'count':>6} {'p50 ms':>9} {'p90 ms':>9} "
            f"{'max ms':>9} {'queue p50':>9} {'busbw p50 GB/s':>14}",
        ]
        for (index, nbytes, dtype), row in sorted(self._rows.items()):
            lines.append(
                f"{index:>6} {nbytes:>14,} {dtype:>9} {row.count:>6} {row.time(0.5):>9.3f} "
                f"{row.time(0.9):>9.3f} {row.max_time:>9.3f} {row.queue(0.5):>9.3f} {row.busbw(0.5):>14.3f}"
                + (FIRST_STEP_NOTE if self._first_step_only((index, nbytes, dtype), row) else "")
            )
        lines.append(
            f"  step: total p50 {self._steps.time(0.5):.3f} ms, p90 {self._steps.time(0.9):.3f} ms; "
            f"exposed p50 {self._exposed.time(0.5):.3f} ms, p90 {self._exposed.time(0.9):.3f} ms"
        )
        return "\n".join(lines)


    def _first_step_only(self, key: tuple[int, int, str], row: _Row) -> bool:
        """A row only DDP's first iteration made (its provisional buckets), in a longer run."""
        return key in self._first_step_keys and row.count == 1 and self._steps.count > 1


#: Appended to a row that only step 1 made, so the odd extra row explains itself.
FIRST_STEP_NOTE = "  <- step 1 only: DDP's first iteration, before it rebuilds its buckets"


class _Row:
    """Samples of one table row: exact count and max, recent values for percentiles."""

    def __init__(self, window: int) -> None:
        self.count = 0
        self.max_time = 0.0
        self._times: collections.deque[float] = collections.deque(maxlen=window)
        self._busbw: collections.deque[float] = collections.deque(maxlen=window)
        self._queue: collections.deque[float] = collections.deque(maxlen=window)

    def add(self, time_ms: float, busbw: float, queue_ms: float) -> None:
        self.count += 1
        self.max_time = max(self.max_time, time_ms)
        self._times.append(time_ms)
        self._busbw.append(busbw)
        self._queue.append(queue_ms)

    def time(self, q: float) -> float:
        return percentile(self._times, q)

    def busbw(self, q: float) -> float:
        return percentile(self._busbw, q)

    def queue(self, q: float) -> float:
        return percentile(self._queue, q)


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 1]) of ``values``; 0 when there are none."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
