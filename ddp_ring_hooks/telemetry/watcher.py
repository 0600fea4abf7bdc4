"""Watching a bucket: the one interface every watcher implements, and what it is shown.

The hook state hands each bucket to its :class:`~.observation.Observation` once; the
observation takes the bucket's marks once and shows the bucket to every :class:`Watcher` (the
per-bucket recorder, the advisor's timeline, the arrivals gather, the profiler's ranges)::

    hook thread (DDP's order)          the bucket's thread              after the step
    ---------------------------        ---------------------------      ------------------------
    hand_over -> BucketWatch           on_phase / on_step / on_finish   last bucket finished:
      (the hand-over mark)               (marks, then every watcher's     watcher.on_step_done
      watcher.wants_marks(step)           observer, in order)            exchange worker, in step
        once per step                                                    order on every rank:
      watcher.on_bucket(bucket)                                            watcher.share -> one
        -> an ExecutionObserver                                            gather -> watcher.shared,
                                                                           watcher.exchange
    launched(future)  watcher.launched(bucket, future, observer) -> the Future DDP waits on
                      (observer: what this watcher's on_bucket returned for this bucket; the
                      last bucket of an exchanging step queues the exchange)

A watcher writes through the recorder's one protocol (``Telemetry.record``: a
:class:`~.records.Scalars`, :class:`~.records.Text` or :class:`~.records.Trace` record, or one of
its own with those forms), which every sink takes; the summary ends with every watcher's
:meth:`~Watcher.summary_line`. Adding a watcher is two steps: a class with the methods below that
it needs (each is a no-op here), and an entry in the observation's table of watchers
(``observation.WATCHERS``), with an option of its own as a ``TelemetryOptions`` field. Hot-path
methods (:meth:`~Watcher.wants_marks`, :meth:`~Watcher.on_bucket` and the observer they
return) run on the training or communication thread: a comparison, a clock mark, an append;
no I/O, no waiting, no lock held for long. Anything slower goes to a thread of the watcher's
own or to the exchange worker.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence

from ..runtime.observer import ExecutionObserver, FanOut
from ..runtime.wire import BucketBytes
from .bucket_marks import BucketClocks

#: How long a reader waits for a step's CUDA events to complete (they never may: a hung GPU).
READ_TIMEOUT_S = 30.0


class Watcher:
    """One way of watching buckets; the observation calls every watcher in order."""

    def attach(self, ddp_model, *, algorithm: str, concurrent_buckets: int, group) -> None:
        """The hook was registered on ``ddp_model`` (``register`` and the Lightning strategy):
        watch the model itself (forward hooks, say). A state attached by hand never hears this."""

    def wants_marks(self, step: int) -> bool:
        """Hook thread, at the first bucket of optimizer step ``step``: whether its buckets
        should be marked at each phase and at the end (the hand-over is always marked)."""
        return False

    def on_bucket(self, bucket: BucketWatch) -> ExecutionObserver | None:
        """Hook thread, as DDP hands ``bucket`` over (its hand-over mark is taken): an observer
        of its all-reduce (called on the thread that runs it), or ``None``. An observer that is
        also a context manager is entered around the bucket's job on that thread (see
        :meth:`BucketWatch.running`)."""
        return None

    def launched(self, bucket: BucketWatch, future, observer):
        """Hook thread: DDP will wait on ``future`` for ``bucket``; ``observer`` is what this
        watcher's :meth:`on_bucket` returned for it (``None`` if nothing). Return ``future``, or
        a Future that completes with it unless this watcher fails it first (the stall watchdog,
        at ``stall_timeout``). The next watcher is given what this one returns."""
        return future

    def on_step_done(self, step: StepWatch) -> None:
        """Every bucket of a marked ``step`` finished (on the thread of the last one to finish;
        on CUDA: enqueued). Never block here: hand the step to a thread."""

    def exchanges_after(self, step: int) -> bool:
        """Hook thread: whether this watcher talks to the other ranks after ``step``. Every rank
        must answer the same (decide from the step number and the options)."""
        return False

    def share(self, step: StepWatch, peers) -> Sequence[float]:
        """On the exchange worker, after every bucket of ``step`` succeeded (phase 1 of
        :mod:`.exchange`): trade with some peers first if it must (``peers.trade``), then return
        this rank's row for the step's one gather of every watcher's rows, the same length on
        every rank (``()``: none)."""
        return ()

    def shared(self, step: StepWatch, peers, rows: list[list[float]]) -> None:
        """Phase 3: every rank's row that :meth:`share` returned, by group rank (the gather is
        over: the same numbers on every rank)."""

    def exchange(self, step: StepWatch, peers) -> None:
        """On the exchange worker, after every watcher's :meth:`shared`: talk to the other ranks
        through ``peers`` (:class:`~.exchange.Peers`) on its own (the trace gather's bytes to
        rank 0). Exchanges run in step order, one watcher after the other, the same on every rank."""

    def summary_line(self) -> str | None:
        """A line for the end of the hook state's summary (``None``: none), read on the
        caller's thread: who kept the others waiting, which link is slow."""
        return None

    def close(self) -> None:
        """The hook state closes: write what is left, stop threads. Called once, in order."""


