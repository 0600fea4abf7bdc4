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

    clean micro-batch = forward + (backward - contention - hooks) + rest

- ``hooks``: the hook's own time on DDP's thread (the autograd thread), once per bucket handed
  over before the last one (``call_ms``, timeline version 6): backward waits for it, and only
  the synchronizing micro-batch calls the hook. Another bucket count costs backward as many
  hook calls.
- ``arrival_lateness``: how far the ranks' last hand-overs scatter, on the steps that gathered
  them (:mod:`.latest_rank`): what a larger world waits for.

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

from ..schedules import BOTH, wire_of
from ..telemetry.records import busy_ms
from ..telemetry.timeline_records import TimelineArrivals, TimelineRecord, TimelineRun, TimelineStep
from .latest_rank import arrival_lateness
from .link_directions import BOTH_WAYS, HOLDS, Directions, link_directions


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
    #: The link's busy time per step (the sum of the buckets' own times on it, :func:`service_ms`):
    #: the fastest, median and slowest over the measured steps (``None``: not measured).
    link_busy_ms: tuple[float, float, float] | None = None
    #: Whether DDP expected each parameter's gradient sparse (a bucket of its own), as the run
    #: recorded it (``None``: a timeline from before version 4).
    param_sparse: tuple[bool, ...] | None = None
    #: The hook's own time per bucket on DDP's thread (the median over the measured buckets; 0
    #: before timeline version 6): what each bucket handed over costs backward.
    call_ms: float = 0.0
    #: From a bucket's hand-over to its start when its lane was free (:func:`pickup_ms`): the
    #: worker's wake-up, which the replay adds to every bucket's start.
    pickup_ms: float = 0.0
    #: one rank's lateness at its last hand-over, as draws (ms, sorted; :func:`~.latest_rank.arrival_lateness`):
    #: ``None`` when the run gathered too few steps' arrivals (no ``spread_every``, ``diagnose``)
    arrival_lateness: tuple[float, ...] | None = None

    @property
    def calls_ms(self) -> float:
        """The hook time backward waits for in the synchronizing micro-batch: every bucket
        handed over before the last one (:func:`calls_ms`)."""
        return calls_ms(self.call_ms, len(self.buckets))

    @property
    def one_host(self) -> bool:
        """Whether every rank ran on one host (loopback: no wire between them, the same cores
        send and receive): the nodes the run recorded, else its ranks per node."""
        return on_one_host(self.nodes, self.local_world_size, self.world_size)

    @property
    def wire(self) -> str | None:
        """The wire dtype the run's buckets travelled in (``None``: not recorded)."""
        return None if self.options is None else wire_of(self.options)

    @property
    def clean_micro_ms(self) -> float:
        """One micro-batch without communication: a measured ``no_sync`` micro-batch, or at
        k = 1 forward plus backward without its contention and the hook's calls."""
        if self.nosync_micro_ms is not None:
            return self.nosync_micro_ms
        return self.forward_ms + self.backward_ms - self.contention_ms - self.calls_ms

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
        return run_environment(self.local_world_size)

    @property
    def bucket_cap_mb(self) -> float:
        return self.bucket_cap_bytes / (1 << 20)

    @property
    def default_bucket_cap(self) -> bool:
        """Whether DDP ran with its default cap (25 MiB with a small first bucket)."""
        return self.first_bucket_bytes < self.bucket_cap_bytes


def calls_ms(call_ms: float, buckets: int) -> float:
    """The hook time backward waits for with ``buckets`` buckets of ``call_ms`` each: every one
    handed over before the last (the last one's hand-over ends backward)."""
    return call_ms * max(0, buckets - 1)


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
    ways = [_link_directions(run, b) for b in steps[-1].buckets]
    per_step = [service_ms([(b.start_ms, b.end_ms) for b in s.buckets], ways) for s in steps]
    busy = sorted(sum(services) for services in per_step)
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
    call = statistics.median(b.call_ms for s in steps for b in s.buckets)  # the hook's, per bucket
    if k > 1:
        micro = statistics.median(m for s in steps for m in s.nosync_micro_ms)
        rest = step_ms - (k - 1) * micro - (forward + backward + exposed + optimizer)
        # the hook's calls are the synchronizing micro-batch's too, and not contention
        contention = max(0.0, min(backward, forward + backward + rest - micro - calls_ms(call, count)))
        source = "measured: the synchronizing micro-batch minus a no_sync one and the hook's calls"
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
        link_busy_ms=(busy[0], statistics.median(busy), busy[-1]), call_ms=call,
        pickup_ms=pickup_ms(steps, run.concurrent_buckets),
        arrival_lateness=arrival_lateness([r for r in records if isinstance(r, TimelineArrivals)], run.world_size,
                                          first_step=steps[0].step),
    )


