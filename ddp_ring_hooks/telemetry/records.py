"""What telemetry records: one :class:`BucketRecord` per gradient bucket, one :class:`StepRecord`
per optimizer step (one DDP reduction), and the bandwidth formulas they use.

Times are milliseconds. Bandwidths follow nccl-tests (``doc/PERFORMANCE.md``), in GB/s with
GB = 1e9 bytes, so the numbers compare directly with ``all_reduce_perf`` and NCCL's Inspector::

    algbw = bytes / time
    busbw = algbw * 2 (p - 1) / p        # all-reduce: every byte crosses 2(p-1)/p links

One step on one rank, as the records see it (CPU: the buckets run on the communication
workers, up to ``concurrent_buckets`` at once, while backward goes on computing)::

    backward  |=========================================|
    bucket 0      h0 ..q.. [== rs ==|== ag ==]             h = handed to the hook
    bucket 1               h1 ....q.... [== rs ==|== ag ==] q = queue_ms, [..] = time_ms
                                                 ^ last bucket handed   ^ last bucket reduced
                                                 |<---- exposed_ms ---->|
    total_ms = the time at least one bucket was in flight (the buckets' time_ms where they do
               not overlap: the sum when they run one after another)
"""

from __future__ import annotations

from dataclasses import dataclass, field


def all_reduce_bus_factor(world_size: int) -> float:
    """nccl-tests' all-reduce factor ``2(p-1)/p``: 0 for one rank, 1 for two, toward 2 for many."""
    return 2.0 * (world_size - 1) / world_size


def busy_ms(intervals) -> float:
    """Length of the union of ``(start_ms, end_ms)`` intervals: time when at least one ran."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def bandwidths_GBps(nbytes: int, time_ms: float, world_size: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s of an all-reduce of ``nbytes`` that took ``time_ms``.

    A zero duration (nothing moved: one rank, or an empty bucket) gives zero bandwidth rather
    than infinity, so charts stay readable.
    """
    if time_ms <= 0.0:
        return 0.0, 0.0
    algbw = nbytes / (time_ms * 1e-3) / 1e9
    return algbw, algbw * all_reduce_bus_factor(world_size)


@dataclass(frozen=True)
class BucketRecord:
    """Timing of one gradient bucket's all-reduce in one optimizer step, on one rank.

    ``step`` is the optimizer step (``HookState.iteration`` of that reduction, 1-based);
    ``index`` the bucket's position in DDP's launch order (DDP launches bucket 0 first).
    ``queue_ms`` is the wait from being handed to the hook until communication started;
    ``time_ms`` runs from the first posted transfer to the result being in the buffer.
    ``phases_ms`` splits ``time_ms`` by schedule phase (ring: reduce-scatter, all-gather).
    ``start_ms`` is the start on this process's clock (``time.perf_counter`` in ms, which on
    Linux is the machine-wide monotonic clock, so ranks on one host line up in a trace) and
    ``phase_offsets_ms`` where each phase starts, relative to ``start_ms``.
    """

    step: int
    index: int
    nbytes: int
    numel: int
    dtype: str
    algorithm: str
    world_size: int
    queue_ms: float
    time_ms: float
    phases_ms: dict[str, float]
    algbw_GBps: float
    busbw_GBps: float
    rank: int = 0
    start_ms: float = 0.0
    phase_offsets_ms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StepRecord:
    """All buckets of one optimizer step on one rank, and what they add up to.

    ``total_ms`` is the time at least one bucket was in flight (:func:`busy_ms` of their
    intervals: the sum of their ``time_ms`` when they do not overlap); ``exposed_ms`` runs from
    the moment the last bucket was handed to the hook (backward has produced every gradient)
    to the moment the last bucket finished: the communication that backward could not hide. ``dropped`` is how
    many step records the recorder had dropped (queue full) when this one was queued.
    ``rank_total_ms`` holds every rank's ``total_ms`` (by group rank) on the steps where the
    spread across ranks was gathered, else it is empty.
    """

    step: int
    buckets: tuple[BucketRecord, ...]
    total_ms: float
    exposed_ms: float
    num_buckets: int
    rank: int = 0
    dropped: int = 0
    rank_total_ms: tuple[float, ...] = ()
