"""The summary table: per-bucket percentiles as text, like nccl-tests and DeepSpeed print, and
the latest value of every watcher's scalars (:class:`~.records.Scalars`)."""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable

from ..schedules.wire import short_name
from .records import Record, StepRecord
from .sinks import Sink


class SummaryTable(Sink):
    """Per-bucket percentiles for a text table at the end, like nccl-tests and DeepSpeed print.

    One row per (bucket, size, dtype): DDP rebuilds its buckets after the first step, so the
    first step's layout gets rows of its own instead of blurring the others. Each row keeps
    at most ``window`` recent samples for its percentiles (memory stays flat); counts are exact.
    When the transfers carry a narrower dtype than the buckets, a line says which and what share
    of the bytes crossed the links ("bf16 on the wire: 0.50x the bytes"; busbw counts those).
    """

    def __init__(self, window: int = 4096) -> None:
        self.window = window
        self._rows: dict[tuple[int, int, str], _Row] = {}
        self._steps = _Row(window)
        self._exposed = _Row(window)
        self._last: StepRecord | None = None
        self._first_step_keys: set[tuple[int, int, str]] = set()
        self._wire: dict[str, list[int]] = {}  # per wire dtype: [bytes of the buckets, bytes on the wire]
        self._latest: dict[str, tuple[float, int]] = {}  # a watcher's tag -> (value, step)

    def write(self, record: StepRecord) -> None:
        for bucket in record.buckets:
            key = (bucket.index, bucket.nbytes, bucket.dtype)
            if record.step == 1:
                self._first_step_keys.add(key)
            row = self._rows.get(key)
            if row is None:
                row = self._rows[key] = _Row(self.window)
            row.add(bucket.time_ms, bucket.busbw_GBps, bucket.queue_ms)
            if bucket.wire and bucket.wire != bucket.dtype:
                totals = self._wire.setdefault(bucket.wire, [0, 0])
                totals[0] += bucket.nbytes
                totals[1] += bucket.bytes_on_wire
        if record.buckets:
            self._steps.add(record.total_ms, 0.0, 0.0)
            self._exposed.add(record.exposed_ms, 0.0, 0.0)
            self._last = record

    def write_record(self, record: Record) -> None:
        if record.summarized:
            for tag, value in record.scalars().items():
                self._latest[tag] = (value, record.step)

    def render(self, *, dropped: int = 0) -> str:
        """The table as text (a header line, one row per bucket, a per-step footer, a line per
        narrower wire dtype), then a line per watcher's tag: its latest value and step."""
        latest = "".join(f"\n  {tag}: {value:g} (step {step})" for tag, (value, step) in self._latest.items())
        if self._last is None:
            return "no communication recorded yet (no logged step has finished)" + latest
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
        lines += [
            f"  {short_name(wire)} on the wire: {on_wire / nbytes:.2f}x the bytes (busbw counts the bytes on the wire)"
            for wire, (nbytes, on_wire) in self._wire.items() if nbytes
        ]
        return "\n".join(lines) + latest


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