def pickup_ms(steps: Sequence[TimelineStep], lanes: int) -> float:
    """The median wait from a bucket's hand-over to its start over the buckets whose lane was
    free when it was handed over (the first ``lanes`` of a step, and any whose lane's bucket
    before had ended): the worker's wake-up, not a queue. 0.30-0.37 ms on loopback's shared cores,
    2.6-4.9 ms on the lab's hosts of a fifth of a core (``docs/advisor.md``, the tenth series)."""
    waits = [max(0.0, b.start_ms - b.ready_ms) for s in steps for i, b in enumerate(s.buckets)
             if i < lanes or s.buckets[i - lanes].end_ms <= b.ready_ms]
    return statistics.median(waits) if waits else 0.0


def _sparse_sizes(buckets) -> dict:
    """A sparse bucket's ``nnz`` and sizes both ways, medians over the steps (the rows a batch
    touches vary); nothing for a dense one, or one from a timeline older than version 3."""
    sizes = {}
    for name in ("nnz", "sparse_bytes", "dense_bytes"):
        known = [getattr(b, name) for b in buckets if getattr(b, name) is not None]
        if known:
            sizes[name] = int(statistics.median(known))
    return sizes


def service_ms(spans: Sequence[tuple[float, float]], directions: Sequence[Directions] | None = None) -> list[float]:
    """Each bucket's own time on the link, from its ``(start, end)`` in launch order and the
    parts of the link's two ways it holds (``directions[i]``; default both ways, a ring's): each
    way serves buckets first come, first served (:mod:`.replay`), so bucket ``i`` holds the link
    from its start, or from when the buckets before it freed the ways its first part holds when
    that is later, to its end. For rings that is the end of the bucket before; for trees (in,
    then out) the end of the earlier bucket's reduce, since its broadcast goes out while the
    next reduce comes in. What the replay's bucket costs are fitted to: a bucket's span alone
    counts the time it waited for the other lane's bytes, which the replay adds again. A bucket
    that ended before those ways were free (their bytes interleaved) counts half its span."""
    services = []
    free = dict.fromkeys(HOLDS[BOTH], float("-inf"))
    for index, (start, end) in enumerate(spans):
        ways = directions[index] if directions else BOTH_WAYS
        first_free = max(free[way] for way in HOLDS[ways[0][0]])
        service = end - max(start, first_free) if end > first_free else 0.5 * (end - start)
        services.append(service)
        # Each way is free from the end of the last part that holds it (the parts after it run beside).
        later, settled = 0.0, set()
        for part, share in reversed(ways):
            for way in set(HOLDS[part]) - settled:
                free[way] = max(free[way], end - later * service)
                settled.add(way)
            later += share
    return services


def _link_directions(run: TimelineRun, bucket) -> Directions:
    """The link parts a run's bucket held: its algorithm's (a densified sparse bucket's, on the
    dense table its ``nbytes`` count), both ways for a gathered one (ring all-gathers) and a
    foreign hook's (unknown), and every bucket's on one host (the two ways are one resource
    there: :func:`~.replay.replay`'s ``shared_ways``). Options as the run resolved them (its
    ``LOCAL_WORLD_SIZE``)."""
    if bucket.kind not in ("dense", "densified") or on_one_host(run.nodes, run.local_world_size, run.world_size):
        return BOTH_WAYS
    return link_directions(run.algorithm, run.world_size, nbytes=bucket.nbytes,
                           environment=run_environment(run.local_world_size), **dict(run.options or ()))


def on_one_host(nodes: Sequence[int] | None, local_world_size: int, world_size: int) -> bool:
    """Whether a run's ranks were all on one host: its recorded nodes, else its ranks per node."""
    return len(set(nodes)) == 1 if nodes else local_world_size >= world_size


def run_environment(local_world_size: int) -> dict[str, str]:
    """The environment variables algorithm options default to, as a run recorded them."""
    return {"LOCAL_WORLD_SIZE": str(local_world_size)}


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
