"""What telemetry records: one :class:`BucketRecord` per gradient bucket, one :class:`StepRecord`
per optimizer step (one DDP reduction), the bandwidth formulas they use, and the one protocol
by which every watcher hands its own records to the sinks (:class:`Record`).

**The watchers' records.** A watcher writes anything through one protocol: a :class:`Record`
has a ``step`` and up to three forms, and every sink takes the forms it knows and leaves the
rest (``Sink.write_record``), so a new watcher needs no new sink method::

    form                 TensorBoard          trace (comm_trace.json)     summary
    scalars()  tag->x    a scalar per tag     a counter track per tag     the latest value (summarized)
    texts()    tag->s    a text panel         -                           -
    trace_events()       -                    its events, in the window   -

:class:`Scalars` (numbers under tags, at a moment), :class:`Text` and :class:`Trace` are the
generic records; :class:`RankArrivals` and :class:`LinkTimes` are the arrivals' and the
per-link watcher's, the same protocol with their own tags and tracks.

Times are milliseconds. Bandwidths follow nccl-tests (``doc/PERFORMANCE.md``), in GB/s with
GB = 1e9 bytes, so the numbers compare directly with ``all_reduce_perf`` and NCCL's Inspector::

    algbw = bytes / time
    busbw = algbw * 2 (p - 1) / p        # all-reduce: every byte crosses 2(p-1)/p links
    busbw = wire_bytes / time            # a sparse bucket's gather: wire_bytes = (p - 1) x its bytes,
                                         # each crossing one link (nccl-tests' all-gather, equal shares)

One step on one rank, as the records see it (CPU: the buckets run on the communication
workers, up to ``concurrent_buckets`` at once, while backward goes on computing)::

    backward  |=========================================|
    bucket 0      h0 ..q.. [== rs ==|== ag ==]             h = handed to the hook
    bucket 1               h1 ....q.... [== rs ==|== ag ==] q = queue_ms, [..] = time_ms
                                                 ^ last bucket handed   ^ last bucket reduced
                                                 |<---- exposed_ms ---->|
              |<---------------------- comm_ms ------------------------>|
    comm_ms  = communication: the time at least one bucket was handed over and not yet reduced
               (each bucket from its hand-over to its end, queue included), the same start as
               exposed_ms, so exposed_ms <= comm_ms always
    total_ms = in flight: the time at least one bucket was transferring (the buckets' time_ms
               where they do not overlap: the sum when they run one after another; no queue)

One vocabulary for these words in the summary, TensorBoard, the trace and ``advise``: the
glossary of ``docs/telemetry.md``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from .trace_format import (
    ARRIVAL_TID, LINKS_PID, clock_event, counter_event, link_tid, slice_event, track_names,
)


def all_reduce_bus_factor(world_size: int) -> float:
    """nccl-tests' all-reduce factor ``2(p-1)/p``: 0 for one rank, 1 for two, toward 2 for many."""
    return 2.0 * (world_size - 1) / world_size


