"""One run, summarized: the medians the step model starts from (pure; reads timeline records).

The records are what :class:`~ddp_ring_hooks.telemetry.timeline.Timeline` writes: a
:class:`~ddp_ring_hooks.telemetry.timeline_records.TimelineRun`, then one
:class:`~ddp_ring_hooks.telemetry.timeline_records.TimelineStep` per optimizer step. Step 1 is left out: DDP reduces one big
bucket then and rebuilds its buckets after it. So are steps whose bucket count differs from
the others (a rebuild, an error). Medians, not means: on a shared machine a few disturbed
steps move the mean but not the median.

How a step splits (``k`` micro-batches, the last one synchronizes)::

    step_ms = (k-1)·micro + forward + backward + exposed + optimizer + rest
                                       └ includes contention: communication threads running
                                         "hidden" behind backward take CPU from it

    clean micro-batch = forward + (backward - contention) + rest

- ``rest``: what is left of the step (data loading, DDP's finalize, the training loop).
- ``contention``: when the run had ``k > 1``, the synchronizing micro-batch's extra time over
  a ``no_sync`` one, measured. With ``k = 1`` it is estimated from the CPU time the other
  threads used during that micro-batch, times the share of it that had no core of its own:
  ``oversubscribed = clamp(1 - spare cores per rank / lanes, 0, 1)``.

CPU (gloo) runs only: on CUDA the hook and backward only enqueue work, so the host clocks of
the timeline would time launches, not compute or communication (a clear error says so).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ..schedules import wire_of
from ..telemetry.records import busy_ms
from ..telemetry.timeline_records import TimelineRecord, TimelineRun, TimelineStep


@dataclass(frozen=True)
class BucketProfile:
    """One bucket of the rebuilt layout: bytes, hand-over time (ms into backward), its
    measured all-reduce time and the CPU time its worker spent on it (medians)."""

    nbytes: int
    ready_ms: float
    comm_ms: float
    cpu_ms: float
    #: its own time on the link: from its start, or the end of the bucket before it on the link
    #: when that was later, to its end (:func:`service_ms`; what the replay's costs are fitted to)
    service_ms: float = 0.0
    #: how it was reduced (``dense``, ``sparse`` gathered, ``densified``, ``foreign``) and, for a
    #: sparse one, its stored rows and its size both ways (the timeline's, version 3; medians)
    kind: str = "dense"
    nnz: int | None = None
    sparse_bytes: int | None = None
    dense_bytes: int | None = None

    @property
    def sparse(self) -> bool:
        """Whether it is a sparse bucket whose size both ways is known (gathered or densified)."""
        return self.sparse_bytes is not None and self.dense_bytes is not None


@dataclass(frozen=True)
class RunProfile:
    """The run as the step model sees it (times in ms, medians over the measured steps)."""

    world_size: int
    algorithm: str
    lanes: int
    bucket_cap_bytes: int
    first_bucket_bytes: int
    param_bytes: tuple[int, ...]
    param_dtypes: tuple[str, ...]
    device: str
    local_world_size: int
    steps: int
    accumulate: int
    step_ms: float
    forward_ms: float
    backward_ms: float
    exposed_ms: float
    optimizer_ms: float
    rest_ms: float
    comm_ms: float
    hidden_ms: float
    contention_ms: float
    contention_source: str
    buckets: tuple[BucketProfile, ...]
    #: A ``no_sync`` micro-batch as measured (k > 1 runs); ``None`` at k = 1.
    nosync_micro_ms: float | None = None
    #: The node of each rank and the ring's order, as the run recorded them (``None``: unknown).
    nodes: tuple[int, ...] | None = None
    ring: tuple[int, ...] | None = None
    #: The algorithm's resolved options and the network probe, as the run recorded them
    #: (``None``: a timeline from before they were recorded, or the probe was off).
    options: tuple[tuple[str, object], ...] | None = None
    probe: tuple | None = None
    probe_algorithm: str | None = None
    #: Whether DDP expected each parameter's gradient sparse (a bucket of its own), as the run
    #: recorded it (``None``: a timeline from before version 4).
    param_sparse: tuple[bool, ...] | None = None

    @property
    def wire(self) -> str | None:
        """The wire dtype the run's buckets travelled in (``None``: not recorded)."""
        return None if self.options is None else wire_of(self.options)

    @property
    def clean_micro_ms(self) -> float:
        """One micro-batch without communication: a measured ``no_sync`` micro-batch, or at
        k = 1 forward plus backward without its contention."""
        if self.nosync_micro_ms is not None:
            return self.nosync_micro_ms
        return self.forward_ms + self.backward_ms - self.contention_ms

    @property
    def step_rest_ms(self) -> float:
        """What an optimizer step costs once, beyond its micro-batches, communication and
        optimizer: at k = 1 everything outside forward and backward (loss, data, zero_grad,
        the loop). Counted once per step: charging it to every micro-batch over-predicted
        accumulation by 12-38% on a small MLP (``benchmarks/advisor_accuracy.py``)."""
        return (self.step_ms - self.accumulate * self.clean_micro_ms - self.contention_ms
                - self.exposed_ms - self.optimizer_ms)

    @property
    def environment(self) -> dict[str, str]:
        """The run's environment variables that algorithm options default to (the registry's
        ``Option.environment``), as the timeline recorded them: options are resolved as they
        were in the run, not in the shell that reads its log."""
        return {"LOCAL_WORLD_SIZE": str(self.local_world_size)}

    @property
    def bucket_cap_mb(self) -> float:
        return self.bucket_cap_bytes / (1 << 20)

    @property
    def default_bucket_cap(self) -> bool:
        """Whether DDP ran with its default cap (25 MiB with a small first bucket)."""
        return self.first_bucket_bytes < self.bucket_cap_bytes


