"""The summary table: per-bucket percentiles as text, like nccl-tests and DeepSpeed print, and
the latest value of every watcher's scalars (:class:`~.records.Scalars`)."""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable

from ..schedules.wire import DENSE, DENSIFIED, SPARSE, short_name
from .records import Record, StepRecord
from .sinks import Sink


class SummaryTable(Sink):
    """Per-bucket percentiles for a text table at the end, like nccl-tests and DeepSpeed print.

    One row per (bucket, size, dtype): DDP rebuilds its buckets after the first step, so the
    first step's layout gets rows of its own instead of blurring the others. Each row keeps
    at most ``window`` recent samples for its percentiles (memory stays flat); counts are exact.
    When the transfers carry a narrower dtype than the buckets, a line says which and what share
    of the bytes crossed the links ("bf16 on the wire: 0.50x the bytes"; busbw counts those).
    A sparse bucket's bytes change with every batch (the rows it touched): it has one row, its
    bytes their median, marked as gathered with its median ``nnz``; a densified one is marked too.
    The step line: communication (from each bucket's hand-over, queue included), exposed (after
    backward handed its last bucket: never more than communication) and in flight (transfers
    only), the words of ``docs/telemetry.md``'s glossary.
    """

    def __init__(self, window: int = 4096) -> None:
        self.window = window
        self._rows: dict[tuple[int, int, str], _Row] = {}
        self._steps = _Row(window)
        self._exposed = _Row(window)
        self._comm = _Row(window)
        self._last: StepRecord | None = None
        self._first_step_keys: set[tuple[int, int, str]] = set()
        self._wire: dict[str, list[int]] = {}  # per wire dtype: [bytes of the buckets, bytes on the wire]
        self._latest: dict[str, tuple[float, int]] = {}  # a watcher's tag -> (value, step)

    def write(self, record: StepRecord) -> None:
        for bucket in record.buckets:
            varies = bucket.nnz is not None and bucket.kind != DENSIFIED  # a sparse bucket's bytes: its rows
            key = (bucket.index, _SPARSE_ROW if varies else bucket.nbytes, bucket.dtype)
            if record.step == 1:
                self._first_step_keys.add(key)
            row = self._rows.get(key)
            if row is None:
                row = self._rows[key] = _Row(self.window, kind=bucket.kind)
            row.add(bucket.time_ms, bucket.busbw_GBps, bucket.queue_ms, nbytes=bucket.nbytes, nnz=bucket.nnz)
            if bucket.wire and bucket.wire != bucket.dtype:
                totals = self._wire.setdefault(bucket.wire, [0, 0])
                totals[0] += bucket.nbytes
                totals[1] += bucket.bytes_on_wire
        if record.buckets:
            self._steps.add(record.total_ms, 0.0, 0.0)
            self._exposed.add(record.exposed_ms, 0.0, 0.0)
            self._comm.add(record.comm_ms, 0.0, 0.0)
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
        first = next((b for b in self._last.buckets if b.kind != SPARSE), self._last.buckets[0])
        lines = [
            f"communication per bucket, rank {self._last.rank}: {first.algorithm} over "
            f"{first.world_size} ranks, {self._steps.count} steps logged, {dropped} dropped",
            f"{'bucket':>6} {'bytes':>14} {'dtype':>9} {'count':>6} {'p50 ms':>9} {'p90 ms':>9} "
            f"{'max ms':>9} {'queue p50':>9} {'busbw p50 GB/s':>14}",
        ]
        for (index, nbytes, dtype), row in sorted(self._rows.items()):
            shown = int(percentile(row.nbytes, 0.5)) if nbytes == _SPARSE_ROW else nbytes
            lines.append(
                f"{index:>6} {shown:>14,} {dtype:>9} {row.count:>6} {row.time(0.5):>9.3f} "
                f"{row.time(0.9):>9.3f} {row.max_time:>9.3f} {row.queue(0.5):>9.3f} {row.busbw(0.5):>14.3f}"
                + (FIRST_STEP_NOTE if self._first_step_only((index, nbytes, dtype), row) else row.note())
            )
        # Communication and exposed both count from the hand-over (exposed never exceeds it);
        # in flight leaves the queues out: the glossary of docs/telemetry.md.
        lines.append(
            f"  step: communication p50 {self._comm.time(0.5):.3f} ms, p90 {self._comm.time(0.9):.3f} ms "
            f"(from the hand-overs, queue included); exposed p50 {self._exposed.time(0.5):.3f} ms, "
            f"p90 {self._exposed.time(0.9):.3f} ms; in flight p50 {self._steps.time(0.5):.3f} ms, "
            f"p90 {self._steps.time(0.9):.3f} ms (transfers only, no queue)"
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
#: The bytes of a sparse bucket's row key: one row whatever its size at each step.
_SPARSE_ROW = -1


class _Row:
    """Samples of one table row: exact count and max, recent values for percentiles (a sparse
    bucket's also its bytes and nnz, which change with every batch)."""

    def __init__(self, window: int, *, kind: str = DENSE) -> None:
        self.count = 0
        self.max_time = 0.0
        self.kind = kind
        self._times: collections.deque[float] = collections.deque(maxlen=window)
        self._busbw: collections.deque[float] = collections.deque(maxlen=window)
        self._queue: collections.deque[float] = collections.deque(maxlen=window)
        self.nbytes: collections.deque[int] = collections.deque(maxlen=window)
        self.nnz: collections.deque[int] = collections.deque(maxlen=window)

    def add(self, time_ms: float, busbw: float, queue_ms: float, *, nbytes: int = 0, nnz: int | None = None) -> None:
        self.count += 1
        self.max_time = max(self.max_time, time_ms)
        self._times.append(time_ms)
        self._busbw.append(busbw)
        self._queue.append(queue_ms)
        if nnz is not None:
            self.nbytes.append(nbytes)
            self.nnz.append(nnz)

    def note(self) -> str:
        """What marks a sparse bucket's row (gathered: its bytes are indices and values)."""
        if self.kind == SPARSE:
            return f"  <- sparse, gathered: nnz p50 {int(percentile(self.nnz, 0.5)):,} (bytes: its indices and values)"
        if self.kind == DENSIFIED:
            return f"  <- sparse, densified (sparse='dense'): nnz p50 {int(percentile(self.nnz, 0.5)):,}"
        if self.nnz:
            return f"  <- sparse, by your hook: nnz p50 {int(percentile(self.nnz, 0.5)):,}"
        return ""

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