class StepWatch:
    """One optimizer step's buckets, as handed over (one DDP reduction).

    ``step`` is the optimizer step (the hook state's ``iteration`` after it, 1-based); ``rank``,
    ``world_size`` and ``group`` the hook's; ``marked``: its buckets carry phase and end marks;
    ``exchanged``: watchers talk across ranks after it, and ``futures`` holds its buckets'
    Futures for that. ``buckets`` (marked steps): every bucket handed over, in DDP's order.
    """

    def __init__(self, step: int, *, rank: int, world_size: int, group, marked: bool) -> None:
        self.step = step
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.marked = marked
        self.exchanged = False
        self.buckets: list[BucketWatch] = []
        self.futures: list = []
        # Buckets may finish out of order (several run at once on CPU): the step is done when
        # the last bucket was handed over and every bucket handed over has finished.
        self.last_handed = False
        self.finished = 0
        self._clocks: tuple[BucketClocks, ...] | None = None
        self._read = False
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self.last_handed and self.finished == len(self.buckets)

    def read(self, timeout_s: float = READ_TIMEOUT_S) -> tuple[BucketClocks, ...] | None:
        """Every bucket's marks in ms, by bucket, once every bucket finished (read once, for
        every reader; off the training path: on CUDA it polls until the events completed, then
        hands them back to be recorded again). ``None`` when a CUDA event did not complete
        within ``timeout_s``."""
        with self._lock:
            if not self._read:
                self._read = True
                self._clocks = _read_marks(self.buckets, time.monotonic() + timeout_s)
            return self._clocks


def _read_marks(buckets: list[BucketWatch], deadline: float) -> tuple[BucketClocks, ...] | None:
    if not all(bucket.timer.wait_ready(bucket.end, deadline) for bucket in buckets):
        return None
    clocks = tuple(BucketClocks.read(bucket) for bucket in buckets)
    for bucket in buckets:  # read once and for all: CUDA events go back to be reused
        bucket.timer.release([bucket.handed, *(mark for _, mark in bucket.phases), bucket.end])
    return clocks


