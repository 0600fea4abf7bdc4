"""``StallWatchdog``: a rank that stops answering never hangs the others silently, and a busy one is never called stalled.

A dead peer closes its sockets and gloo fails at once. A peer that is alive but silent
(stopped, blocked in a deadlock, cut off by the network, a hung GPU) leaves the others
waiting for the group's timeout, 30 minutes on gloo, and then its message names no rank. A
peer that is alive and *elsewhere* (rank 0 checkpointing or evaluating while the others wait
in bucket 0, a cold ``torch.compile``) is neither: it is busy, and the job must go on. This
watcher of the observation (:mod:`.observation`) tells them apart, in five parts::

    hot path (hook, worker)       watchdog thread (sleeps)             store thread
    -----------------------       ----------------------------         ------------------------
    on_phase / on_wait / on_step  every poll: this rank's state  --->  set  stall/{rank}
      a timestamp, and whom it      and a sequence number               (latest wins)
      now waits for               a bucket waits long:           --->  multi_get every record
    forward, first bucket,          read them every poll, place  <---   (one round trip; a
      paused(...): what training    them on my clock, ask /proc         bounded wait: a store
      does                          about silent local ranks            may be stuck itself)
                                  stall_after: judge the end of the
                                    chain (:func:`.stall_report.diagnose`)
                                  stalled: log + warn + comm/stall + dump
                                  busy: one line; paused: nothing
                                  stall_timeout, stalled only: fail the
                                    bucket's Future, abort the group,
                                    SIGCONT a stopped local peer

1. **Marks.** Each bucket's observer keeps one tuple (since when, phase, schedule step, the peer
   it now waits for; the executor says which, ``ExecutionObserver.on_wait``); every
   transfer completed replaces it, so progress resets the clock. ``native`` (gloo's own
   all-reduce) has no waits of ours and gloo shows no progress inside it: its bucket waits
   from issue to gloo's callback, and the store says whether every rank is in it. On CUDA a
   bucket is watched until an event recorded after it completes (``event.query()`` on this
   thread: never a host sync).
2. **Liveness.** From registration (or the first bucket) every poll (``stall_after / 10``,
   0.1-5 s) the watchdog publishes this rank's state through the process group's store (the
   store the group was built on: torchrun's TCPStore or the file store; it keeps working when
   a peer stops answering over gloo) when it changed, or as a heartbeat, each with the next
   sequence number: a small ``set`` at most twice a poll, from this thread (a step's end wakes
   it). ``paused(reason)`` publishes at once and waits for it (the work it marks may hold the
   GIL from its first line).
3. **Watching.** While a bucket has waited :attr:`StallWatchdog.watch_from` seconds (long enough
   before ``stall_after`` that a silent peer's number has had time to stay unchanged), the
   watchdog reads every record each poll with one ``multi_get`` and places them on its own
   monotonic clock (:class:`~.stall_report.Sightings`: no other host's clock is read); a rank
   on this host whose number stopped is looked up in ``/proc`` (:mod:`.liveness`).
4. **Report.** At ``stall_after`` it follows who waits for whom to the end of the chain:
   *stalled* (stopped reporting) goes to the ``ddp_ring_hooks`` logger (each report; the first
   also as a :class:`RankStalledWarning`) and, with a ``log_dir``, the ``comm/stall`` text panel
   and ``stall_rank{r}.json`` (the finding, every rank's record, this rank's open buckets and
   its last :data:`FLIGHT_RECORDER_BUCKETS` buckets: the flight recorder, always on), repeated
   every ``stall_after``, ``resumed after 14 s`` when it ends; *busy* is one log line and one
   panel line per wait; *paused*, every rank in the all-reduce, a cycle of reporting ranks: no
   line (the latest finding is kept, and named by any error that ends the wait).
5. **Timeout.** After ``stall_timeout`` seconds, and only while the finding is *stalled* (or the
   store did not answer), the bucket's Future fails (the one DDP waits on,
   :meth:`StallWatchdog.launched`: the real completion, if it ever comes, is ignored) with a
   :class:`RankStalledError` that the hook state names as a ``HookFailedError``, every other
   open bucket with it, and the group's transfers are aborted
   (the group context's :meth:`~ddp_ring_hooks.runtime.group_context.GroupContext.abort`: the
   group and everything made for it, per device): blocked threads are let go, the
   peers' transfers with this rank fail at once, the process can exit and torchrun restart it.
   A stalled rank stopped by a signal on this host is then sent ``SIGCONT``: it runs into the
   aborted group, fails and exits, instead of keeping torchrun's agent waiting on it. A busy
   or paused rank is never aborted for: the group's own timeout ends such a wait, if anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from ..runtime.abort import group_timeout_s
from ..runtime.compat import group_store
from ..runtime.daemons import backend_callback, stop_at_exit
from ..runtime.errors import CommunicationError
from ..runtime.group_context import context_of
from ..runtime.observer import ExecutionObserver
from .liveness import LocalEvidence, continue_stopped, this_process
from .options import TelemetryOptions, group_log_dir
from .stall_report import ALL_REDUCE, BUSY, Finding, RankRecord, Sightings, diagnose, seconds
from .watcher import BucketWatch, Watcher

logger = logging.getLogger("ddp_ring_hooks")

#: The TensorBoard text panel of the reports.
STALL_TAG = "comm/stall"
#: Finished buckets the flight recorder keeps (the dump lists them).
FLIGHT_RECORDER_BUCKETS = 64
#: How long the watchdog waits for the store to answer before it reports without the others.
STORE_ANSWER_S = 2.0
#: After aborting the group's transfers, how long the watchdog waits for the blocked threads to
#: leave their waits before it fails the buckets' Futures.
LET_GO_S = 2.0
#: ``stall_timeout=None`` fails at this share of the group's own timeout: before the backend.
GROUP_TIMEOUT_SHARE = 0.9
#: A live rank publishes at least every HEARTBEAT_POLLS polls; unchanged for SILENT_POLLS is silent.
HEARTBEAT_POLLS, SILENT_POLLS = 2, 5
#: Polls of a record unchanged before /proc's view of a local rank is decided (running or idle).
EVIDENCE_POLLS = 2


class RankStalledWarning(RuntimeWarning):
    """A bucket has waited ``stall_after`` seconds; the message names the stalled rank."""


class RankStalledError(CommunicationError):
    """A bucket waited ``stall_timeout`` seconds without progress (``finding``: who is stalled;
    ``remedy``: what becomes of the stalled rank, or what to do about it)."""

    def __init__(self, finding: Finding, *, waited: float, timeout: float, remedy: str = "") -> None:
        self.finding = finding
        super().__init__(
            f"{finding.text}; no progress for {seconds(waited)} (stall_timeout={timeout:g} s), so this bucket failed "
            "and the hook aborted the process group's transfers, letting this process exit" + (f". {remedy}" if remedy else "")
        )


def check_stall_timeout(options: TelemetryOptions, group) -> None:
    """Refuse a ``stall_timeout`` the group's own timeout would beat (``HookState`` checks it
    when it is built, where the group is known)."""
    if options.stall_timeout is None or not (dist.is_available() and dist.is_initialized()):
        return
    own = group_timeout_s(group)
    if options.stall_timeout >= own:
        raise ValueError(
            f"stall_timeout={options.stall_timeout:g} s is not shorter than the process group's own timeout "
            f"({own:g} s): the backend would fail first, with an error that names no rank; pass a shorter "
            "stall_timeout, or give the group a longer one (init_process_group(timeout=...))"
        )


@backend_callback  # on the thread that settles the guard: gloo's, after a native bucket
def _result(future: torch.futures.Future):
    return future.value()


class _BucketProgress(ExecutionObserver):
    """One bucket as the watchdog sees it: one tuple replaced at every mark (a single store
    from the thread running the bucket, read whole by the watchdog), and the Future DDP gets."""

    def __init__(self, watchdog: StallWatchdog, bucket: BucketWatch) -> None:
        self.watchdog = watchdog
        self.iteration = bucket.step - 1
        self.index = bucket.index
        self.is_last = bucket.is_last
        self.algorithm = bucket.algorithm
        self.nbytes = bucket.nbytes
        self.on_gpu = not bucket.timer.on_host
        self.handed = time.monotonic()
        #: (since, phase, step index, steps, peer) once the all-reduce started; None: queued.
        self.state: tuple | None = None
        self.started: float | None = None
        self.finished: float | None = None
        self.explain = None  # how the hook state names this bucket's failure (see launched)
        self.gpu_done = None  # a CUDA event after the bucket's work (on CUDA)
        self._guarded: torch.futures.Future | None = None
        self._settled = False
        self._let_go = False  # the real completion came (or the failure of its wait)
        self._lock = threading.Lock()

    # -- the executor's calls (the thread running the bucket) ----------------------------------

    def on_phase(self, phase: str) -> None:
        self.state = (time.monotonic(), phase, None, None, None)
        if self.started is None:
            self.started = self.state[0]

    def on_wait(self, index: int, num_steps: int, peer: int) -> None:
        self.state = (time.monotonic(), self.state[1] if self.state else None, index, num_steps, peer)

    def on_step(self, index, step, chunk_bytes) -> None:
        self.state = (time.monotonic(), self.state[1] if self.state else None, None, None, None)

    def on_finish(self) -> None:
        if self.on_gpu:  # enqueued, not done: watched until an event after it completes
            self.gpu_done = torch.cuda.Event()
            self.gpu_done.record()
            self.state = (time.monotonic(), "on the GPU", None, None, None)
        else:
            self.watchdog.finished(self)

    # -- the Future DDP waits on -------------------------------------------------------------

    def guard(self, future: torch.futures.Future) -> torch.futures.Future:
        """A Future that completes with ``future``, unless :meth:`fail` comes first."""
        self._guarded = torch.futures.Future()
        future.add_done_callback(self._settle)
        # DDP reads a failed Python Future as a value: a callback that re-raises keeps the error.
        return self._guarded.then(_result)

    def _settle(self, done: torch.futures.Future) -> None:
        self._let_go = True
        with self._lock:
            if self._settled:  # failed at stall_timeout already: the late completion is ignored
                return
            self._settled = True
        try:
            value = done.value()
        except BaseException as error:  # noqa: BLE001 - it goes to DDP through the Future
            self.watchdog.finished(self)  # a failed all-reduce never reaches on_finish
            self._guarded.set_exception(error)
        else:
            self._guarded.set_result(value)

    def claim(self, error: RankStalledError) -> BaseException | None:
        """Take the bucket's Future from its real completion, to fail it with ``error`` as the
        hook state names it (which the hook state remembers: later buckets are refused with
        it); ``None`` if it completed already (or is not guarded: CUDA)."""
        with self._lock:
            if self._guarded is None or self._settled:
                return None
            self._settled = True
        return self.explain(error) if self.explain is not None else error

    def fail(self, failure: BaseException, *, let_go_by: float) -> None:
        """Fail the claimed Future with ``failure``, once the thread that ran the bucket has
        left its wait (or at the monotonic time ``let_go_by``)."""
        while not self._let_go and time.monotonic() < let_go_by:  # rare: a flag, not an Event per bucket
            time.sleep(0.01)
        self._guarded.set_exception(failure)

    def record(self) -> FinishedBucket:
        """What the flight recorder keeps of it, once finished (no reference to the bucket)."""
        return FinishedBucket(self.iteration, self.index, self.algorithm, self.nbytes, self.handed, self.started,
                              self.finished)

    def describe(self, wall_offset: float, now: float) -> dict:
        """This open bucket for the dump: what it is, when it was handed over, where it waits."""
        since, phase, index, steps, peer = self.state or (None,) * 5
        return {"iteration": self.iteration, "bucket": self.index, "algorithm": self.algorithm, "bytes": self.nbytes,
                "handed_over": round(self.handed + wall_offset, 3), "phase": phase,
                "step": None if index is None else f"{index + 1}/{steps}", "peer": peer,
                "waiting_s": None if since is None else round(now - since, 3)}


@dataclasses.dataclass(frozen=True, slots=True)
class FinishedBucket:
    """One finished bucket in the flight recorder (monotonic seconds)."""

    iteration: int
    bucket: int
    algorithm: str
    bytes: int
    handed: float
    started: float | None
    finished: float

    def describe(self, wall_offset: float) -> dict:
        return {"iteration": self.iteration, "bucket": self.bucket, "algorithm": self.algorithm, "bytes": self.bytes,
                "handed_over": round(self.handed + wall_offset, 3),
                "started_s": None if self.started is None else round(self.started - self.handed, 6),
                "finished_s": round(self.finished - self.handed, 6)}


class StallWatchdog(Watcher):
    """Names the rank everyone waits for, says when it is merely busy, and fails the wait at
    ``stall_timeout`` when it stopped reporting (see the module docstring). Built by the
    observation from its options (``stall_after``, ``stall_timeout``, ``log_dir``); its
    threads start when the hook is registered (or with the first bucket)."""

    def __init__(self, options: TelemetryOptions, recorder) -> None:
        self.stall_after = options.stall_after
        self.stall_timeout = options.stall_timeout
        self.log_dir = options.log_dir
        self.recorder = recorder
        self.poll_s = min(max(self.stall_after / 10, 0.1), 5.0)
        self.silent_after = SILENT_POLLS * self.poll_s
        #: A bucket waiting this long has the others' records read every poll: by stall_after a
        #: silent peer's number has stayed unchanged for longer than silent_after.
        self.watch_from = max(0.0, self.stall_after - self.silent_after - 2 * self.poll_s)
        #: The flight recorder: the last finished buckets (appends only on the hot path).
        self.recent: deque[FinishedBucket] = deque(maxlen=FLIGHT_RECORDER_BUCKETS)
        self._open: dict[_BucketProgress, None] = {}  # running or queued, in hand-over order
        self._training = (time.monotonic(), "starting", 0)  # (since, what, iteration)
        self._last_handed = -1  # the last iteration whose last bucket was handed over
        self._paused: tuple[str, ...] = ()  # HookState.paused, innermost last
        self._announcing: list[threading.Event] = []  # paused() callers waiting for their record
        self._steps_seen = 0
        self._group = None
        self._rank, self._world_size = 0, 1
        self._timeout_s = 0.0
        self._board: _StoreBoard | None = None
        self._me = None  # who this process is (pid, host, start), read where the threads start
        self._seq = 0
        self._sightings = Sightings()
        self._evidence: LocalEvidence | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._stall: _Stall | None = None
        #: The busy episode last named, by rank: (iteration, doing). Once each, whichever
        #: bucket of this rank waits for it (lane 1's bucket may wait on after lane 0's).
        self._told_busy: dict[int, tuple[int, str]] = {}
        self._report: str | None = None
        self.failure: RankStalledError | None = None
        self._handles: list = []
        self._closed = False
        self._lock = threading.Lock()

    # -- the hook thread ---------------------------------------------------------------------

    def attach(self, ddp_model, *, algorithm: str, concurrent_buckets: int, group) -> None:
        self._handles.append(ddp_model.register_forward_pre_hook(self._forward))
        # Report from now on: a rank whose first forward takes long (a cold torch.compile, a
        # slow data loader) is busy, not a rank that never reported.
        if self._thread is None and not self._closed and dist.is_available() and dist.is_initialized():
            group = group if group is not None else dist.group.WORLD
            self._start_on(group, rank=dist.get_rank(group), world_size=dist.get_world_size(group))

    def _forward(self, module, inputs) -> None:
        self._training = (time.monotonic(), "forward", self._steps_seen)

    @contextlib.contextmanager
    def paused(self, reason: str) -> Iterator[None]:
        """Mark planned asymmetric work (a checkpoint, an evaluation): while it lasts, a rank
        waiting for this one reports nothing and ``stall_timeout`` does not fail it (the group's
        own timeout still would). The record saying so is in the store before the work starts
        (it may hold the GIL from its first line); nestable."""
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"paused() takes a reason, a non-empty string such as 'checkpoint'; got {reason!r}")
        self._paused = (*self._paused, reason)
        try:
            self._announce()
            yield
        finally:
            index = len(self._paused) - 1 - self._paused[::-1].index(reason)
            self._paused = self._paused[:index] + self._paused[index + 1:]
            if not self._paused:  # busy from now on, if it stays away: the pause did not count
                _, doing, iteration = self._training
                self._training = (time.monotonic(), doing, iteration)
            self._wake.set()

    @property
    def pauses(self) -> tuple[str, ...]:
        """The reasons this rank is paused for now (:meth:`paused`), innermost last."""
        return self._paused

    def _announce(self) -> None:
        """Wake the watchdog and wait until this rank's record is in the store (at most
        :data:`STORE_ANSWER_S`: a store that does not answer must not stop training)."""
        if self._thread is None:
            return
        written = threading.Event()
        with self._lock:
            self._announcing.append(written)
        self._wake.set()
        written.wait(STORE_ANSWER_S)

    def on_bucket(self, bucket: BucketWatch) -> ExecutionObserver:
        if self._thread is None and not self._closed:
            self._start(bucket)
        progress = _BucketProgress(self, bucket)
        if bucket.index == 0:
            self._training = (progress.handed, "backward", progress.iteration)
        if bucket.is_last:
            self._last_handed = progress.iteration
        self._steps_seen = bucket.step
        with self._lock:
            self._open[progress] = None
        return progress

    def launched(self, bucket: BucketWatch, future: torch.futures.Future, progress: _BucketProgress | None,
                 ) -> torch.futures.Future:
        """The Future DDP waits on: one this watchdog can fail at ``stall_timeout`` (on the CPU;
        on CUDA the Future completes as the work is enqueued, long before anything could stall).
        ``progress``: what :meth:`on_bucket` returned for ``bucket``."""
        if progress is None or progress.on_gpu or future.done():
            return future
        progress.explain = bucket.explain
        return progress.guard(future)

    # -- the bucket's thread -----------------------------------------------------------------

    def finished(self, progress: _BucketProgress) -> None:
        """``progress``'s all-reduce is over (done, failed, or its GPU event completed)."""
        now = time.monotonic()
        with self._lock:
            if self._open.pop(progress, False) is False:
                return
            idle = not self._open
        progress.finished = now
        self.recent.append(progress.record())
        if idle and self._last_handed == progress.iteration:  # the step's buckets may end in any order
            self._training = (now, "after the all-reduce", progress.iteration)
            # Publish it now, not at the next poll: what comes next (a checkpoint) may hold the
            # GIL, and then the others would only ever see this rank in its backward.
            self._wake.set()

    # -- the watchdog thread -----------------------------------------------------------------

    def _start(self, bucket: BucketWatch) -> None:
        self._start_on(bucket.group, rank=bucket.rank, world_size=bucket.world_size)

    def _start_on(self, group, *, rank: int, world_size: int) -> None:
        self._group, self._rank, self._world_size = group, rank, world_size
        if self._world_size == 1:
            return
        self._timeout_s = self.stall_timeout or GROUP_TIMEOUT_SHARE * group_timeout_s(self._group)
        self._me = this_process()  # here, not when built: a state may be built before a fork
        self._evidence = LocalEvidence(host=self._me.host, min_window=EVIDENCE_POLLS * self.poll_s)
        self._board = _StoreBoard(self._group, rank=self._rank, world_size=self._world_size)
        self._thread = threading.Thread(target=self._watch, name="ddp-ring-hooks-stall", daemon=True)
        self._thread.start()
        stop_at_exit(self)  # a script that fails never closes it

    def _watch(self) -> None:
        published, published_at = None, 0.0
        while True:  # publishes at once: a rank that stalls right away has reported once
            now = time.monotonic()
            self._poll_gpu(now)
            waiting, state = self._longest_wait()  # state: read once, the bucket's thread moves on
            record = self._record(waiting, state, now)
            content = (record.iteration, record.doing, record.since, record.bucket, record.step_index, record.peer,
                       record.paused)
            with self._lock:
                announced, self._announcing = self._announcing, []
            since_published = now - published_at
            # A change at most twice a poll (a step's end wakes this thread, and steps may be
            # many a second: the store serves every rank); a heartbeat every few polls.
            if (announced or (content != published and since_published >= self.poll_s / 2)
                    or since_published >= HEARTBEAT_POLLS * self.poll_s):
                self._seq += 1
                self._board.publish(dataclasses.replace(record, seq=self._seq), written=announced)
                published, published_at = content, now
            if self.failure is None:  # after the timeout, nothing is reported again
                self._judge(waiting, state, dataclasses.replace(record, seq=self._seq), now)
            # A change held back by the limit goes out as soon as the limit allows, not a whole
            # poll later: a step's end must reach the store before what follows it (a
            # checkpoint) may take the GIL, within half a poll.
            held_back = content != published
            self._wake.wait(max(0.0, self.poll_s / 2 - since_published) if held_back else self.poll_s)
            self._wake.clear()
            if self._stop.is_set():
                return

    def _judge(self, waiting: _BucketProgress | None, state: tuple | None, record: RankRecord, now: float) -> None:
        """Watch a wait that lasts: read the others from :attr:`watch_from` on, judge from
        ``stall_after`` on; say when the wait reported is over."""
        if self._stall is not None and not (waiting is not None and self._stall.is_wait(waiting, state)):
            self._wait_over()
        if waiting is None or now - state[0] < self.watch_from:
            return
        others = self._look()
        now = time.monotonic()  # as of the store's answer: the others' records are placed there
        if now - state[0] >= min(self.stall_after, self._timeout_s):
            self._on_wait(waiting, state[0], dataclasses.replace(record, reported=now), others, now)

    def _look(self) -> dict[int, RankRecord] | None:
        """Every other rank's record on this rank's clock, with what ``/proc`` shows of a local
        one that stopped reporting; ``None`` if the store did not answer."""
        read = self._board.read(timeout=STORE_ANSWER_S)
        if read is None:
            return None
        seen_at = time.monotonic()
        placed = self._sightings.place(read, seen_at=seen_at)
        return {rank: self._with_evidence(rank, record, seen_at) for rank, record in placed.items()}

    def _with_evidence(self, rank: int, record: RankRecord, now: float) -> RankRecord:
        process = self._evidence.judge(rank, host=record.host, pid=record.pid, started=record.started,
                                       number=(record.attempt, record.seq), unchanged_for=now - record.reported, now=now)
        return record if process is None else dataclasses.replace(record, process=process)

    def _poll_gpu(self, now: float) -> None:
        """CUDA buckets are done when their event is (a query, never a wait); they run one after
        the other on the stream, so the first one not done starts to count when the one before it is."""
        with self._lock:
            on_gpu = [progress for progress in self._open if progress.gpu_done is not None]
        previous_done = False
        for progress in on_gpu:
            if not progress.gpu_done.query():
                if previous_done:
                    progress.state = (now, *progress.state[1:])
                return
            self.finished(progress)
            previous_done = True

    def _longest_wait(self) -> tuple[_BucketProgress | None, tuple | None]:
        """The running bucket that has made no progress for the longest, and its state."""
        with self._lock:
            running = [(progress, progress.state) for progress in self._open]
        running = [(progress, state) for progress, state in running if state is not None]
        return min(running, key=lambda pair: pair[1][0], default=(None, None))

    def _record(self, waiting: _BucketProgress | None, state: tuple | None, now: float) -> RankRecord:
        """This rank's state, on its own monotonic clock (readers place it on theirs)."""
        common = {"rank": self._rank, "reported": now, "silent_after": self.silent_after,
                  "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                  "paused": self._paused[-1] if self._paused else None,
                  "pid": self._me.pid, "host": self._me.host, "started": self._me.started}
        if waiting is None:
            since, doing, iteration = self._training
            return RankRecord(iteration=iteration, doing=doing, since=since, **common)
        since, phase, index, steps, peer = state
        return RankRecord(
            iteration=waiting.iteration, doing=ALL_REDUCE, since=since, bucket=waiting.index,
            algorithm=waiting.algorithm, phase=phase, step_index=index, num_steps=steps, peer=peer, **common,
        )

    def _on_wait(self, waiting: _BucketProgress, since: float, record: RankRecord, others, now: float) -> None:
        """A wait of ``stall_after`` or more: judge it each poll, say what changed, fail it at the
        timeout if a rank stopped reporting."""
        waited = now - since
        finding = diagnose(record, others, world_size=self._world_size, now=now)
        self._report = finding.text
        if self._stall is None:
            self._stall = _Stall(waiting, since)
        stall = self._stall
        if finding.aborts and waited >= self._timeout_s:
            self._time_out(finding, others, waited)
            return
        if finding.aborts:
            if stall.reports and waited < stall.next_report:
                return
            stall.next_report = (waited // self.stall_after + 1) * self.stall_after
            logger.warning(finding.text)
            if stall.reports == 0:
                warnings.warn(finding.text, RankStalledWarning, stacklevel=1)
            stall.reports += 1
            self._publish(finding.text, others, finding, iteration=waiting.iteration)
        elif finding.kind == BUSY and self._new_busy(finding, others, now):
            logger.warning(finding.text)  # once per busy episode: no warning, no dump
            self._publish(finding.text, None, None, iteration=waiting.iteration)
        elif finding.kind != stall.kind:
            logger.debug(finding.text)  # paused, moving data, a cycle of reporting ranks
        stall.kind = finding.kind

    def _new_busy(self, finding: Finding, others: dict[int, RankRecord], now: float) -> bool:
        """Whether ``finding`` names a rank busy for ``stall_after`` or longer in an episode not
        named yet (and remember it). Shorter: this wait is older than its being away (it was
        paused, say), and the next polls will tell."""
        episodes = {rank: (others[rank].iteration, others[rank].doing) for rank in finding.busy
                    if rank in others and now - others[rank].since >= self.stall_after}
        new = any(self._told_busy.get(rank) != episode for rank, episode in episodes.items())
        self._told_busy.update(episodes)
        return new

    def _wait_over(self) -> None:
        stall, self._stall = self._stall, None
        self._report = None
        if stall.reports == 0:  # busy, paused, in flight: nothing to take back
            return
        progress = stall.progress
        moved = progress.finished if progress.finished is not None else progress.state[0]
        text = (f"rank {self._rank}: bucket {progress.index} of iteration {progress.iteration} resumed after "
                f"{seconds(max(moved, stall.since) - stall.since)}")
        logger.warning(text)
        self._publish(text, None, None, iteration=progress.iteration)

    def _time_out(self, finding: Finding, others: dict | None, waited: float) -> None:
        stopped = _stopped_here(finding, others)
        error = self.failure = RankStalledError(finding, waited=waited, timeout=self._timeout_s,
                                                remedy=_remedy(finding, others, stopped))
        logger.error(str(error))
        self._publish(str(error), others, finding, iteration=self._stall.progress.iteration, timed_out=True)
        with self._lock:
            open_buckets = sorted(self._open, key=lambda progress: progress is not self._stall.progress)
        # The waiting bucket first: the hook state names it first.
        claimed = [(progress, progress.claim(error)) for progress in open_buckets]
        stuck_on = self._stall.progress.state[4]  # the peer this rank waits for (None: native)
        self._stall = None
        # Let the blocked threads go *before* DDP hears of the failure: a thread still inside
        # gloo's wait when the training script ends is killed by the interpreter's exit, and
        # that aborts the process ("terminate called without an active exception").
        context_of(self._group).abort(peer=stuck_on)
        self._continue(stopped)
        let_go_by = time.monotonic() + LET_GO_S
        for progress, failure in claimed:
            if failure is not None:
                progress.fail(failure, let_go_by=let_go_by)

    def _continue(self, stopped: dict[int, RankRecord]) -> None:
        """After the abort, so the stopped ranks resume into a group that fails them: ``SIGCONT``."""
        for rank, record in stopped.items():
            if continue_stopped(record.pid, record.started):
                logger.warning(f"rank {self._rank}: sent SIGCONT to rank {rank} (pid {record.pid}), stopped on this host, "
                               "so that it runs into the aborted group, fails and exits")

    def _publish(self, text: str, others, finding: Finding | None, *, iteration: int, timed_out: bool = False) -> None:
        """The report's panel and this rank's dump (with a ``log_dir``)."""
        if self.log_dir is None:
            return
        self.recorder.write_text(STALL_TAG, text, group=self._group, step=iteration)
        if finding is not None:
            self._dump(finding, others, timed_out=timed_out)

    def _dump(self, finding: Finding, others: dict | None, *, timed_out: bool) -> None:
        now = time.monotonic()
        wall = time.time() - now  # this rank's own clock, for people: no verdict reads it
        with self._lock:
            open_buckets = list(self._open)
        dump = {
            "rank": self._rank, "world_size": self._world_size, "written": round(now + wall, 3),
            "stall_after": self.stall_after, "stall_timeout": self._timeout_s, "timed_out": timed_out,
            "finding": finding.to_dict(),
            "records": None if others is None else {str(rank): vars(record) for rank, record in sorted(others.items())},
            "open_buckets": [progress.describe(wall, now) for progress in open_buckets],
            "last_buckets": [finished.describe(wall) for finished in list(self.recent)],
        }
        directory = group_log_dir(self.log_dir, self._group)
        path = os.path.join(directory, f"stall_rank{self._rank}.json")
        try:
            os.makedirs(directory, exist_ok=True)
            with open(path + ".tmp", "w") as file:
                json.dump(dump, file, indent=1)
            os.replace(path + ".tmp", path)
        except OSError as error:
            logger.warning("could not write %s: %s", path, error)

    # -- reading -----------------------------------------------------------------------------

    def report(self) -> str | None:
        """The latest finding while a bucket waits ``stall_after`` or longer (``None`` otherwise):
        who is stalled, busy or paused."""
        return self._report

    # -- closing -----------------------------------------------------------------------------

    def close(self) -> None:
        self._closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.stop_threads(timeout=None)

    def stop_threads(self, timeout: float | None) -> None:
        """Stop the watchdog's thread and its store exchange, waiting at most ``timeout``
        seconds for them (``None``: the watchdog as long as it takes; at exit: ``runtime/daemons.py``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._board is not None and deadline is None:
            self._board.close()
        elif self._board is not None:
            self._board.stop_threads(max(0.0, deadline - time.monotonic()))


def _stopped_here(finding: Finding, others: dict[int, RankRecord] | None) -> dict[int, RankRecord]:
    """The stalled ranks that ``/proc`` shows stopped by a signal, on this host."""
    return {rank: others[rank] for rank in finding.stalled
            if others is not None and rank in others and others[rank].process == "stopped"}


def _remedy(finding: Finding, others: dict[int, RankRecord] | None, stopped: dict[int, RankRecord]) -> str:
    """What becomes of the stalled ranks, in one sentence (the error says it)."""
    if stopped:
        names = ", ".join(f"rank {rank} (pid {record.pid})" for rank, record in stopped.items())
        return f"{names}: stopped on this host; this rank continues it (SIGCONT) after the abort, so it fails and exits"
    elsewhere = [(rank, others[rank]) for rank in finding.stalled if others is not None and rank in others
                 and others[rank].process is None and others[rank].pid is not None][:3]
    if not elsewhere:
        return ""
    names = ", ".join(f"rank {rank} (pid {record.pid})" for rank, record in elsewhere)
    return (f"If {names} stays stopped on its host (nothing here can reach it), its launcher may wait for it: "
            f"end it there (kill -CONT {elsewhere[0][1].pid}, or kill -KILL {elsewhere[0][1].pid})")


class _Stall:
    """The wait being watched: which bucket, since when, how often reported as stalled, the
    next time, and the last verdict."""

    def __init__(self, progress: _BucketProgress, since: float) -> None:
        self.progress = progress
        self.since = since
        self.reports = 0
        self.next_report = 0.0
        self.kind: str | None = None

    def is_wait(self, progress: _BucketProgress, state: tuple) -> bool:
        return progress is self.progress and state[0] == self.since


class _StoreBoard:
    """Every rank's record in the process group's store, written and read on a thread of its
    own: a store whose server is stuck (hosted by the frozen rank, say) blocks only this thread,
    and the watchdog waits for it at most :data:`STORE_ANSWER_S`.

    A read is one ``multi_get`` of the other ranks' keys: one round trip, however many ranks
    (until every rank has published once it checks first, and reads the keys there are one
    by one). ``multi_get`` waits for a missing key, so no rank deletes its own while the others
    may read it: at :meth:`close` each rank counts itself out, and the last one deletes every key."""

    def __init__(self, group, *, rank: int, world_size: int, store=None, prefix: str | None = None) -> None:
        # The group's own store, not a clone: a clone is a second connection to the same server,
        # no help when that server is the one stuck, and one more socket per rank on it. Its
        # calls are serialized by the store client itself.
        self._store = group_store(group) if store is None else store
        prefix = f"ddp_ring_hooks/stall/{_board_index(group)}" if prefix is None else prefix
        self._keys = [f"{prefix}/{r}" for r in range(world_size)]
        self._others = [key for r, key in enumerate(self._keys) if r != rank]
        self._closed_key = f"{prefix}/closed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self._rank = rank
        self._world_size = world_size
        self._everyone_published = False
        self._pending: RankRecord | None = None
        self._written: list[threading.Event] = []  # set once the pending record is in the store
        self._read_wanted = False
        self._read_at = -1.0
        self._read: dict[int, RankRecord] | None = None
        self._stopping = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ddp-ring-hooks-stall-store", daemon=True)
        self._thread.start()

    def publish(self, record: RankRecord, *, written: list[threading.Event] = ()) -> None:
        """Write ``record`` soon (a newer one replaces it if the store is slow); set each of
        ``written`` once it (or a newer one) is in the store."""
        with self._changed:
            self._pending = record
            self._written.extend(written)
            self._changed.notify()

    def read(self, *, timeout: float) -> dict[int, RankRecord] | None:
        """Every other rank's latest record, read now; ``None`` if the store did not answer
        within ``timeout`` seconds."""
        asked = time.monotonic()
        with self._changed:
            self._read_wanted = True
            self._changed.notify()
            if not self._changed.wait_for(lambda: self._read_at >= asked, timeout):
                return None
            return self._read

    def close(self) -> None:
        self.stop_threads(STORE_ANSWER_S)

    def stop_threads(self, timeout: float) -> None:
        """Stop the exchange's thread (after it counts this rank out), waiting up to ``timeout``
        seconds: it may be stuck in a store that never answers."""
        with self._changed:
            self._stopping = True
            self._changed.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._stopping or self._pending is not None or self._read_wanted)
                if self._stopping:
                    break
                record, self._pending = self._pending, None
                written, self._written = self._written, []
                reading, self._read_wanted = self._read_wanted, False
            read = self._exchange(record, reading)
            for event in written:
                event.set()
            if reading:
                with self._changed:
                    self._read, self._read_at = read, time.monotonic()
                    self._changed.notify_all()
        self._retire()

    def _exchange(self, record: RankRecord | None, reading: bool) -> dict[int, RankRecord] | None:
        try:
            if record is not None:
                self._store.set(self._keys[self._rank], record.to_json())
            if not reading:
                return None
            if not self._everyone_published:
                if not self._store.check(self._others):
                    return self._read_one_by_one()
                self._everyone_published = True
            values = self._store.multi_get(self._others)
            ranks = [r for r in range(self._world_size) if r != self._rank]
            return {rank: RankRecord.from_json(value) for rank, value in zip(ranks, values)}
        except (RuntimeError, ValueError) as error:  # the store failed (DistStoreError) or a record is garbled
            self._everyone_published = False  # a key gone (a run before a restart retiring): check again
            logger.debug("the stall watchdog's store exchange failed: %s", error)
            return None

    def _read_one_by_one(self) -> dict[int, RankRecord]:
        """Before every rank has published: the keys there are (two round trips each)."""
        return {
            rank: RankRecord.from_json(self._store.get(key))
            for rank, key in enumerate(self._keys) if rank != self._rank and self._store.check([key])
        }

    def _retire(self) -> None:
        """Count this rank out; the last one deletes every key (a FileStore would otherwise keep
        every record ever written). A rank that never closes leaves them."""
        try:
            if self._store.add(self._closed_key, 1) == self._world_size:
                for key in (*self._keys, self._closed_key):
                    self._store.delete_key(key)
        except (RuntimeError, ValueError) as error:
            logger.debug("the stall watchdog could not retire its keys: %s", error)


_BOARDS: dict[str, int] = {}
_BOARDS_LOCK = threading.Lock()


def _board_index(group) -> int:
    """Hook states on one group, numbered in the order their watchdogs start (the same on
    every rank): each publishes under keys of its own."""
    name = distributed_c10d._get_process_group_name(group)
    with _BOARDS_LOCK:
        index = _BOARDS[name] = _BOARDS.get(name, -1) + 1
    return index