def oversubscribed(run: TimelineRun) -> float:
    """Share of the communication threads' CPU time that takes a core from backward."""
    cores_per_rank = run.cpu_count / max(1, run.local_world_size)
    spare = cores_per_rank - run.torch_threads
    return min(1.0, max(0.0, 1.0 - spare / max(1, run.concurrent_buckets)))


def profile_run(records: Sequence[TimelineRecord]) -> RunProfile:
    """Summarize timeline ``records`` (the run record first) into a :class:`RunProfile`."""
    if not records or not isinstance(records[0], TimelineRun):
        raise ValueError("a timeline starts with its run record; is this a timeline.jsonl from ddp_ring_hooks?")
    run, steps = records[0], [r for r in records[1:] if isinstance(r, TimelineStep)]
    _one_run(run, records)
    if run.device != "cpu":
        raise ValueError(
            f"this timeline was recorded on {run.device}: there the hook and backward only enqueue work, "
            "so host clocks do not time compute or communication; the advisor reads CPU (gloo) runs for now"
        )
    steps = _measured(steps)
    k = Counter(s.micro_batches for s in steps).most_common(1)[0][0]
    steps = [s for s in steps if s.micro_batches == k]
    if len(steps) < MIN_MEASURED:
        raise ValueError(
            f"the timeline holds {len(steps)} measured step(s) of the run's setting (after step 1, at k={k} with "
            f"the usual bucket count); the advisor needs at least {MIN_MEASURED}: one step is no median, and a "
            "disturbed step would be the whole prediction. Train a few more steps"
        )

    def median(name: str) -> float:
        return statistics.median(getattr(s, name) for s in steps)

    step_ms, forward, backward = median("step_ms"), median("forward_ms"), median("backward_ms")
    exposed, optimizer = median("exposed_ms"), median("optimizer_ms")
    count = len(steps[0].buckets)
    per_step = [service_ms([(b.start_ms, b.end_ms) for b in s.buckets]) for s in steps]
    buckets = tuple(
        BucketProfile(
            nbytes=int(statistics.median(s.buckets[i].nbytes for s in steps)),
            ready_ms=statistics.median(s.buckets[i].ready_ms for s in steps),
            comm_ms=statistics.median(s.buckets[i].comm_ms for s in steps),
            cpu_ms=statistics.median(s.buckets[i].cpu_ms for s in steps),
            service_ms=statistics.median(services[i] for services in per_step),
            kind=steps[-1].buckets[i].kind,
            **_sparse_sizes([s.buckets[i] for s in steps]),
        )
        for i in range(count)
    )
    # Communication from each bucket's hand-over (its queue included) to its end, as the replay
    # counts it: the same start as exposed, so exposed never exceeds it.
    intervals = [[(b.ready_ms, b.end_ms) for b in s.buckets] for s in steps]
    comm = statistics.median(busy_ms(i) for i in intervals)
    hidden = statistics.median(busy_ms(i, until=s.backward_ms) for i, s in zip(intervals, steps))
    if k > 1:
        micro = statistics.median(m for s in steps for m in s.nosync_micro_ms)
        rest = step_ms - (k - 1) * micro - (forward + backward + exposed + optimizer)
        contention = max(0.0, min(backward, forward + backward + rest - micro))
        source = "measured: the synchronizing micro-batch minus a no_sync one"
    else:
        rest = step_ms - (forward + backward + exposed + optimizer)
        share = oversubscribed(run)
        contention = min(backward, share * median("sync_other_cpu_ms"))
        source = (f"estimated: {share:.0%} of the other threads' CPU time during backward "
                  f"({run.cpu_count} cores, {run.local_world_size} ranks here, "
                  f"{run.torch_threads} compute thread(s) and {run.concurrent_buckets} lanes each)")
    return RunProfile(
        world_size=run.world_size, algorithm=run.algorithm, lanes=run.concurrent_buckets,
        bucket_cap_bytes=run.bucket_cap_bytes, first_bucket_bytes=run.first_bucket_bytes,
        param_bytes=run.param_bytes, param_dtypes=run.param_dtypes, device=run.device,
        local_world_size=run.local_world_size,
        steps=len(steps), accumulate=k, step_ms=step_ms, forward_ms=forward, backward_ms=backward,
        exposed_ms=exposed, optimizer_ms=optimizer, rest_ms=rest, comm_ms=comm, hidden_ms=hidden,
        contention_ms=contention, contention_source=source, buckets=buckets,
        nosync_micro_ms=micro if k > 1 else None, nodes=run.nodes, ring=run.ring,
        options=run.options, probe=run.probe, probe_algorithm=run.probe_algorithm, param_sparse=run.param_sparse,
    )


