"""A bucket's marks read as milliseconds, and a step's read marks turned into a StepRecord.

The marks themselves are taken by the bucket's watch (:class:`~.watcher.BucketWatch`): one at
the hand-over, one at each phase, one at the end. They are read once, off the training path
(:meth:`~.watcher.StepWatch.read`), into :class:`BucketClocks`: milliseconds on the host's
monotonic clock, from which every duration is a difference. :func:`step_record` makes the
recorder's :class:`~.records.StepRecord` of them.
"""

from __future__ import annotations

import dataclasses

from ..schedules.wire import SPARSE
from .records import BucketRecord, StepRecord, bandwidths_GBps, busy_ms


@dataclasses.dataclass(frozen=True)
class BucketClocks:
    """One bucket's marks read once, in ms on the host's monotonic clock (durations are
    differences of these: one clock reading per mark). ``cpu_ms``: the CPU time of the thread
    that ran the whole all-reduce (0 where one thread did not: ``native`` on gloo, CUDA)."""

    handed: float
    phases: tuple[tuple[str, float], ...]
    end: float
    cpu_ms: float = 0.0

    @classmethod
    def read(cls, bucket) -> BucketClocks:
        """The completed marks of ``bucket`` (a :class:`~.watcher.BucketWatch`)."""
        clock_ms = bucket.timer.clock_ms
        return cls(
            handed=clock_ms(bucket.handed),
            phases=tuple((phase, clock_ms(mark)) for phase, mark in bucket.phases),
            end=clock_ms(bucket.end),
            cpu_ms=bucket.cpu_ms,
        )

    @property
    def start(self) -> float:
        """Communication starts with the first phase (nothing moves for one rank or 0 bytes)."""
        return self.phases[0][1] if self.phases else self.end


def clocks_busy_ms(clocks) -> float:
    """The step's ``total_ms``: how long at least one of its buckets was communicating."""
    return busy_ms((clock.start, clock.end) for clock in clocks)


def step_record(step, clocks: tuple[BucketClocks, ...], *, dropped: int) -> StepRecord:
    """The recorder's record of ``step`` (a :class:`~.watcher.StepWatch`) from its read ``clocks``;
    ``dropped``: steps the recorder had dropped when it queued this one."""
    buckets = tuple(bucket_record(step, bucket, clock) for bucket, clock in zip(step.buckets, clocks))
    return StepRecord(
        step=step.step,
        buckets=buckets,
        total_ms=clocks_busy_ms(clocks),
        exposed_ms=max(clock.end for clock in clocks) - clocks[-1].handed,
        num_buckets=len(buckets),
        rank=step.rank,
        dropped=dropped,
    )


def bucket_record(step, bucket, clock: BucketClocks) -> BucketRecord:
    start = clock.start
    time_ms = clock.end - start
    phases_ms: dict[str, float] = {}
    offsets_ms: dict[str, float] = {}
    bounds = [*clock.phases, (None, clock.end)]
    for (phase, begin), (_, end) in zip(bounds, bounds[1:]):
        phases_ms[phase] = phases_ms.get(phase, 0.0) + (end - begin)
        offsets_ms.setdefault(phase, begin - start)
    algbw, _ = bandwidths_GBps(bucket.nbytes, time_ms, bucket.world_size)
    if bucket.kind == SPARSE:  # the gather: its wire bytes each cross one link (records.py)
        busbw = bandwidths_GBps(bucket.wire_bytes, time_ms, bucket.world_size)[0]
    else:
        _, busbw = bandwidths_GBps(bucket.wire_bytes, time_ms, bucket.world_size)  # the bytes that crossed the links
    return BucketRecord(
        step=step.step, index=bucket.index, nbytes=bucket.nbytes, numel=bucket.numel,
        dtype=str(bucket.dtype).removeprefix("torch."), algorithm=bucket.algorithm, world_size=bucket.world_size,
        queue_ms=start - clock.handed, time_ms=time_ms, phases_ms=phases_ms,
        algbw_GBps=algbw, busbw_GBps=busbw, rank=step.rank, start_ms=start,
        phase_offsets_ms=offsets_ms, wire_bytes=bucket.wire_bytes, wire=bucket.wire, kind=bucket.kind,
        nnz=bucket.size.nnz,
    )
