"""Which link is slow, during training: every transfer of the hook's schedules, timed on both ends.

A watcher (:class:`~.watcher.Watcher`), on with ``links=True``, on the steps that gather across
ranks (``spread_every=N``, the trace window). The hook already knows, for every transfer, the
peer, the bytes and when its end was ready; what one end cannot know is when the other was::

    comm thread      each unit of a schedule step (runtime/executor.py, through this watcher's
                     observer): a mark as it is posted, a mark as each receive lands
    exchange worker  after the step, on every rank:
      1. the marks, read once, put on rank 0's clock (``peers.clocks``)
      2. each rank sends every peer it sent to the post marks of those sends (Peers.trade:
         point-to-point, only the pairs that talked); the k-th send from s to d is the k-th
         receive at d from s, bucket by bucket
      3. each receiver times its incoming links: a transfer took
             [max(sender posted, receiver posted), received]
         so a late peer's delay is waiting, not the link's time; a link's busy time is the
         union of its transfers' (slices in flight overlap), its bandwidth bytes / busy time
      4. every rank's incoming links to every rank, with each rank's node: a row in the step's
         one gather (:mod:`.exchange`), beside the arrivals'; no gather of its own
      5. the naming rule (:func:`ddp_ring_hooks.links.judge_samples`: each link's median over
         its last :data:`~ddp_ring_hooks.links.WINDOW` steps against the others, by tier; a link
         is named once it has :data:`~ddp_ring_hooks.links.MIN_TRAINING_SAMPLES` steps)
         -> a :class:`~.records.LinkTimes` record (``comm/links/*``, the trace's link tracks;
         on a trace step only, its tracks alone) and the summary's line

A link that moved less than :data:`MIN_JUDGED_BYTES` in a step is not judged on that step:
its time is mostly latency. ``native`` (the group's own all-reduce) shows no transfers: every
:data:`~.native_probe.PROBE_EVERY`-th timed step a probe between ring neighbours takes their
place in steps 2.-5. (:mod:`.native_probe`), and the summary line says the links it names were
seen by the probe (``links (probe): ...``). On CUDA the marks are events on the
communication side stream from the recorder's timer pool, read once they completed (never a
host sync); NCCL runs a unit's sends and receives as one batch, so its receives land together:
a unit's slowest transfer sets the time of all its receives (written from PyTorch's stream
rules, not yet run on GPUs).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
import weakref
from collections import defaultdict, deque

import torch.distributed as dist

from ..links import MIN_TRAINING_SAMPLES, WINDOW, LinkSample, judge_samples
from ..runtime import ExecutionObserver
from ..runtime.group_context import context_of
from ..runtime.link_probe import node_row, nodes_of
from ..runtime.names import NATIVE
from .native_probe import PROBE_EVERY, probe_ring
from .records import LinkSpan, LinkTimes, Trace
from .watcher import READ_TIMEOUT_S, Watcher

#: A link that moved fewer bytes than this in a step is not judged on it (latency, not bandwidth).
MIN_JUDGED_BYTES = 256 << 10
#: The summary line before any step's links were timed.
NOT_YET_LINE = "links: no step's links timed yet (links=True times them on every spread_every-th step)"
#: The summary line when every bucket ran ``native``.
NATIVE_LINE = ("links: no per-link view: native runs the group's own all-reduce, whose transfers the hook "
               "cannot see (choose a scheduled algorithm, e.g. ring)")


class LinkTiming(Watcher):
    """Every directed link's transfer times and the slow one named, for the recorder
    ``recorder`` (a :class:`~.recorder.Telemetry`; see the module docstring)."""

    def __init__(self, recorder) -> None:
        self.recorder = recorder
        # BucketWatch -> _TransferLog; weak: a step whose exchange never runs takes its logs along.
        self._logs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()  # the hook thread adds logs while the exchange worker takes them
        self._recent: dict[tuple[int, int], deque[LinkSample]] = {}
        self._native_only = True  # every bucket timed so far ran native
        self._line = NOT_YET_LINE  # the summary's (replaced whole by the exchange worker)
        self._spans: tuple[LinkSpan, ...] = ()  # this rank's incoming links of the step being shared
        self._native_shares = 0  # steps shared while every bucket ran native: every PROBE_EVERY-th probes
        self._probed = False  # a probe's links are in the verdict (the summary says "probe")

    def _times(self, step: int) -> bool:
        return self.recorder.options.links and self.recorder.gathers_ranks(step)

    def wants_marks(self, step: int) -> bool:
        return self._times(step)  # a marked step lists its buckets, which the exchange reads

    def on_bucket(self, bucket) -> ExecutionObserver | None:
        if not self._times(bucket.step):
            return None
        self._native_only &= bucket.algorithm == NATIVE
        log = _TransferLog(bucket.timer)
        with self._lock:
            self._logs[bucket] = log
        return log

    def exchanges_after(self, step: int) -> bool:
        return self._times(step)

    def share(self, step, peers) -> list[float]:
        offset = peers.clocks.offsets_ms[peers.rank]
        posts_to: dict[int, list[float]] = defaultdict(list)  # peer -> my sends' post marks, in order
        arrivals: dict[int, list[tuple[float, float, int]]] = defaultdict(list)  # peer -> (posted, received, bytes)
        with self._lock:
            logs = [self._logs.pop(bucket, None) for bucket in step.buckets]
        for log in logs:  # 1.
            for posted, sends, receives, received in log.read(offset) if log is not None else ():
                for peer, _ in sends:
                    posts_to[peer].append(posted)
                for (peer, nbytes), landed in zip(receives, received):
                    arrivals[peer].append((posted, landed, nbytes))
        if self._native_only and peers.world_size > 1:
            self._probe(step, peers, offset, posts_to, arrivals)
        their_posts = peers.trade(posts_to, {peer: len(mine) for peer, mine in arrivals.items()})  # 2.
        row = [0.0] * (2 * peers.world_size)
        spans: list[LinkSpan] = []
        for src, mine in arrivals.items():  # 3.
            nbytes, busy, link_spans = _time_link(src, peers.rank, mine, their_posts[src], offset)
            row[2 * src], row[2 * src + 1] = nbytes, busy
            spans += link_spans
        self._spans = tuple(spans)
        return [*row, *node_row(dist.get_rank())]  # 4. in the step's one gather

    def _probe(self, step, peers, offset: float, posts_to, arrivals) -> None:
        """Under ``native``, every PROBE_EVERY-th timed step: the probe's marks join the trade
        and the timing as a transfer of the hook's would (:mod:`.native_probe`)."""
        self._native_shares += 1
        if (self._native_shares - 1) % PROBE_EVERY:
            return
        marks = probe_ring(context_of(step.group).probe_group(), rank=peers.rank, world_size=peers.world_size)
        posts_to[marks.successor].append(marks.sent_ms - offset)
        arrivals[marks.predecessor].append((marks.posted_ms - offset, marks.received_ms - offset, marks.nbytes))
        peers.charge(marks.took_ms)  # its time on the links counts in what a gathered step costs
        self._probed = True

    def shared(self, step, peers, rows) -> None:
        links = {(src, dst): (int(r[2 * src]), r[2 * src + 1]) for dst, r in enumerate(rows)
                 for src in range(peers.world_size) if r[2 * src] > 0}
        nodes, _ = nodes_of([r[-2:] for r in rows])
        for (src, dst), (nbytes, busy) in links.items():  # 5.
            if nbytes >= MIN_JUDGED_BYTES and busy > 0:
                self._recent.setdefault((src, dst), deque(maxlen=WINDOW)).append(LinkSample(src, dst, nbytes, busy * 1e-3))
        verdict = judge_samples(itertools.chain(*self._recent.values()), world_size=peers.world_size, nodes=nodes,
                                min_samples=MIN_TRAINING_SAMPLES)
        if self._native_only and not self._recent:
            summary = NATIVE_LINE if not self._probed else NOT_YET_LINE
        else:
            summary = verdict.summary_line(per="steps")
            if self._native_only:  # what the probe saw, not training's traffic
                summary = summary.replace("links:", "links (probe):", 1)
        self._line = summary
        record = LinkTimes(step=step.step, links=links, spans=self._spans, verdict=verdict, summary=summary,
                           rank=peers.rank)
        if self.recorder.spreads_at(step.step):
            self.recorder.record(record, group=step.group)
        elif record.spans:  # a trace step only: its link tracks, no scalars
            self.recorder.record(Trace(step.step, tuple(record.trace_events())), group=step.group)

    def summary_line(self) -> str | None:
        """With ``links=True``: which link or network is slow, over the recent steps."""
        return self._line if self.recorder.options.links else None


