"""``Telemetry``: the per-bucket recorder, a watcher of the observation; records and sinks off the hot path.

The path of one step's numbers::

    hook thread        the bucket's thread         writer thread (daemon)         sinks
    hand_over()  -->   on_phase / on_finish  -->   queue (bounded) --> read  -->  TensorBoard
    (mark: handed)     (marks: phases, end)        full? drop + count  marks->ms  trace, summary

1. The observation (:mod:`.observation`) marks the buckets of the steps this recorder wants
   (:meth:`Telemetry.wants_marks`): the hand-over, each phase (the first one starts the
   communication), the end.
2. When the step's last bucket finishes (:meth:`Telemetry.on_step_done`), the step goes into
   a bounded queue with one non-blocking ``put``. If the queue is full the step is dropped and
   counted: the training loop never waits for a disk, and memory stays flat however long the run.
3. A writer thread reads the marks (:meth:`~.watcher.StepWatch.read`: on CUDA it first polls
   ``event.query()`` until the events are complete; it never synchronizes), makes a
   :class:`~.records.StepRecord` and hands it to the sinks whose steps it belongs to.

Only steps that something wants are marked (``log_every``, the trace window, spread steps);
other steps cost one integer comparison. The hook group's rank 0 writes files by default (to
``log_dir/group_0-3``, named by its ranks, for a group that is not every rank:
:func:`.options.group_log_dir`); with ``per_rank=True`` every rank writes to
``log_dir/rank_{r}``. Every rank keeps its own summary.

Every other watcher writes through :meth:`Telemetry.record`: one protocol
(:class:`~.records.Record`: scalars, texts, trace events), queued like the steps and handed to
every sink's ``write_record``, which takes the forms it knows. The arrivals watcher
(:mod:`.arrivals`) records what it gathered after spread and trace steps (and offers this
recorder's trace events, :meth:`Telemetry.local_trace_events`, for rank 0's one merged, aligned
``comm_trace.json``); the per-link watcher (:mod:`.link_timing`) each gathered step's links; the
advice and the stall watchdog their text panels. Homes: the options and their checks are in
:mod:`.options`; marks to records in :mod:`.bucket_marks`; the sinks in :mod:`.sinks`,
:mod:`.trace`, :mod:`.summary`.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import warnings
from collections.abc import Callable

import torch.distributed as dist

from ..runtime.daemons import stop_at_exit
from .bucket_marks import step_record
from .cadence import AUTO, Cadence
from .options import TelemetryOptions, check_sink, collect_telemetry_options, group_log_dir
from .records import Record, Text
from .sinks import Sink, TensorBoardSink
from .summary import SummaryTable
from .trace import TraceSink
from .watcher import StepWatch, Watcher

_STOP = object()
_CLOSE_TIMEOUT_S = 30.0
TRACE_FILE = "comm_trace.json"


class Telemetry(Watcher):
    """Per-bucket communication timing for one hook state, written to sinks off the hot path.

    Args:
        options: a :class:`~.options.TelemetryOptions`, or ``None`` and its fields as keywords
            (``log_dir``, ``log_every``, ``trace_steps``, ``per_rank``, ``spread_every``,
            ``sinks``, ``capacity``, ``summary_window``, ``links``: what each means is documented
            there).

    With no argument it is a null telemetry: nothing is observed and nothing written.

    Example::

        >>> telemetry = Telemetry(log_dir="runs/ring", log_every=10, trace_steps=(20, 25))
        >>> state = HookState(telemetry=telemetry)   # or register(model, log_dir=..., ...)
        >>> ...train...
        >>> print(state.summary()); state.close()
    """

    def __init__(self, options: TelemetryOptions | None = None, **fields) -> None:
        self.options = collect_telemetry_options(options, fields)
        self._reset_runtime()

    # -- configuration ---------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """Whether anything is observed at all (False for the null telemetry)."""
        options = self.options
        asked = options.log_dir or options.spread_every or len(self._routes) > 1  # more than the summary
        return not self._closed and bool(asked)

    @property
    def watched(self) -> bool:
        """Whether anything was asked for or recorded (if not, the summary says how to ask)."""
        return self.enabled or self._writer is not None

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
        if self.options.log_every == AUTO:  # the gathered steps (diagnose=True's default)
            return self._is_spread_step(step)
        return step % self.options.log_every == 0

    def _is_spread_step(self, step: int) -> bool:
        return self.cadence.gathers(step)  # every N-th, or "auto" (telemetry/cadence.py)

    def _is_trace_step(self, step: int) -> bool:
        window = self.options.trace_steps
        return window is not None and step in window

    def spreads_at(self, step: int) -> bool:
        """Whether ``step`` is a spread step (``spread_every``): its gathered numbers are plotted."""
        return self._is_spread_step(step)

    def gathers_ranks(self, step: int) -> bool:
        """Whether every rank's arrival is gathered at ``step`` (spread steps, and trace steps
        so the merged trace shows who waited)."""
        return self.enabled and (self._is_spread_step(step) or self._is_trace_step(step))

    def merges_trace_at(self, step: int) -> bool:
        """Whether rank 0 gathers every rank's trace events after ``step`` (the window's last
        step; with ``per_rank`` each rank writes its own file and ``trace merge`` joins them)."""
        window = self.options.trace_steps
        return window is not None and not self.options.per_rank and step == window[-1]

    def _wants(self, step: int) -> bool:
        return self._is_log_step(step) or self._is_spread_step(step) or self._is_trace_step(step)

    # -- watching (hook thread, then the thread of the step's last bucket) -------------------

    def wants_marks(self, step: int) -> bool:
        return self.enabled and self._wants(step)

    def on_step_done(self, step: StepWatch) -> None:
        """Every bucket of ``step`` finished: queue it for the writer (never blocks)."""
        if not self.wants_marks(step.step):  # marked for another watcher
            return
        self._start(step.group)
        try:
            self._queue.put_nowait((step, self._dropped))
        except queue.Full:
            self._count_dropped()

    def _count_dropped(self) -> None:
        # Called from the comm workers, the exchange worker and the writer: one lock.
        with self._lock:
            self._dropped += 1

    # -- every other watcher's records -------------------------------------------------------

    def record(self, record: Record, *, group=None) -> None:
        """Hand ``record`` (:class:`~.records.Record`) to every sink, off the caller's thread
        (never blocks; full queue: dropped and counted). ``group``: the hook's, for a record
        that comes before any step was (where this rank writes)."""
        if self._closed or not self.enabled:
            return
        self._start(group)
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._count_dropped()

    def write_text(self, tag: str, text: str, *, group=None, step: int = 0) -> None:
        """A text panel (a :class:`~.records.Text` record) at ``step``."""
        self.record(Text(step, tag, text), group=group)

    def local_trace_events(self) -> list[dict]:
        """This rank's trace events of the window, on its own clock (waits for the writer)."""
        self.flush()
        return [event for sink, _ in self._file_routes if isinstance(sink, TraceSink) for event in sink.events()]

    # -- starting, flushing, closing -------------------------------------------------------

    def _start(self, group=None) -> None:
        """On the first recorded step: learn this process's rank in the hook's group and where
        the group writes (:func:`~.options.group_log_dir`), start the writer thread."""
        with self._lock:
            if self._writer is not None:
                return
            initialized = dist.is_available() and dist.is_initialized()
            self._rank = dist.get_rank(group) if initialized else 0
            if self.options.log_dir is not None:
                self._directory = group_log_dir(self.options.log_dir, group) if initialized else self.options.log_dir
            self._writer = threading.Thread(target=self._write_loop, name="ddp-ring-hooks-telemetry", daemon=True)
            self._writer.start()
        stop_at_exit(self)

    def _file_sinks(self, rank: int) -> list[tuple[Sink, Callable[[int], bool]]]:
        """TensorBoard and trace sinks of this rank (built on the writer thread: file I/O)."""
        options = self.options
        if options.log_dir is None:
            return []
        if not (options.per_rank or rank == 0):
            # Kept in memory only, for rank 0 to gather into its merged trace.
            return [(TraceSink(None, steps=options.trace_steps), self._is_trace_step)] if options.trace_steps else []
        directory = os.path.join(self._directory, f"rank_{rank}") if options.per_rank else self._directory
        # Logged steps; what watchers gather after spread steps comes through write_record.
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

    def stop_threads(self, timeout: float) -> None:
        """At exit (``runtime/daemons.py``): :meth:`close`, whose own wait (up to
        ``_CLOSE_TIMEOUT_S``) it keeps: the steps queued are the run's last numbers."""
        self.close()

    def summary(self) -> str:
        """The per-bucket summary table of the logged steps so far, as text, and the latest of
        every watcher's summarized scalars (the other watchers' lines: ``Observation.summary``)."""
        if not self.watched:
            return ("no communication telemetry: pass log_dir=PATH or sinks=[...] to register/HookState "
                    "to record per-bucket timings")
        self.flush()
        text = self._summary.render(dropped=self._dropped)
        if self._sink_failures:  # the table counts what was measured, not what was written
            text += (f"\n  WARNING: {self._sink_failures} telemetry sink failures, so some of these steps "
                     f"are missing from the files; first: {self._first_sink_error}")
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
            began = time.thread_time()
            self._write_item(item)
            if self.cadence.auto and self._for_gathered(item):  # priced by the cadence
                self.cadence.charge((time.thread_time() - began) * 1e3)

    def _for_gathered(self, item) -> bool:
        """Whether writing ``item`` is work a gathered step made: a watcher's record (they record
        after gathers), or a step's buckets logged only because it gathered (``log_every="auto"``)."""
        return isinstance(item, Record) or self.options.log_every == AUTO

    def _write_item(self, item) -> None:
        """One queued record (a watcher's) or step (the buckets' marks) into every sink that takes it."""
        if isinstance(item, Record):  # a watcher's: every sink takes the forms it knows
            for sink, _ in self._all_routes():
                self._guard(lambda: sink.write_record(item))
            return
        step, dropped = item
        record = self._guard(lambda: self._record_of(step, dropped))
        if record is None:  # its CUDA events never completed (or reading failed): counted
            self._count_dropped()
            return
        for sink, wants in self._all_routes():
            if wants(record.step):
                self._guard(lambda: sink.write(record))

    @staticmethod
    def _record_of(step: StepWatch, dropped: int):
        clocks = step.read(_CLOSE_TIMEOUT_S)
        return None if clocks is None else step_record(step, clocks, dropped=dropped)

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
        options = self.options
        self._summary = SummaryTable(window=options.summary_window)
        #: Which steps gather across ranks (``spread_every``: every N-th, or "auto").
        self.cadence = Cadence(options.spread_every)
        self._routes: tuple = ((self._summary, self._is_log_step), *((s, self._is_log_step) for s in options.sinks))
        self._file_routes: tuple = ()
        self._queue: queue.Queue = queue.Queue(maxsize=options.capacity)
        self._dropped = 0
        self._lock = threading.Lock()
        self._rank: int | None = None
        self._directory: str | None = None
        self._writer: threading.Thread | None = None
        self._closed = False
        self._warned_sink = False
        self._sink_failures = 0
        self._first_sink_error: str | None = None

    def __getstate__(self) -> dict:
        return {"options": self.options}  # which pickles without its sinks

    def __setstate__(self, state: dict) -> None:
        self.options = state["options"]
        self._reset_runtime()