def _sparse_sizes(buckets) -> dict:
    """A sparse bucket's ``nnz`` and sizes both ways, medians over the steps (the rows a batch
    touches vary); nothing for a dense one, or one from a timeline older than version 3."""
    sizes = {}
    for name in ("nnz", "sparse_bytes", "dense_bytes"):
        known = [getattr(b, name) for b in buckets if getattr(b, name) is not None]
        if known:
            sizes[name] = int(statistics.median(known))
    return sizes


def service_ms(spans: Sequence[tuple[float, float]]) -> list[float]:
    """Each bucket's own time on the link, from its ``(start, end)`` in launch order: the link
    serves buckets first come, first served (:mod:`.replay`), so bucket ``i`` holds it from its
    start, or from the end of the buckets before it when that is later, to its end. What the
    replay's bucket costs are fitted to: a bucket's span alone counts the time it waited for
    the other lane's bytes, which the replay adds again. A bucket that ended before the one
    ahead of it (their bytes interleaved) counts half its span."""
    services, link_free = [], float("-inf")
    for start, end in spans:
        services.append(end - max(start, link_free) if end > link_free else 0.5 * (end - start))
        link_free = max(link_free, end)
    return services


#: Measured steps (after step 1) the advisor needs: a median of one step is one disturbed step away from anything.
MIN_MEASURED = 2


def _one_run(run: TimelineRun, records: Sequence[TimelineRecord]) -> None:
    """Refuse a timeline that holds more than one run (files joined, or a log_dir reused by
    a run of another setting): its steps are not of one setting, and a world size read from the
    first run line would price the others' steps."""
    others = [(line, r) for line, r in enumerate(records[1:], 2) if isinstance(r, TimelineRun)]
    if not others:
        return
    line, other = others[0]
    differs = ("world size" if other.world_size != run.world_size else
               "setting" if (other.algorithm, other.bucket_cap_bytes) != (run.algorithm, run.bucket_cap_bytes) else None)
    what = (f"a run of {other.world_size} ranks ({other.algorithm}) after one of {run.world_size} ranks ({run.algorithm})"
            if differs == "world size" else f"a second run ({other.algorithm}, cap {other.bucket_cap_bytes} B; the "
            f"first: {run.algorithm}, cap {run.bucket_cap_bytes} B)")
    raise ValueError(
        f"this timeline mixes runs: record {line} starts {what}; the advisor reads one run: give each run its own "
        "log_dir (or keep the lines from one run line to the next)"
        + (" and advise on the one whose world size you want to start from" if differs == "world size" else "")
    )


def _measured(steps: list[TimelineStep]) -> list[TimelineStep]:
    """Steps after the first, with the usual bucket count."""
    later = steps[1:]
    if len(later) < MIN_MEASURED:
        raise ValueError(
            f"the timeline holds {len(steps)} optimizer step(s); the advisor needs at least {MIN_MEASURED + 1} (step 1 "
            f"runs DDP's provisional single bucket, and {MIN_MEASURED} measured steps make a median): train a few more steps"
        )
    usual = Counter(len(s.buckets) for s in later).most_common(1)[0][0]
    return [s for s in later if len(s.buckets) == usual]