def _time_link(src: int, dst: int, mine, their_posts, offset: float) -> tuple[int, float, list[LinkSpan]]:
    """The link ``src``→``dst`` in one step, from its receiver's ``(posted, received, bytes)``
    and the sender's post marks (rank 0's clock): its bytes, busy ms, and busy spans on the
    receiver's clock (``offset``: its clock minus rank 0's)."""
    transfers = sorted(
        (max(sent, posted), max(received, sent, posted), nbytes, abs(sent - posted))
        for (posted, received, nbytes), sent in zip(mine, their_posts)
        if not math.isnan(sent + posted + received)  # a CUDA mark that never completed
    )
    spans: list[list] = []  # [start, end, bytes, transfers, waited], the union of the transfers
    for start, end, nbytes, waited in transfers:
        if spans and start <= spans[-1][1]:
            last = spans[-1]
            last[1], last[2], last[3], last[4] = max(last[1], end), last[2] + nbytes, last[3] + 1, last[4] + waited
        else:
            spans.append([start, end, nbytes, 1, waited])
    return (
        sum(span[2] for span in spans), sum(span[1] - span[0] for span in spans),
        [LinkSpan(src, dst, start + offset, end + offset, nbytes, count, waited)
         for start, end, nbytes, count, waited in spans],
    )


class _TransferLog(ExecutionObserver):
    """One bucket's transfers, as the executor reports them: per unit, its post mark, its
    sends and receives ``(peer, bytes)`` and each receive's landing mark (the bucket's timer)."""

    def __init__(self, timer) -> None:
        self.timer = timer
        self.transfer_clock = timer.mark
        self.units: list[tuple] = []

    def on_transfers(self, index, posted, sends, receives, received) -> None:
        self.units.append((posted, sends, receives, received))

    def read(self, offset: float) -> list[tuple]:
        """The units with their marks in ms on rank 0's clock (``offset``: this rank's clock
        minus rank 0's), read once; NaN for a CUDA mark that did not complete in time."""
        timer, deadline = self.timer, time.monotonic() + READ_TIMEOUT_S
        marks = [mark for posted, _, _, received in self.units for mark in (posted, *received)]
        ready = all(timer.wait_ready(mark, deadline) for mark in marks)

        def ms(mark) -> float:
            return timer.clock_ms(mark) - offset if ready else math.nan

        units = [(ms(posted), sends, receives, [ms(mark) for mark in received])
                 for posted, sends, receives, received in self.units]
        if ready:  # CUDA events go back to be reused (never one still pending)
            timer.release(marks)
        return units
