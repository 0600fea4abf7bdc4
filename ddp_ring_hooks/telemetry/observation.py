"""``Observation``: every watcher of a hook state's buckets, in one place.

A hook state has one observation, and hands each bucket to it once, as DDP hands the bucket
over (:meth:`Observation.hand_over`). The observation takes the bucket's marks once, from one
timer pool (one clock anchor per GPU), under the hook state's step number, and shows the
bucket to its watchers (:class:`~.watcher.Watcher`), in this order:

1. the per-bucket recorder (:class:`~.recorder.Telemetry`): TensorBoard, trace, summary;
2. the advisor's timeline (:class:`~.timeline.Timeline`): compute around the buckets;
3. the arrivals gather (:class:`~.arrivals.ArrivalGather`): who arrived last, after the step;
4. per-link timing (:class:`~.link_timing.LinkTiming`, ``links=True``): which link is slow,
   after the step;
5. the trace gather (:class:`~.arrivals.TraceGather`): every rank's trace events to rank 0 at
   the window's last step, after the others' (so theirs are in);
6. the stall watchdog (:class:`~.stall.StallWatchdog`): who everyone waits for, the timeout;
7. the profiler's ranges (:class:`~.profiling.ProfilerRanges`), while a profiler runs;

then to the user's own observers (``HookState(observers=...)``). One options object
(:class:`~.options.TelemetryOptions`) configures them all; one pickling rule (the options
survive, threads, files and marks do not); one :meth:`summary` (the recorder's table, then
every watcher's line); one :meth:`close`. The watchers after the recorder are the table
:data:`WATCHERS`: adding one is an entry there.

Cost when nothing records: one clock mark and three small objects per bucket (on CUDA the mark
is the event the communication stream waits for anyway), and the watchdog's timestamp per
transfer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..runtime.observer import ExecutionObserver
from ..runtime.wire import DENSE, SPARSE, BucketBytes, bucket_bytes
from .arrivals import ArrivalGather, TraceGather
from .exchange import StepExchange
from .link_timing import LinkTiming
from .options import TelemetryOptions, collect_telemetry_options
from .profiling import ProfilerRanges
from .recorder import Telemetry
from .records import Text
from .sinks import ADVICE_TAG, advice_panel
from .stall import StallWatchdog, check_stall_timeout
from .timeline import Timeline
from .timer import DeviceTimers
from .watcher import BucketWatch, StepWatch, Watcher


class WatcherEntry(NamedTuple):
    """One watcher of the table: its name (``Observation.by_name``) and how it is made from the
    options and the recorder it writes through."""

    name: str
    make: Callable[[TelemetryOptions, Telemetry], Watcher]


#: Every watcher after the recorder, in the order each bucket is shown to them (see the module
#: docstring). Adding a watcher is one entry here (and its option a TelemetryOptions field).
WATCHERS: tuple[WatcherEntry, ...] = (
    WatcherEntry("timeline", lambda options, recorder: Timeline(log_dir=options.log_dir)),
    WatcherEntry("arrivals", lambda options, recorder: ArrivalGather(recorder)),
    WatcherEntry("link_timing", lambda options, recorder: LinkTiming(recorder)),
    WatcherEntry("trace_gather", lambda options, recorder: TraceGather(recorder)),
    WatcherEntry("stall", StallWatchdog),
    WatcherEntry("profiler_ranges", lambda options, recorder: ProfilerRanges()),
)

#: A summary waits at most this long for the exchanges of the steps already taken (a peer that
#: stopped answering must not hold up a summary for the group's timeout).
SETTLE_S = 10.0


class Observation:
    """Every watcher of one hook state's buckets (see the module docstring).

    Args:
        telemetry: a :class:`~.options.TelemetryOptions`, or a ready
            :class:`~.recorder.Telemetry` to record into (its options configure every watcher);
            or ``None`` and the options as ``fields``. An option given both ways is a
            ``ValueError`` naming it.
        observers: more :class:`~ddp_ring_hooks.runtime.ExecutionObserver` s, shown every
            bucket's all-reduce after the watchers.
        advice: turns the timeline's records into the text of the ``comm/advice`` panel,
            written when the observation closes (the hook state passes the advisor's; a
            module-level function: it is pickled by name).
        **fields: :class:`~.options.TelemetryOptions` fields.
    """

    def __init__(
        self,
        telemetry: TelemetryOptions | Telemetry | None = None,
        *,
        observers: tuple[ExecutionObserver, ...] = (),
        advice: Callable[[list], str] | None = None,
        **fields,
    ) -> None:
        recorder = telemetry if isinstance(telemetry, Telemetry) else None
        self.options = collect_telemetry_options(recorder.options if recorder else telemetry, fields)
        self.observers = tuple(observers)
        self.advice = advice
        self._start(recorder or Telemetry(self.options))

    def _start(self, recorder: Telemetry) -> None:
        self.recorder = recorder
        #: The watchers of the table by name (:data:`WATCHERS`).
        self.by_name: dict[str, Watcher] = {entry.name: entry.make(self.options, recorder) for entry in WATCHERS}
        self.timeline: Timeline = self.by_name["timeline"]
        self.by_name["arrivals"].timeline = self.timeline  # the spread steps' arrivals, for the advisor
        self.watchdog: StallWatchdog = self.by_name["stall"]
        self.watchers: tuple[Watcher, ...] = (recorder, *self.by_name.values())
        self._timers = DeviceTimers()  # the one timer pool: one CUDA clock anchor per GPU
        self._exchange = StepExchange(recorder.cadence, record=recorder.record)
        self._open: StepWatch | None = None  # the step whose buckets are being handed over
        self._exchangers: tuple[Watcher, ...] = ()  # the watchers that exchange after it
        self._ranks: tuple[int, int] | None = None  # (rank, world size) in the hook's group
        self._lock = threading.Lock()  # step bookkeeping: buckets finish on several threads

    def check_group(self, group) -> None:
        """The options that depend on the hook's group, checked when the state is built (a
        ``stall_timeout`` its own timeout would beat)."""
        check_stall_timeout(self.options, group)

    # -- the hook thread ---------------------------------------------------------------------

    def attach(self, ddp_model, *, algorithm: str, concurrent_buckets: int, group, run_facts=None) -> None:
        """The hook was registered on ``ddp_model``: watchers that watch the model start.
        ``run_facts``: what the hook state knows of the run that the timeline records (the
        ranks' ``nodes``, the ``ring`` order)."""
        self.timeline.run_facts = dict(run_facts or {})
        for watcher in self.watchers:
            watcher.attach(ddp_model, algorithm=algorithm, concurrent_buckets=concurrent_buckets, group=group)

    def hand_over(
        self, buffer: torch.Tensor, *, step: int, index: int, is_last: bool, algorithm: str, group,
        size: BucketBytes | None = None, entered: float | None = None,
    ) -> BucketWatch:
        """DDP handed bucket ``index`` of optimizer ``step`` over, and the hook checked it and
        chose its ``algorithm`` (call it on the hook thread, in DDP's order, right before the
        launch): its hand-over mark, and the watch to pass to the executor as its observer
        (then tell it the Future: :meth:`BucketWatch.launched`). ``size``: its bytes and its
        bytes on the wire (default: as the buffer is; a sparse one as gathered). ``entered``:
        when the hook was called (``time.perf_counter()``), for the bucket's ``call_ms``."""
        timer = self._timers.for_buffer(buffer)
        handed = timer.mark()  # first: "handed over" starts queue_ms, exposed_ms, the arrival
        cadence = self.recorder.cadence
        began = time.thread_time() if cadence.auto else 0.0  # a marked step's watchers are priced
        opened = self._open
        if opened is None or opened.step != step:
            opened = self._open = self._open_step(step, group)
            self._exchangers = tuple(watcher for watcher in self.watchers if watcher.exchanges_after(step))
            opened.exchanged = bool(self._exchangers)
        bucket = BucketWatch(self, opened, timer, handed, buffer, index=index, is_last=is_last, algorithm=algorithm,
                             entered=entered, size=size or bucket_bytes(buffer, None, kind=SPARSE if buffer.is_sparse else DENSE,
                                                       world_size=opened.world_size))
        seen = tuple(watcher.on_bucket(bucket) for watcher in self.watchers)
        bucket.watched_by(seen, (*(observer for observer in seen if observer is not None), *self.observers))
        if opened.marked:
            with self._lock:
                opened.buckets.append(bucket)
                opened.last_handed = is_last
            if cadence.auto:
                cadence.charge((time.thread_time() - began) * 1e3)
        return bucket

    def _open_step(self, step: int, group) -> StepWatch:
        if self._ranks is None:  # the hook's group does not change
            initialized = dist.is_available() and dist.is_initialized()
            self._ranks = (dist.get_rank(group), dist.get_world_size(group)) if initialized else (0, 1)
        rank, world_size = self._ranks
        self.recorder.cadence.started(time.perf_counter())  # the step times "auto" weighs the cost against
        return StepWatch(
            step, rank=rank, world_size=world_size, group=group,
            marked=any([watcher.wants_marks(step) for watcher in self.watchers]),  # every one is asked
        )

    def launched(self, bucket: BucketWatch, future: torch.futures.Future) -> torch.futures.Future:
        """``future`` will complete ``bucket``: every watcher may put a Future of its own in its
        place (in order; each is given the observer it returned for the bucket); the last one is
        DDP's. After a step's last bucket, queue its exchange."""
        for watcher, observer in zip(self.watchers, bucket.seen):
            future = watcher.launched(bucket, future, observer)
        bucket.future = future
        step = self._open
        if step is not None and step.step == bucket.step and step.exchanged:
            step.futures.append(future)
            if bucket.is_last:
                self._exchange.submit(step, self._exchangers)
        return future

    def summary(self) -> str:
        """The recorder's table (:meth:`~.recorder.Telemetry.summary`), then every watcher's
        line (:meth:`~.watcher.Watcher.summary_line`: stragglers, links, ...). The exchanges of
        the steps already taken finish first (at most :data:`SETTLE_S`): their lines hold them."""
        running = self._exchange.settle(SETTLE_S)
        text = self.recorder.summary()
        if not self.recorder.watched:
            return text  # nothing watched: the table says how to ask for it
        lines = [watcher.summary_line() for watcher in self.watchers[1:]]
        if running:
            lines.append(f"({running} gathered steps' exchanges across ranks still running after {SETTLE_S:.0f} s: "
                         "the lines above do not hold them yet)")
        return "\n".join([text, *(line for line in lines if line)])

    def stall_report(self) -> str | None:
        """The stall watchdog's latest finding while a bucket waits too long (who is stalled)."""
        return self.watchdog.report()

    # -- the bucket's thread ---------------------------------------------------------------

    def bucket_finished(self, bucket: BucketWatch, step: StepWatch) -> None:
        """Called by ``bucket`` when its all-reduce finished (on CUDA: enqueued)."""
        if not step.marked:
            bucket.timer.release([bucket.handed])  # nobody reads it; a CUDA event is reused
            return
        with self._lock:
            step.finished += 1
            if not step.done:
                return
        for watcher in self.watchers:
            watcher.on_step_done(step)

    # -- closing -----------------------------------------------------------------------------

    def close(self) -> None:
        """Write the advice panel (the group's rank 0, with a ``log_dir``), then close every
        watcher in order: the timeline's file, the recorder's sinks. Safe to call twice."""
        if self.advice is not None and self.timeline.writes_advice:
            try:
                text = self.advice(self.timeline.records())
            except ValueError as error:  # too few steps, nothing measured: say why
                text = f"no advice: {error}"
            self.recorder.record(Text(0, ADVICE_TAG, advice_panel(text)), group=self.timeline.group)
        for watcher in self.watchers:
            watcher.close()

    # -- pickling: the options survive; watchers, threads, files and marks are made anew ------

    def __getstate__(self) -> dict:
        return {"options": self.options, "advice": self.advice}

    def __setstate__(self, state: dict) -> None:
        self.options, self.advice = state["options"], state["advice"]
        self.observers = ()
        self._start(Telemetry(self.options))
