"""Clocks that never stall training: take a *mark* now, turn marks into milliseconds later.

- CPU: a mark is ``time.perf_counter()`` read on the thread doing the work (the hook thread
  when a bucket is handed over, the communication worker while it runs). Ready at once.
- CUDA: a mark is a ``torch.cuda.Event`` recorded on the current stream, the stream the
  executor enqueues the communication on. Nothing waits for it: the recorder's writer thread
  asks ``event.query()`` until the last mark of a step is complete and only then reads
  ``elapsed_time`` (which needs no synchronization once both events are complete).

Every mark is read once, as a time on the host's monotonic clock (:meth:`clock_ms`), and
durations are differences of those readings: one CUDA call per mark, not one per duration.
For CUDA the reading is an *anchor* event's host time plus ``anchor.elapsed_time(mark)``; the
anchor starts as an event recorded on an idle stream of its own next to a host clock reading
(so it fires at once, not behind the kernels already queued; the alignment to the host clock
is approximate, the durations are exact) and moves up to the mark being read once that mark
is more than :data:`REANCHOR_MS` past it. ``elapsed_time`` is a 32-bit float (a 24-bit
mantissa): read from one fixed origin, marks would lose precision as the run goes on (a
quarter millisecond an hour in). Read from the last anchor, a mark carries the rounding of
the gap since the previous reading, about 6e-8 of it: 0.06 µs after a second, 0.2 ms after an
hour without a logged step (then the anchor moves up and the next readings are exact again).

Events are recycled: once a step's marks are read, :meth:`CudaTimer.release` takes them back
and later marks are recorded on them again, so a logged step creates no CUDA events (a
bucket takes three marks, every logged step).
"""

from __future__ import annotations

import collections
import threading
import time

import torch

#: How often the writer asks a pending CUDA event whether it completed. Nobody waits for the
#: answer, and every wake takes the GIL that the training thread wants: seldom is better.
_POLL_SECONDS = 0.002
#: Move the CUDA anchor up to a mark this far past it (see the module docstring).
REANCHOR_MS = 1000.0
#: Events kept for reuse per GPU (a few steps' worth of marks; more are left to the collector).
_FREE_EVENTS = 4096


class HostTimer:
    """Marks are ``time.perf_counter()`` seconds."""

    on_host = True  # marks taken on the thread doing the work, ready at once

    def mark(self) -> float:
        return time.perf_counter()

    def wait_ready(self, mark: float, deadline: float) -> bool:
        return True

    def clock_ms(self, mark: float) -> float:
        """The mark on the host's monotonic clock, in ms."""
        return mark * 1e3

    def release(self, marks) -> None:
        """Nothing to recycle: a host mark is a float."""


class CudaTimer:
    """Marks are timing events recorded on the current CUDA stream of ``device``."""

    on_host = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        with torch.cuda.device(device):
            self._anchor = torch.cuda.Event(enable_timing=True)
            self._anchor.record(torch.cuda.Stream(device))  # idle: fires now, not after queued work
        self._anchor_ms = time.perf_counter() * 1e3
        self._lock = threading.Lock()  # reading (which may move the anchor) and releasing marks
        self._free: collections.deque[torch.cuda.Event] = collections.deque()  # append/pop: thread-safe

    def mark(self) -> torch.cuda.Event:
        try:
            event = self._free.pop()
        except IndexError:
            event = torch.cuda.Event(enable_timing=True)
        # The calling thread's current stream on this timer's GPU. ``record()`` alone would take
        # ``torch.cuda.current_stream()`` of the *current* device, and "the stream's device must
        # match the event's device" (torch/cuda/streams.py): a recycled event belongs to this GPU.
        event.record(torch.cuda.current_stream(self.device))
        return event

    def release(self, marks) -> None:
        """Take back completed marks that nobody reads again, to record them anew (never the
        anchor, which later readings start from)."""
        with self._lock:
            for mark in marks:
                if mark is not self._anchor and len(self._free) < _FREE_EVENTS:
                    self._free.append(mark)

    def wait_ready(self, mark: torch.cuda.Event, deadline: float) -> bool:
        """Poll (never synchronize) until ``mark`` completed; False if ``deadline`` passed."""
        with torch.cuda.device(self.device):  # the writer thread may sit on another device
            while not mark.query():
                if time.monotonic() > deadline:
                    return False
                time.sleep(_POLL_SECONDS)
        return True

    def clock_ms(self, mark: torch.cuda.Event) -> float:
        """The completed ``mark`` on the host's monotonic clock, in ms (one CUDA call)."""
        with self._lock:
            since = self._anchor.elapsed_time(mark)
            clock = self._anchor_ms + since
            if since > REANCHOR_MS:
                self._anchor, self._anchor_ms = mark, clock
        return clock


class DeviceTimers:
    """The timer for a buffer's device: one host timer, and one CUDA-event timer per GPU made
    when that GPU's first buffer arrives."""

    def __init__(self) -> None:
        self._host = HostTimer()
        self._cuda: dict[torch.device, CudaTimer] = {}

    def for_buffer(self, buffer: torch.Tensor) -> HostTimer | CudaTimer:
        if not buffer.is_cuda:
            return self._host
        timer = self._cuda.get(buffer.device)
        if timer is None:
            timer = self._cuda[buffer.device] = CudaTimer(buffer.device)
        return timer
