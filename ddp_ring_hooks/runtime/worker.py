"""A single background thread that runs communication jobs in the order they arrive.

gloo's point-to-point work has no futures, and ``wait()`` blocks the calling thread. Running
the ring inline in a DDP hook would block the autograd thread, so backward could no longer
overlap communication. Instead the hook hands each bucket to this worker and returns a
``torch.futures.Future`` at once; the worker runs the jobs strictly first-in first-out (DDP
hands buckets over in the same order on every rank, so every rank runs the same sequence),
and completes each Future with the result or with the exception, which DDP then raises.

Workers are kept per process group and *lane* (:class:`~ddp_ring_hooks.runtime.lanes.Lane`)
by the group's context (:meth:`~ddp_ring_hooks.runtime.group_context.GroupContext.worker`). A
lane is a stream of jobs whose messages carry the lane's tag: jobs of one lane run one after
the other, jobs of different lanes may run at the same time without taking each other's
messages (gloo matches messages by peer and tag). Two hook states on the same group (two DDP
models reduced in one backward, say) share the lanes: two threads posting with the same tag to
the same peers could swap messages.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from .daemons import stop_at_exit

Result = TypeVar("Result")

_STOP = object()


class CommWorker:
    """One daemon thread, started on the first job, fed through a FIFO queue."""

    def __init__(self, name: str = "ddp-ring-hooks-comm", *, on_start: Callable[[], None] | None = None) -> None:
        self._name = name
        # Run first on every thread this worker starts (a CUDA lane sets its device and stream).
        self._on_start = on_start
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], Result], *, devices: list[torch.device] | None = None) -> torch.futures.Future:
        """Queue ``job``; the returned Future completes with its result or exception.

        ``devices``: the CUDA devices of the result's tensors; the Future then records its
        completion on the worker thread's current streams, and ``wait()`` makes the waiter's
        streams wait for them (no host sync)."""
        future: torch.futures.Future = torch.futures.Future(devices=devices)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
                stop_at_exit(self)
            self._jobs.put((job, future))
        return future

    def close(self) -> None:
        """Finish the queued jobs, then stop the thread (a later submit starts a new one).

        It waits for the thread without a timeout: a thread still running after close would
        share the queue with the next one, and two threads of one lane could reorder its
        messages."""
        self.stop_threads(timeout=None)

    def stop_threads(self, timeout: float | None) -> None:
        """:meth:`close`, waiting at most ``timeout`` seconds (at exit: ``runtime/daemons.py``;
        a job stuck in a transfer that never completes is left there)."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            self._jobs.put(_STOP)
        thread.join(timeout)

    def _run(self) -> None:
        failed_start: BaseException | None = None
        if self._on_start is not None:
            try:
                self._on_start()
            except BaseException as error:  # noqa: BLE001 - then every job fails with it, none hangs
                failed_start = error
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            job, future = item
            try:
                if failed_start is not None:
                    raise RuntimeError(f"the communication thread could not start: {failed_start}") from failed_start
                result = job()
            except BaseException as error:  # noqa: BLE001 - every failure must reach the Future
                future.set_exception(error)
            else:
                future.set_result(result)
