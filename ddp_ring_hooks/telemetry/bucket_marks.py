"""One bucket's marks (handed over, each phase, finished) and how they become records.

:class:`BucketObserver` is what the executor calls on the hot path: each call takes one clock
mark (host time, or a CUDA event) and nothing else. The marks of a step's buckets wait in a
:class:`PendingStep`; the writer thread turns them into a :class:`~.records.StepRecord` with
:func:`resolve_step` (on CUDA it first polls the events until they are complete).
"""

from __future__ import annotations

import dataclasses

from ..runtime.observer import ExecutionObserver
from .records import BucketRecord, StepRecord, bandwidths_GBps, busy_ms


@dataclasses.dataclass
class PendingStep:
    """The raw marks of one step's buckets, on their way to becoming a StepRecord."""

    step: int
    rank: int
    buckets: list[BucketObserver] = dataclasses.field(default_factory=list)
    dropped: int = 0
    # Buckets may finish out of order (several run at once on CPU): the step is complete when
    # the last bucket was handed over and every bucket handed over has finished.
    finished: int = 0
    last_handed: bool = False


class BucketObserver(ExecutionObserver):
    """Marks the life of one bucket: handed over, each phase, finished (cheap; no waiting)."""

    def __init__(self, telemetry, pending, timer, *, index, buffer, algorithm, world_size, group):
        self.telemetry = telemetry
        # The step and its buckets refer to each other until the step completes; then
        # Telemetry._bucket_finished drops these references, so no cycle is left for the
        # garbage collector (memory would saw-tooth).
        self.pending = pending
        self.timer = timer
        self.index = index
        self.numel = buffer.numel()
        self.nbytes = self.numel * buffer.element_size()
        self.dtype = buffer.dtype  # named on the writer thread
        self.algorithm = algorithm
        self.world_size = world_size
        self.group = group
        self.phases: list[tuple[str, object]] = []
        self.end = None
        self.handed = timer.mark()

    def on_phase(self, phase: str) -> None:
        self.phases.append((phase, self.timer.mark()))

    def on_finish(self) -> None:
        self.end = self.timer.mark()
        self.telemetry._bucket_finished(self)


def resolve_step(pending: PendingStep, *, deadline: float) -> StepRecord | None:
    """Turn one step's marks into a StepRecord (waits, by polling, for CUDA events)."""
    finished = pending.buckets  # a step is queued only once every bucket has finished
    for bucket in finished:
        if not bucket.timer.wait_ready(bucket.end, deadline):
            return None
    clocks = [BucketClocks.read(bucket) for bucket in finished]
    for bucket in finished:  # read once and for all: CUDA events go back to be reused
        bucket.timer.release([bucket.handed, *(mark for _, mark in bucket.phases), bucket.end])
    buckets = tuple(bucket_record(pending, bucket, clock) for bucket, clock in zip(finished, clocks))
    return StepRecord(
        step=pending.step,
        buckets=buckets,
        total_ms=clocks_busy_ms(clocks),
        exposed_ms=max(clock.end for clock in clocks) - clocks[-1].handed,
        num_buckets=len(buckets),
        rank=pending.rank,
        dropped=pending.dropped,
    )


@dataclasses.dataclass(frozen=True)
class BucketClocks:
    """One bucket's marks read once, in ms on the host's monotonic clock (durations are
    differences of these: one clock reading per mark)."""

    handed: float
    phases: tuple[tuple[str, float], ...]
    end: float

    @classmethod
    def read(cls, bucket: BucketObserver) -> BucketClocks:
        clock_ms = bucket.timer.clock_ms
        return cls(
            handed=clock_ms(bucket.handed),
            phases=tuple((phase, clock_ms(mark)) for phase, mark in bucket.phases),
            end=clock_ms(bucket.end),
        )

    @property
    def start(self) -> float:
        """Communication starts with the first phase (nothing moves for one rank or 0 bytes)."""
        return self.phases[0][1] if self.phases else self.end


def clocks_busy_ms(clocks) -> float:
    """The step's ``total_ms``: how long at least one of its buckets was communicating."""
    return busy_ms((clock.start, clock.end) for clock in clocks)


def step_busy_ms(buckets: list[BucketObserver]) -> float:
    """The step's ``total_ms`` from host marks, as :func:`resolve_step` computes it (the
    spread gather takes it on the worker, before the writer resolves the step)."""
    return clocks_busy_ms(map(BucketClocks.read, buckets))


def bucket_record(pending: PendingStep, bucket: BucketObserver, clock: BucketClocks) -> BucketRecord:
    start = clock.start
    time_ms = clock.end - start
    phases_ms: dict[str, float] = {}
    offsets_ms: dict[str, float] = {}
    bounds = [*clock.phases, (None, clock.end)]
    for (phase, begin), (_, end) in zip(bounds, bounds[1:]):
        phases_ms[phase] = phases_ms.get(phase, 0.0) + (end - begin)
        offsets_ms.setdefault(phase, begin - start)
    algbw, busbw = bandwidths_GBps(bucket.nbytes, time_ms, bucket.world_size)
    return BucketRecord(
        step=pending.step, index=bucket.index, nbytes=bucket.nbytes, numel=bucket.numel, dtype=str(bucket.dtype).removeprefix("torch."),
        algorithm=bucket.algorithm, world_size=bucket.world_size,
        queue_ms=start - clock.handed, time_ms=time_ms, phases_ms=phases_ms,
        algbw_GBps=algbw, busbw_GBps=busbw, rank=pending.rank, start_ms=start,
        phase_offsets_ms=offsets_ms,
    )
