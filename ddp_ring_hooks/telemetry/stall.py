"""``StallWatchdog``: a rank that stops answering never hangs the others silently.

A dead peer closes its sockets and gloo fails at once. A peer that is alive but silent
(stopped, blocked in I/O or a deadlock, cut off by the network, a hung GPU) leaves the others
waiting for the group's timeout, 30 minutes on gloo, and then its message names no rank. This
watcher of the observation (:mod:`.observation`) names it, in four parts::

    hot path (hook, worker)       watchdog thread (sleeps)             store thread
    -----------------------       ----------------------------         ------------------------
    on_phase / on_wait / on_step  every poll: this rank's state  --->  set  stall/{rank}
      a timestamp, and whom it      (changed, or a heartbeat)           (latest wins)
      now waits for               a bucket waited stall_after:  --->  get every rank's record
    forward, first bucket:          diagnose who waits for whom  <---   (bounded wait: a store
      what training does            (:func:`.stall_report.diagnose`)     may be stuck itself)
                                  log + warn + comm/stall + dump
                                  stall_timeout: fail the bucket's
                                    Future, abort the group

1. **Marks.** Each bucket's observer keeps one tuple (since when, phase, schedule step, the peer
   it now waits for; the executor says which, ``ExecutionObserver.on_wait``); every
   transfer completed replaces it, so progress resets the clock. ``native`` (gloo's own
   all-reduce) has no waits of ours: its bucket waits from issue to gloo's callback, and the
   peer is named through the store only. On CUDA a bucket is watched until an event recorded
   after it completes (``event.query()`` on this thread: never a host sync).
2. **Liveness.** Every poll (``stall_after / 10``, 0.1-5 s) the watchdog publishes this rank's
   state through the process group's store (the store the group was built on: torchrun's
   TCPStore or the file store; it keeps working when a peer stops answering over gloo) when
   it changed, or as a heartbeat: one small ``set`` per poll at most, from this thread.
3. **Report.** When a bucket has waited ``stall_after`` seconds without progress, the watchdog
   reads every rank's record, follows who waits for whom and names the rank at the end of the
   chain: through the ``ddp_ring_hooks`` logger (each report; the first also as a
   :class:`RankStalledWarning`) and, with a ``log_dir``, the ``comm/stall`` text panel and
   ``stall_rank{r}.json`` (the finding, every rank's record, this rank's open buckets and its
   last :data:`FLIGHT_RECORDER_BUCKETS` buckets: the flight recorder, always on). Repeated
   every ``stall_after`` while the stall lasts; ``resumed after 14 s`` when it ends.
4. **Timeout.** After ``stall_timeout`` seconds the bucket's Future fails (the one DDP waits
   on, :meth:`StallWatchdog.launched`: the real completion, if it ever comes, is ignored) with
   a :class:`RankStalledError` that the hook state names as a ``HookFailedError``, every other
   open bucket with it, and the group's transfers are aborted
   (the group context's :meth:`~ddp_ring_hooks.runtime.group_context.GroupContext.abort`: the
   group and everything made for it, per device): blocked threads are let go, the
   peers' transfers with this rank fail at once, the process can exit and torchrun restart it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import warnings
from collections import deque

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from ..runtime.abort import group_timeout_s
from ..runtime.compat import group_store
from ..runtime.errors import CommunicationError
from ..runtime.group_context import context_of
from ..runtime.observer import ExecutionObserver
from .options import TelemetryOptions, group_log_dir
from .stall_report import ALL_REDUCE, Finding, RankRecord, diagnose, seconds
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
#: A live rank publishes at least every HEARTBEAT_POLLS polls; older than SILENT_POLLS is silent.
HEARTBEAT_POLLS, SILENT_POLLS = 2, 5


class RankStalledWarning(RuntimeWarning):
    """A bucket has waited ``stall_after`` seconds; the message names the stalled rank."""


class RankStalledError(CommunicationError):
    """A bucket waited ``stall_timeout`` seconds without progress (``finding``: who is stalled)."""

    def __init__(self, finding: Finding, *, waited: float, timeout: float) -> None:
        self.finding = finding
        super().__init__(
            f"{finding.text}; no progress for {seconds(waited)} (stall_timeout={timeout:g} s), so this bucket failed "
            "and the hook aborted the process group's transfers, letting this process exit"
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
    """Names the rank everyone waits for, and fails the wait at ``stall_timeout`` (see the
    module docstring). Built by the observation from its options (``stall_after``,
    ``stall_timeout``, ``log_dir``); its threads start with the first bucket."""

    def __init__(self, options: TelemetryOptions, recorder) -> None:
        self.stall_after = options.stall_after
        self.stall_timeout = options.stall_timeout
        self.log_dir = options.log_dir
        self.recorder = recorder
        self.poll_s = min(max(self.stall_after / 10, 0.1), 5.0)
        #: The flight recorder: the last finished buckets (appends only on the hot path).
        self.recent: deque[FinishedBucket] = deque(maxlen=FLIGHT_RECORDER_BUCKETS)
        self._open: dict[_BucketProgress, None] = {}  # running or queued, in hand-over order
        self._training = (time.monotonic(), "starting", 0)  # (since, what, iteration)
        self._steps_seen = 0
        self._group = None
        self._rank, self._world_size = 0, 1
        self._timeout_s = 0.0
        self._board: _StoreBoard | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._stall: _Stall | None = None
        self._report: str | None = None
        self.failure: RankStalledError | None = None
        self._handles: list = []
        self._closed = False
        self._lock = threading.Lock()

    # -- the hook thread ---------------------------------------------------------------------

    def attach(self, ddp_model, *, algorithm: str, concurrent_buckets: int, group) -> None:
        self._handles.append(ddp_model.register_forward_pre_hook(self._forward))

    def _forward(self, module, inputs) -> None:
        self._training = (time.monotonic(), "forward", self._steps_seen)

    def on_bucket(self, bucket: BucketWatch) -> ExecutionObserver:
        if self._thread is None and not self._closed:
            self._start(bucket)
        progress = _BucketProgress(self, bucket)
        if bucket.index == 0:
            self._training = (progress.handed, "backward", progress.iteration)
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
        if idle and progress.is_last:
            self._training = (now, "after the all-reduce", progress.iteration)

    # -- the watchdog thread -----------------------------------------------------------------

    def _start(self, bucket: BucketWatch) -> None:
        self._group, self._rank, self._world_size = bucket.group, bucket.rank, bucket.world_size
        if self._world_size == 1:
            return
        self._timeout_s = self.stall_timeout or GROUP_TIMEOUT_SHARE * group_timeout_s(self._group)
        self._board = _StoreBoard(self._group, rank=self._rank, world_size=self._world_size)
        self._thread = threading.Thread(target=self._watch, name="ddp-ring-hooks-stall", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        published, published_at = None, 0.0
        while True:  # publishes at once: a rank that stalls right away has reported once
            now = time.monotonic()
            self._poll_gpu(now)
            waiting, state = self._longest_wait()  # state: read once, the bucket's thread moves on
            record = self._record(waiting, state, now)
            content = (record.iteration, record.doing, record.since, record.bucket, record.step_index, record.peer)
            if content != published or now - published_at >= HEARTBEAT_POLLS * self.poll_s:
                self._board.publish(record)
                published, published_at = content, now
            if self.failure is None:  # after the timeout, nothing is reported again
                self._judge(waiting, state, record, now)
            if self._stop.wait(self.poll_s):
                return

    def _judge(self, waiting: _BucketProgress | None, state: tuple | None, record: RankRecord, now: float) -> None:
        """Report a wait that lasts, or that the one reported is over."""
        stalled = waiting is not None and now - state[0] >= min(self.stall_after, self._timeout_s)
        if self._stall is not None and not (stalled and self._stall.is_wait(waiting, state)):
            self._resumed()
        if stalled:
            self._on_stall(waiting, state[0], record, now)

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
        wall = time.time() - now  # monotonic -> wall clock, for the other ranks
        common = {"rank": self._rank, "reported": now + wall, "silent_after": SILENT_POLLS * self.poll_s,
                  "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
        if waiting is None:
            since, doing, iteration = self._training
            return RankRecord(iteration=iteration, doing=doing, since=since + wall, **common)
        since, phase, index, steps, peer = state
        return RankRecord(
            iteration=waiting.iteration, doing=ALL_REDUCE, since=since + wall, bucket=waiting.index,
            algorithm=waiting.algorithm, phase=phase, step_index=index, num_steps=steps, peer=peer, **common,
        )

    def _on_stall(self, waiting: _BucketProgress, since: float, record: RankRecord, now: float) -> None:
        waited = now - since
        timed_out = waited >= self._timeout_s
        if self._stall is None:
            self._stall = _Stall(waiting, since)
        elif waited < self._stall.next_report and not timed_out:
            return
        self._stall.next_report = (waited // self.stall_after + 1) * self.stall_after
        others = self._board.read(timeout=STORE_ANSWER_S)
        # As of this poll (the record's time), not of the store's answer.
        finding = diagnose(record, others, world_size=self._world_size, now=record.reported)
        self._report = finding.text
        if timed_out:
            self._time_out(finding, others, waited)
            return
        logger.warning(finding.text)
        if self._stall.reports == 0:
            warnings.warn(finding.text, RankStalledWarning, stacklevel=1)
        self._stall.reports += 1
        self._publish(finding.text, others, finding, iteration=waiting.iteration)

    def _resumed(self) -> None:
        stall, self._stall = self._stall, None
        self._report = None
        progress = stall.progress
        moved = progress.finished if progress.finished is not None else progress.state[0]
        text = (f"rank {self._rank}: bucket {progress.index} of iteration {progress.iteration} resumed after "
                f"{seconds(max(moved, stall.since) - stall.since)}")
        logger.warning(text)
        self._publish(text, None, None, iteration=progress.iteration)

    def _time_out(self, finding: Finding, others: dict | None, waited: float) -> None:
        error = self.failure = RankStalledError(finding, waited=waited, timeout=self._timeout_s)
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
        let_go_by = time.monotonic() + LET_GO_S
        for progress, failure in claimed:
            if failure is not None:
                progress.fail(failure, let_go_by=let_go_by)

    def _publish(self, text: str, others, finding: Finding | None, *, iteration: int, timed_out: bool = False) -> None:
        """The report's panel and this rank's dump (with a ``log_dir``)."""
        if self.log_dir is None:
            return
        self.recorder.write_text(STALL_TAG, text, group=self._group, step=iteration)
        if finding is not None:
            self._dump(finding, others, timed_out=timed_out)

    def _dump(self, finding: Finding, others: dict | None, *, timed_out: bool) -> None:
        now = time.monotonic()
        wall = time.time() - now
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
        """The latest finding while a stall lasts (``None`` when nothing waits too long)."""
        return self._report

    # -- closing -----------------------------------------------------------------------------

    def close(self) -> None:
        self._closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._board is not None:
            self._board.close()


class _Stall:
    """The wait being reported: which bucket, since when, how often reported, the next time."""

    def __init__(self, progress: _BucketProgress, since: float) -> None:
        self.progress = progress
        self.since = since
        self.reports = 0
        self.next_report = 0.0

    def is_wait(self, progress: _BucketProgress, state: tuple) -> bool:
        return progress is self.progress and state[0] == self.since


class _StoreBoard:
    """Every rank's record in the process group's store, written and read on a thread of its
    own: a store whose server is stuck (hosted by the frozen rank, say) blocks only this thread,
    and the watchdog waits for it at most :data:`STORE_ANSWER_S`."""

    def __init__(self, group, *, rank: int, world_size: int) -> None:
        # The group's own store, not a clone: a clone is a second connection to the same server,
        # no help when that server is the one stuck, and one more socket per rank on it. Its
        # calls are serialized by the store client itself.
        self._store = group_store(group)
        prefix = f"ddp_ring_hooks/stall/{_board_index(group)}"
        self._keys = [f"{prefix}/{r}" for r in range(world_size)]
        self._rank = rank
        self._pending: RankRecord | None = None
        self._read_wanted = False
        self._read_at = -1.0
        self._others: dict[int, RankRecord] | None = None
        self._stopping = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ddp-ring-hooks-stall-store", daemon=True)
        self._thread.start()

    def publish(self, record: RankRecord) -> None:
        """Write ``record`` soon (a newer one replaces it if the store is slow)."""
        with self._changed:
            self._pending = record
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
            return self._others

    def close(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify()
        self._thread.join(timeout=STORE_ANSWER_S)  # it may be stuck in a store that never answers

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._stopping or self._pending is not None or self._read_wanted)
                if self._stopping:
                    return
                record, self._pending = self._pending, None
                reading, self._read_wanted = self._read_wanted, False
            others = self._exchange(record, reading)
            if reading:
                with self._changed:
                    self._others, self._read_at = others, time.monotonic()
                    self._changed.notify_all()

    def _exchange(self, record: RankRecord | None, reading: bool) -> dict[int, RankRecord] | None:
        try:
            if record is not None:
                self._store.set(self._keys[self._rank], record.to_json())
            if not reading:
                return None
            return {
                rank: RankRecord.from_json(self._store.get(key))
                for rank, key in enumerate(self._keys) if rank != self._rank and self._store.check([key])
            }
        except (RuntimeError, ValueError) as error:  # the store failed (DistStoreError) or a record is garbled
            logger.debug("the stall watchdog's store exchange failed: %s", error)
            return None


_BOARDS: dict[str, int] = {}
_BOARDS_LOCK = threading.Lock()


def _board_index(group) -> int:
    """Hook states on one group, numbered in the order their first bucket arrives (the same on
    every rank): each publishes under keys of its own."""
    name = distributed_c10d._get_process_group_name(group)
    with _BOARDS_LOCK:
        index = _BOARDS[name] = _BOARDS.get(name, -1) + 1
    return index