def busy_ms(intervals, *, until: float = float("inf")) -> float:
    """Length of the union of ``(start_ms, end_ms)`` intervals: time when at least one ran,
    counted up to ``until`` (the advisor's replay: what backward hides)."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, until)
        if end > start:
            busy += end - start
        reach = max(reach, end)
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
    ``wire_bytes`` is what the bucket's transfers carry (``wire``, their dtype: ``bfloat16``
    with ``wire_dtype="bf16"``); ``None`` in records made before it existed: ``nbytes``.
    ``algbw_GBps`` is the bucket's own bytes per second (what the training sees: bf16 on the
    wire doubles it), ``busbw_GBps`` the bytes that crossed the links (its wire bytes, times
    ``2(p-1)/p``): compare it with the links' rate. ``kind`` is how it was reduced
    (``dense``; ``sparse``: gathered, its ``nbytes`` its indices and values and ``nnz`` its stored
    entries, coalesced; ``densified``; ``foreign``: a user's own hook, ``runtime/wire.py``).
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
    wire_bytes: int | None = None
    wire: str = ""
    kind: str = "dense"
    nnz: int | None = None

    @property
    def bytes_on_wire(self) -> int:
        """The bytes its transfers carried (``nbytes`` when the record does not say)."""
        return self.nbytes if self.wire_bytes is None else self.wire_bytes

    @property
    def wire_ratio(self) -> float:
        """Bytes on the wire per byte of the bucket: 0.5 with bf16 on the wire of an fp32 bucket."""
        return self.bytes_on_wire / self.nbytes if self.nbytes else 1.0


@dataclass(frozen=True)
class StepRecord:
    """All buckets of one optimizer step on one rank, and what they add up to.

    ``total_ms`` is the time at least one bucket was in flight (:func:`busy_ms` of their
    intervals: the sum of their ``time_ms`` when they do not overlap; queues excluded);
    ``exposed_ms`` runs from the moment the last bucket was handed to the hook (backward has
    produced every gradient) to the moment the last bucket finished: the communication that
    backward could not hide; :attr:`comm_ms` (communication) counts from each bucket's
    hand-over, so it holds ``exposed_ms`` whole (``total_ms`` may not: the last bucket's queue
    is exposed but not in flight). ``dropped`` is how
    many step records the recorder had dropped (queue full) when this one was queued.
    What every rank did in the same step is a :class:`RankArrivals`, recorded separately
    (it is gathered across ranks after the step, off the training path).
    """

    step: int
    buckets: tuple[BucketRecord, ...]
    total_ms: float
    exposed_ms: float
    num_buckets: int
    rank: int = 0
    dropped: int = 0

    @property
    def comm_ms(self) -> float:
        """Communication: the time at least one bucket was handed over and not yet reduced
        (:func:`busy_ms` of each bucket's hand-over to its end, its queue included). It starts
        where ``exposed_ms`` starts, so it is never smaller (the last hand-over to the last end
        lies inside the bucket that ended last, handed over no later)."""
        spans = [(b.start_ms - b.queue_ms, b.start_ms + b.time_ms) for b in self.buckets]
        return busy_ms(spans)


class Record:
    """What a watcher hands the sinks (see the module docstring): a ``step`` (the optimizer
    step it belongs to) and up to three forms, each empty unless a record has it.
    ``summarized``: the summary shows the latest value of its scalars."""

    step: int
    summarized = False
    #: Trace events of other ranks, already on this rank's clock (rank 0's merged trace).
    merged_ranks: tuple[int, ...] = ()

    def scalars(self) -> Mapping[str, float]:
        """TensorBoard tags and their values at ``step``."""
        return {}

    def texts(self) -> Mapping[str, str]:
        """TensorBoard text panels (tag -> Markdown) at ``step``."""
        return {}

    def trace_events(self) -> list[dict]:
        """Chrome trace events on the recording rank's clock (``trace_format``)."""
        return []


def now_ms() -> float:
    """This process's monotonic clock in ms, the clock of every mark (``time.perf_counter``)."""
    return time.perf_counter() * 1e3


@dataclass(frozen=True)
class Scalars(Record):
    """Numbers under TensorBoard ``tags`` at optimizer ``step``, taken on ``rank`` at ``at_ms``
    (this process's clock): what a watcher writes. TensorBoard plots each tag, the trace shows
    a counter track per tag, the summary keeps the latest value of each."""

    step: int
    tags: Mapping[str, float]
    rank: int = 0
    at_ms: float = field(default_factory=now_ms)
    summarized = True

    def scalars(self) -> Mapping[str, float]:
        return self.tags

    def trace_events(self) -> list[dict]:
        return [counter_event(tag, self.rank, self.at_ms, float(value)) for tag, value in self.tags.items()]


@dataclass(frozen=True)
class Text(Record):
    """A TensorBoard text panel ``tag`` (Markdown) at ``step``: the advice, the stall report."""

    step: int
    tag: str
    text: str

    def texts(self) -> Mapping[str, str]:
        return {self.tag: self.text}


@dataclass(frozen=True)
class Trace(Record):
    """Trace events of ``step`` on this rank's clock (a watcher's, on a step whose numbers go
    to the trace only); ``merged_ranks``: the other ranks whose events these are, already moved
    onto this rank's clock (rank 0's merged trace)."""

    step: int
    events: tuple[dict, ...]
    merged_ranks: tuple[int, ...] = ()

    def trace_events(self) -> list[dict]:
        return list(self.events)


@dataclass(frozen=True)
class RankArrivals(Record):
    """When every rank of the group handed its buckets over in one step, on one time axis.

    A rank *arrives* when backward hands its last bucket to the hook: from then on it can only
    wait for the others, because no all-reduce finishes before its slowest contributor. So the
    rank that arrives last (:attr:`straggler`) holds everyone up, and what it costs is how
    long the others waited for it (:attr:`straggler_wait_ms`). The rank with the *longest*
    communication is the opposite: it is a victim, which waited longest::

        rank 0  backward ====|h0 . . . . h_last|wait for rank 2.........|reduce|
        rank 1  backward =======|h0 . . . h_last|wait for rank 2......|reduce|
        rank 2  backward (slow) ===============|h0 . . . . h_last|reduce|
                                                                ^ the straggler arrives

    Times are milliseconds on rank 0's monotonic clock (each rank's own reading minus
    ``offsets_ms[r]``, its clock's offset to rank 0's: exactly 0 on rank 0's host, which
    shares ``CLOCK_MONOTONIC``; estimated by ping-pong across hosts, to within
    ``clock_error_ms``). Tuples are indexed by group rank.

    ``first_ms`` / ``last_ms``: first and last bucket handed over; ``total_ms``: each rank's
    communication time in the step (``StepRecord.total_ms``; NaN where unknown: a CUDA event
    that did not complete in time).
    ``rank`` is the rank that recorded this copy (every rank gets the same numbers).
    """

    step: int
    first_ms: tuple[float, ...]
    last_ms: tuple[float, ...]
    total_ms: tuple[float, ...]
    offsets_ms: tuple[float, ...]
    clock_error_ms: float = 0.0
    rank: int = 0

    @property
    def world_size(self) -> int:
        return len(self.last_ms)

    @property
    def straggler(self) -> int:
        """The rank that arrived last (its last bucket was handed over last)."""
        return max(range(self.world_size), key=self.last_ms.__getitem__)

    @property
    def waits_ms(self) -> tuple[float, ...]:
        """How long each rank waited for the last one to arrive (0 for the straggler)."""
        latest = max(self.last_ms)
        return tuple(latest - arrival for arrival in self.last_ms)

    @property
    def straggler_wait_ms(self) -> float:
        """The median over the *other* ranks of their wait for the straggler (0 for one rank)."""
        straggler = self.straggler
        others = [wait for rank, wait in enumerate(self.waits_ms) if rank != straggler]
        return statistics.median(others) if others else 0.0

    @property
    def arrival_spread_ms(self) -> float:
        """Between the first and the last rank to arrive."""
        return max(self.last_ms) - min(self.last_ms)

    @property
    def total_ms_known(self) -> bool:
        return not any(math.isnan(total) for total in self.total_ms)

    # -- as a record (``comm/ranks/*``, the arrival track) ---------------------------------------

    def scalars(self) -> Mapping[str, float]:
        tags = {"comm/ranks/straggler_rank": self.straggler, "comm/ranks/straggler_wait_ms": self.straggler_wait_ms,
                "comm/ranks/arrival_spread_ms": self.arrival_spread_ms, "comm/ranks/clock_error_ms": self.clock_error_ms}
        if self.total_ms_known:
            totals = self.total_ms
            tags.update({"comm/ranks/total_ms_min": min(totals), "comm/ranks/total_ms_max": max(totals),
                         "comm/ranks/total_ms_spread": max(totals) - min(totals)})
        return tags

    def trace_events(self) -> list[dict]:
        """The recording rank's handing over and its wait for the straggler, back on its own
        clock, and how that clock relates to rank 0's."""
        pid, offset = self.rank, self.offsets_ms[self.rank]
        first, last = self.first_ms[pid] + offset, self.last_ms[pid] + offset
        args = {"step": self.step, "straggler": self.straggler, "clock_error_ms": self.clock_error_ms}
        events = [*track_names(pid, ARRIVAL_TID, f"rank {pid}", "arrival"),
                  slice_event(f"handing over step {self.step}", pid, ARRIVAL_TID, first, last - first, args),
                  clock_event(pid, offset, self.clock_error_ms)]
        wait = self.waits_ms[pid]
        if pid != self.straggler:
            events.append(slice_event(f"wait for rank {self.straggler} step {self.step}", pid, ARRIVAL_TID, last, wait,
                                      {**args, "wait_ms": wait}))
        return events


@dataclass(frozen=True)
class LinkSpan:
    """A time a directed link was busy in one step, as its receiver saw it (for the trace).

    From ``start_ms`` to ``end_ms`` (the receiver's clock) at least one of ``transfers``
    transfers from ``src`` to ``dst`` was moving with both ends ready: ``nbytes`` in all.
    ``waited_ms``: how long, summed over those transfers, the end that posted first waited for
    the other to post (a late peer's share: waiting, not the link's time).
    """

    src: int
    dst: int
    start_ms: float
    end_ms: float
    nbytes: int
    transfers: int
    waited_ms: float


@dataclass(frozen=True)
class LinkTimes(Record):
    """Every directed link of the group in one step, timed from the hook's own transfers.

    ``links[(src, dst)]`` is ``(nbytes, busy_ms)``: the bytes the step's schedules moved from
    ``src`` to ``dst`` and how long at least one of those transfers was moving once both ends
    had posted it (every rank's links, the same on every rank). ``spans``: the recording
    rank's incoming links as :class:`LinkSpan` s, on its own clock. ``verdict``: the naming
    rule (a :class:`ddp_ring_hooks.links.LinkVerdict`) over the links' recent steps, and
    ``summary`` its line. ``rank``: the rank that recorded this copy.
    """

    step: int
    links: dict[tuple[int, int], tuple[int, float]]
    spans: tuple[LinkSpan, ...]
    verdict: object
    summary: str
    rank: int = 0

    def bandwidth_Bps(self, link: tuple[int, int]) -> float:
        """``link``'s bytes per second in this step (0 when nothing moved or no time was measured)."""
        nbytes, busy = self.links.get(link, (0, 0.0))
        return nbytes / (busy * 1e-3) if busy > 0 else 0.0

    # -- as a record (``comm/links/*``, a track per directed link) -------------------------------

    def scalars(self) -> Mapping[str, float]:
        """The naming rule's, over the links' recent steps: the slowest link's ends and MB/s
        (1e6 bytes/s), the median of all links, the rank whose network is slow (-1: none)."""
        verdict = self.verdict
        if verdict is None or verdict.slowest is None:  # nothing measured yet
            return {}
        src, dst = verdict.slowest
        return {"comm/links/slowest_src": src, "comm/links/slowest_dst": dst,
                "comm/links/slowest_MBps": verdict.bandwidths[(src, dst)] / 1e6,
                "comm/links/median_MBps": verdict.median_Bps / 1e6, "comm/links/slow_nic_rank": verdict.slow_nic_rank}

    def trace_events(self) -> list[dict]:
        """The recording rank's incoming links, one track each in a ``links`` process, a slice
        per busy span (its clock)."""
        events: list[dict] = []
        for span in self.spans:
            tid = link_tid(span.src, span.dst)
            events += track_names(LINKS_PID, tid, "links", f"link {span.src}→{span.dst}")
            duration_ms = span.end_ms - span.start_ms
            events.append(slice_event(f"{span.src}→{span.dst}", LINKS_PID, tid, span.start_ms, duration_ms, {
                "step": self.step, "bytes": span.nbytes, "transfers": span.transfers,
                "MBps": span.nbytes / (duration_ms * 1e3) if duration_ms > 0 else 0.0, "waited_ms": span.waited_ms}))
        return events