class BucketWatch(FanOut):
    """One bucket on its way through the hook: what every watcher is shown, and its marks.

    An :class:`~ddp_ring_hooks.runtime.ExecutionObserver`: the executor calls it as the bucket
    runs; it takes the marks once, for every watcher, and passes each call on to the
    watchers' observers (:class:`~ddp_ring_hooks.runtime.observer.FanOut`).

    - what: ``step`` (optimizer step), ``index`` (DDP's bucket order), ``is_last``, ``nbytes``,
      ``wire_bytes`` and ``wire`` (what its transfers carry: its bytes on the wire and their
      dtype), ``kind`` (``dense``, ``sparse``, ``densified``, ``foreign``: how it was reduced and
      its bytes counted, ``runtime/wire.py``), ``size`` (all of its byte counts, a sparse one's
      ``nnz`` among them), ``numel``, ``dtype``, ``algorithm``, ``world_size``, ``rank``, ``group``;
    - marks (:mod:`.timer`: host seconds, or CUDA events on the stream doing the work):
      ``handed`` (taken first, as DDP handed the bucket over; on CUDA also the event the
      communication stream waits for), and on marked steps ``phases`` (``(name, mark)`` at each
      phase) and ``end``; ``cpu_ms``, the CPU time of the thread that ran the whole all-reduce;
    - ``future``: the Future DDP got for it (after :meth:`launched`); ``explain``: how the hook
      state names a failure of this bucket (an error in, the error DDP should raise out).

    Read marks through :meth:`StepWatch.read` (once every bucket of the step finished): CUDA
    events are recycled after that one reading. Host marks (``timer.on_host``) are plain
    floats, readable with :meth:`~.bucket_marks.BucketClocks.read` once the bucket finished.
    """

    def __init__(self, observation, step: StepWatch, timer, handed, buffer, *, index: int, is_last: bool,
                 algorithm: str, size: BucketBytes, entered: float | None = None) -> None:
        super().__init__(())
        self._observation = observation
        self._step: StepWatch | None = step  # dropped when the bucket finishes: no cycle left
        self.step = step.step
        self.rank = step.rank
        self.group = step.group
        self.index = index
        self.is_last = is_last
        self.numel = buffer.numel()
        self.resize(size)
        self.dtype = buffer.dtype
        self.algorithm = algorithm
        self.world_size = step.world_size
        self.timer = timer
        self.handed = handed
        self.marked = step.marked
        self.phases: list[tuple[str, object]] = []
        self.end = None
        self.cpu_ms = 0.0
        self._cpu = None  # (thread, its CPU clock) at the first phase
        self.future = None
        self.explain = None
        self._entered = entered
        #: the hook's own time on DDP's thread (the autograd thread: backward waits for it), from
        #: its call to its return with the Future (ms; 0 when the hook did not say when it began)
        self.call_ms = 0.0

    def resize(self, size: BucketBytes) -> None:
        """The bucket's byte counts, once its executor knows them (a sparse bucket's once it is
        coalesced, a foreign hook's once the hook said what it sent): before it finishes, on the
        thread that runs it; read after it finished."""
        self.size = size
        self.nbytes = size.nbytes
        self.wire_bytes = size.wire_bytes
        self.wire = size.wire
        self.kind = size.kind

    def watched_by(self, seen: tuple, observers: tuple[ExecutionObserver, ...]) -> None:
        """What each watcher's ``on_bucket`` returned (``seen``, in the watchers' order, ``None``
        included: each watcher's ``launched`` is given its own), and the observers the executor's
        calls go to (the observation sets them at hand-over)."""
        self.seen = seen
        self._observers = observers

    # -- the executor's calls: marks first, then the watchers' observers -------------------

    def on_phase(self, phase: str) -> None:
        if self.marked:
            self.phases.append((phase, self.timer.mark()))
            if self._cpu is None and self.timer.on_host:
                self._cpu = (threading.get_ident(), time.thread_time())
        super().on_phase(phase)

    def on_finish(self) -> None:
        if self.marked:
            self.end = self.timer.mark()
            if self._cpu is not None and self._cpu[0] == threading.get_ident():
                # A thread's CPU clock: only meaningful when one thread ran the whole all-reduce.
                # native starts it on the hook thread and finishes in gloo's callback: no reading.
                self.cpu_ms = (time.thread_time() - self._cpu[1]) * 1e3
        super().on_finish()
        step, self._step = self._step, None
        self._observation.bucket_finished(self, step)

    # -- the hook state's calls --------------------------------------------------------------

    def running(self, job):
        """``job`` as the bucket's worker should run it: inside every watcher observer that is
        a context manager (the profiler's bucket range), which a failure closes too."""
        managers = [observer for observer in self._observers if hasattr(observer, "__enter__")]
        if not managers:
            return job

        def run():
            with contextlib.ExitStack() as stack:
                for manager in managers:
                    stack.enter_context(manager)
                return job()

        return run

    def launched(self, future, *, explain=None):
        """``future`` will complete this bucket; returns the Future DDP gets: ``future`` as the
        watchers pass it on (the stall watchdog's may fail first, with an error it has
        ``explain`` name: the hook state's, e.g. ``HookFailedError``). After the last bucket of
        a step that watchers exchange after, the observation queues the exchange (on the hook
        thread: DDP's order, the same on every rank)."""
        self.explain = explain
        future = self._observation.launched(self, future)
        if self._entered is not None:
            self.call_ms = (time.perf_counter() - self._entered) * 1e3
        return future
