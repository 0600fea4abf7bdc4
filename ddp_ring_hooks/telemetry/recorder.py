"""``Telemetry``: per-bucket observers on the hot path, records and sinks off it.

The path of one step's numbers::

    hook thread          worker / stream           writer thread (daemon)        sinks
    observe_bucket() --> on_phase / on_finish --> queue (bounded) --> resolve --> TensorBoard
    (mark: handed)       (marks: phases, end)     full? drop + count   marks->ms   trace, summary

1. When DDP hands a bucket to the hook, :meth:`Telemetry.observe_bucket` takes a mark
   (``handed``) and returns a :class:`BucketObserver` that the executor calls as it runs:
   a mark at each phase (the first phase starts the communication), one at the end.
2. When the step's last bucket finishes, its raw marks go into a bounded queue with one
   non-blocking ``put``. If the queue is full the step is dropped and counted: the training
   loop never waits for a disk, and memory stays flat however long the run.
3. A writer thread turns marks into a :class:`~.records.StepRecord` (on CUDA it first polls
   ``event.query()`` until the events are complete; it never synchronizes) and hands the
   record to the sinks whose steps it belongs to.

Only steps that something wants are observed (``log_every``, the trace window, spread
steps); other steps cost one integer comparison. The hook group's rank 0 writes files by
default (to ``log_dir/group_0-3``, named by its ranks, for a group that is not every rank:
:func:`.options.group_log_dir`); with
``per_rank=True`` every rank writes to ``log_dir/rank_{r}``. Every rank keeps its own summary.

Across ranks (``spread_every=N``, and the steps of the trace window): the hook state gathers
every rank's arrival (:class:`~.records.RankArrivals`) after the step, on a worker of its own
(``hooks/arrivals.py``), and hands the result to :meth:`Telemetry.record_ranks`; telemetry
only records it, and offers each rank's ``total_ms`` (:meth:`Telemetry.take_step_total_ms`)
and trace events (:meth:`Telemetry.local_trace_events`) to gather. At the end of the trace
window rank 0 receives every rank's trace events (:meth:`Telemetry.add_peer_traces`) and
writes one merged, aligned ``comm_trace.json``.

Telemetry never imports ``hooks``: the hook state calls it, not the other way round. Homes:
this module runs the writer thread and routes records to sinks; the marks of one bucket and
how they become records are in :mod:`.bucket_marks`; the options and their checks in
:mod:`.options`; the sinks in :mod:`.sinks`.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import os
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from ..runtime.observer import NULL_OBSERVER, ExecutionObserver
from .bucket_marks import BucketObserver, PendingStep, resolve_step, step_busy_ms
from .options import TelemetryOptions, check_sink, group_log_dir
from .records import RankArrivals
from .sinks import Sink, SummaryTable, TensorBoardSink, TraceSink
from .stragglers import StragglerTally
from .timer import DeviceTimers, HostTimer

_STOP = object()
_CLOSE_TIMEOUT_S = 30.0
_KEPT_TOTALS = 64  # steps' totals waiting for the hook state's gather
TRACE_FILE = "comm_trace.json"


@dataclasses.dataclass(frozen=True)
class _PeerTraces:
    """Rank 0's queue item: the other ranks' trace events for the merged trace file."""

    traces: tuple[tuple[int, list[dict], float], ...]


class Telemetry:
    """Per-bucket communication timing for one hook state, written to sinks off the hot path.

    Args:
        log_dir: write TensorBoard events (and the trace) here; the group's rank 0 only unless
            ``per_rank``.
        log_every: observe every N-th optimizer step (1: every step).
        trace_steps: steps for a Chrome/Perfetto trace ``log_dir/comm_trace.json``: a
            ``(start, stop)`` pair of optimizer steps (``stop`` excluded) or a count N, which
            means the N steps after the first (step 1 runs DDP's provisional bucket layout).
        per_rank: every rank writes to ``log_dir/rank_{r}`` (to compare ranks in TensorBoard).
        spread_every: every N-th step, gather when each rank arrived (handed its last
            bucket over) and log the straggler, its cost, the arrival spread and the ranks'
            step times (0: never; needs the hook state, which gathers them).
        sinks: more sinks (e.g. :class:`~.sinks.MemorySink`), on every rank, fed logged steps.
        capacity: how many finished steps may wait for the writer before new ones are dropped.
        summary_window: how many recent samples per bucket the summary's percentiles use.

    With no argument it is a null telemetry: nothing is observed and nothing written.

    Example::

        >>> telemetry = Telemetry(log_dir="runs/ring", log_every=10, trace_steps=(20, 25))
        >>> state = HookState(telemetry=telemetry)   # or register(model, log_dir=..., ...)
        >>> ...train...
        >>> print(state.summary()); state.close()
    """

    def __init__(
        self,
        *,
        log_dir: str | os.PathLike | None = None,
        log_every: int = 1,
        trace_steps: int | tuple[int, int] | None = None,
        per_rank: bool = False,
        spread_every: int = 0,
        sinks: Iterable[Sink] = (),
        capacity: int = 1024,
        summary_window: int = 1024,
    ) -> None:
        self._options = TelemetryOptions.checked(
            log_dir=log_dir, log_every=log_every, trace_steps=trace_steps, per_rank=per_rank,
            spread_every=spread_every, capacity=capacity, summary_window=summary_window,
        )
        self._user_sinks = tuple(sinks)
        for sink in self._user_sinks:
            check_sink(sink)
        self._reset_runtime()

    # -- configuration ---------------------------------------------------------------------

    @property
    def options(self) -> TelemetryOptions:
        """The checked options this telemetry was built with."""
        return self._options

    @property
    def enabled(self) -> bool:
        """Whether anything is observed at all (False for the null telemetry)."""
        options = self._options
        asked = options.log_dir or options.spread_every or len(self._routes) > 1  # more than the summary
        return not self._closed and bool(asked)

    @property
    def sink_failures(self) -> int:
        """Sink actions (write, flush, open) that raised: each cost a record or a flush."""
        return self._sink_failures

    @property
    def dropped(self) -> int:
        """Steps dropped because the writer fell behind (the queue was full)."""
        return self._dropped

    def add_sink(self, sink: Sink, *, steps: Callable[[int], bool] | None = None) -> None:
        """Send records to ``sink`` too: logged steps, or the steps where ``steps(step)`` is true."""
        check_sink(sink)
        self._routes = (*self._routes, (sink, steps or self._is_log_step))

    def _is_log_step(self, step: int) -> bool:
        return step % self._options.log_every == 0

    def _is_spread_step(self, step: int) -> bool:
        every = self._options.spread_every
        return every > 0 and step % every == 0

    def _is_trace_step(self, step: int) -> bool:
        window = self._options.trace_steps
        return window is not None and step in window

    def gathers_ranks(self, step: int) -> bool:
        """Whether the hook state should gather every rank's arrival at ``step`` (spread steps,
        and trace steps so the merged trace shows who waited)."""
        return self.enabled and (self._is_spread_step(step) or self._is_trace_step(step))

    def merges_trace_at(self, step: int) -> bool:
        """Whether rank 0 gathers every rank's trace events after ``step`` (the window's last
        step; with ``per_rank`` each rank writes its own file and ``trace merge`` joins them)."""
        window = self._options.trace_steps
        return window is not None and not self._options.per_rank and step == window[-1]

    def _wants(self, step: int) -> bool:
        return self._is_log_step(step) or self._is_spread_step(step) or self._is_trace_step(step)

    # -- hot path (hook thread, communication worker) --------------------------------------

    def observe_bucket(
        self,
        buffer: torch.Tensor,
        *,
        step: int,
        index: int,
        is_last: bool,
        algorithm: str,
        group: dist.ProcessGroup | None = None,
    ) -> ExecutionObserver:
        """An observer for bucket ``index`` of ``step``, which DDP just handed over (call it on
        the hook thread; DDP hands buckets over in index order)."""
        if not self.enabled:
            return NULL_OBSERVER
        if step != self._open_step:
            self._open_step = step
            self._pending = PendingStep(step, self._start(group)) if self._wants(step) else None
        pending = self._pending
        if pending is None:
            return NULL_OBSERVER
        observer = BucketObserver(
            self, pending, self._timers.for_buffer(buffer), index=index, buffer=buffer, algorithm=algorithm,
            world_size=dist.get_world_size(group), group=group,
        )
        with self._step_lock:
            pending.buckets.append(observer)
            pending.last_handed = is_last
        return observer

    def _bucket_finished(self, bucket: BucketObserver) -> None:
        """Called from the worker that reduced ``bucket``: the step's last bucket to finish
        (not always the last handed over) completes the step."""
        with self._step_lock:
            pending, bucket.pending = bucket.pending, None
            if pending is None:
                return
            pending.finished += 1
            if not (pending.last_handed and pending.finished == len(pending.buckets)):
                return
        self._finish_step(pending, bucket.group)

    def _finish_step(self, pending: PendingStep, group) -> None:
        """The step's last bucket is reduced: keep its total for the ranks' gather, queue the marks."""
        if self.gathers_ranks(pending.step) and isinstance(pending.buckets[0].timer, HostTimer):
            with self._step_lock:  # CUDA marks are not resolved yet: its total stays unknown
                self._step_totals[pending.step] = step_busy_ms(pending.buckets)
                if len(self._step_totals) > _KEPT_TOTALS:  # nobody took them (no hook state gathers)
                    del self._step_totals[next(iter(self._step_totals))]
        pending.dropped = self._dropped
        try:
            self._queue.put_nowait(pending)
        except queue.Full:
            self._count_dropped()

    def _count_dropped(self) -> None:
        # Called from the comm workers, the arrivals worker and the writer: one lock.
        with self._step_lock:
            self._dropped += 1

    # -- across ranks: the hook state gathers, telemetry records ------------------------------

    def take_step_total_ms(self, step: int) -> float:
        """This rank's ``total_ms`` of ``step`` once all its buckets finished (NaN if unknown),
        for the hook state's gather; forgotten after this call."""
        with self._step_lock:
            return self._step_totals.pop(step, math.nan)

    def record_ranks(self, record: RankArrivals) -> None:
        """Record what the hook state gathered across ranks (never blocks; full queue: dropped)."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._count_dropped()

    def local_trace_events(self) -> list[dict]:
        """This rank's trace events of the window, on its own clock (waits for the writer)."""
        self.flush()
        return [event for sink, _ in self._file_routes if isinstance(sink, TraceSink) for event in sink.events()]

    def add_peer_traces(self, traces: list[tuple[int, list[dict], float]]) -> None:
        """Rank 0: the other ranks' trace events ``(rank, events, clock offset ms)`` to merge
        into its trace file, shifted onto its clock."""
        self._queue.put(_PeerTraces(tuple(traces)), timeout=_CLOSE_TIMEOUT_S)

    # -- starting, flushing, closing -------------------------------------------------------

    def _start(self, group=None) -> int:
        """On the first observed step: learn this process's rank in the hook's group and where
        the group writes (:func:`~.options.group_log_dir`), start the writer thread. Returns
        the rank."""
        if self._rank is not None:
            return self._rank
        initialized = dist.is_available() and dist.is_initialized()
        self._rank = dist.get_rank(group) if initialized else 0
        if self._options.log_dir is not None:
            self._directory = group_log_dir(self._options.log_dir, group) if initialized else self._options.log_dir
        self._writer = threading.Thread(target=self._write_loop, name="ddp-ring-hooks-telemetry", daemon=True)
        self._writer.start()
        atexit.register(_close_at_exit, weakref.ref(self))
        return self._rank

    def _file_sinks(self, rank: int) -> list[tuple[Sink, Callable[[int], bool]]]:
        """TensorBoard and trace sinks of this rank (built on the writer thread: file I/O)."""
        options = self._options
        if options.log_dir is None:
            return []
        if not (options.per_rank or rank == 0):
            # Kept in memory only, for rank 0 to gather into its merged trace.
            return [(TraceSink(None, steps=options.trace_steps), self._is_trace_step)] if options.trace_steps else []
        directory = os.path.join(self._directory, f"rank_{rank}") if options.per_rank else self._directory
        # Logged steps; the gathered ranks of spread steps come through write_ranks.
        routes: list[tuple[Sink, Callable[[int], bool]]] = [(TensorBoardSink(directory), self._is_log_step)]
        if options.trace_steps is not None:
            routes.append((TraceSink(os.path.join(directory, TRACE_FILE), steps=options.trace_steps),
                           self._is_trace_step))
        return routes

    def flush(self, timeout: float = _CLOSE_TIMEOUT_S) -> None:
        """Wait until every queued step reached the sinks, then flush them."""
        if self._writer is None or not self._writer.is_alive():
            return
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return
        done.wait(timeout)

    def close(self) -> None:
        """Write what is queued, close the sinks and stop. Safe to call twice; also runs at exit."""
        if self._closed:
            return
        self._closed = True
        writer = self._writer
        if writer is not None and writer.is_alive():
            try:
                self._queue.put(_STOP, timeout=_CLOSE_TIMEOUT_S)
            except queue.Full:
                pass  # the writer is stuck; the join below times out and says so
            writer.join(_CLOSE_TIMEOUT_S)
            if writer.is_alive():
                # Closing the sinks under a writer that may still use them could corrupt files.
                warnings.warn(
                    f"telemetry writer did not finish within {_CLOSE_TIMEOUT_S:.0f} s; its sinks are "
                    "left open (the last steps may be missing)", stacklevel=2,
                )
                return
        for sink, _ in self._all_routes():
            try:
                sink.close()
            except Exception as error:  # noqa: BLE001 - one broken sink must not hide the others
                warnings.warn(f"telemetry sink {type(sink).__name__} failed to close: {error}", stacklevel=2)

    def summary(self) -> str:
        """The per-bucket summary table of the logged steps so far, as text; with
        ``spread_every``, a last line on stragglers (:class:`~.stragglers.StragglerTally`)."""
        if not self.enabled and self._writer is None:
            return ("no communication telemetry: pass log_dir=PATH or sinks=[...] to register/HookState "
                    "to record per-bucket timings")
        self.flush()
        text = self._summary.render(dropped=self._dropped)
        if self._sink_failures:  # the table counts what was measured, not what was written
            text += (f"\n  WARNING: {self._sink_failures} telemetry sink failures, so some of these steps "
                     f"are missing from the files; first: {self._first_sink_error}")
        if self._options.spread_every:
            text += f"\n{self._stragglers.render()}"
        return text

    # -- writer thread -----------------------------------------------------------------------

    def _all_routes(self):
        return (*self._routes, *self._file_routes)

    def _write_loop(self) -> None:
        self._file_routes = tuple(self._guard(lambda: self._file_sinks(self._rank), default=[]))
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._flush_sinks()
                return
            if isinstance(item, threading.Event):
                self._flush_sinks()
                item.set()
                continue
            if isinstance(item, RankArrivals | _PeerTraces):
                self._deliver(item)
                continue
            record = self._guard(lambda: resolve_step(item, deadline=time.monotonic() + _CLOSE_TIMEOUT_S))
            if record is None:  # its CUDA events never completed (or resolving failed): counted
                self._count_dropped()
                continue
            for sink, wants in self._all_routes():
                if wants(record.step):
                    self._guard(lambda: sink.write(record))

    def _deliver(self, item: RankArrivals | _PeerTraces) -> None:
        """Gathered ranks of spread steps go to every sink that takes them (``write_ranks``),
        those of trace steps to the trace; peer traces to the trace file."""
        spread = isinstance(item, RankArrivals) and self._is_spread_step(item.step)
        if spread:
            self._stragglers.add(item)
        for sink, _ in self._all_routes():
            if isinstance(item, _PeerTraces):
                if isinstance(sink, TraceSink):
                    self._guard(lambda: sink.add_peer_traces(item.traces))
            elif (spread or isinstance(sink, TraceSink)) and callable(getattr(sink, "write_ranks", None)):
                self._guard(lambda: sink.write_ranks(item))

    def _flush_sinks(self) -> None:
        for sink, _ in self._all_routes():
            self._guard(sink.flush)

    def _guard(self, action, default=None):
        """Run a sink action; warn once about a failure instead of killing the writer."""
        try:
            return action()
        except Exception as error:  # noqa: BLE001 - telemetry must never break training
            self._sink_failures += 1
            if self._first_sink_error is None:
                self._first_sink_error = repr(error)
            if not self._warned_sink:
                self._warned_sink = True
                warnings.warn(f"communication telemetry failed and skips this record: {error!r}", stacklevel=1)
            return default

    # -- pickling: options survive, threads, sinks and marks do not -----------------------

    def _reset_runtime(self) -> None:
        self._summary = SummaryTable(window=self._options.summary_window)
        self._stragglers = StragglerTally(window=self._options.summary_window)
        self._step_totals: dict[int, float] = {}
        self._routes: tuple = ((self._summary, self._is_log_step), *((s, self._is_log_step) for s in self._user_sinks))
        self._file_routes: tuple = ()
        self._queue: queue.Queue = queue.Queue(maxsize=self._options.capacity)
        self._dropped = 0
        self._timers = DeviceTimers()
        self._open_step = 0
        self._step_lock = threading.Lock()
        self._pending: PendingStep | None = None
        self._rank: int | None = None
        self._directory: str | None = None
        self._writer: threading.Thread | None = None
        self._closed = False
        self._warned_sink = False
        self._sink_failures = 0
        self._first_sink_error: str | None = None

    def __getstate__(self) -> dict:
        return {"options": self._options}

    def __setstate__(self, state: dict) -> None:
        self._options = state["options"]
        self._user_sinks = ()
        self._reset_runtime()


def _close_at_exit(reference: weakref.ref) -> None:
    telemetry = reference()
    if telemetry is not None:
        telemetry.close()
