"""Clocks that never stall training: take a *mark* now, turn marks into milliseconds later.

- CPU: a mark is ``time.perf_counter()`` read on the thread doing the work (the hook thread
  when a bucket is handed over, the communication worker while it runs). Ready at once.
- CUDA: a mark is a ``torch.cuda.Event`` recorded on the current stream, the stream the
  executor enqueues the communication on. Nothing waits for it: the recorder's writer thread
  asks ``event.query()`` until the last mark of a step is complete and only then reads
  ``elapsed_time`` (which needs no synchronization once both events are complete).

Both timers also place a mark on the host's monotonic clock (``start_ms``), so a trace can
lay ranks and buckets on one time axis. For CUDA this uses an origin event recorded next to
a host clock reading; the alignment is approximate (the event fires when the stream gets
there), the durations are exact.
"""

from __future__ import annotations

import time

import torch

_POLL_SECONDS = 0.0005


class HostTimer:
    """Marks are ``time.perf_counter()`` seconds."""

    def mark(self) -> float:
        return time.perf_counter()

    def wait_ready(self, mark: float, deadline: float) -> bool:
        return True

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3

    def clock_ms(self, mark: float) -> float:
        """The mark on the host's monotonic clock, in ms."""
        return mark * 1e3


class CudaTimer:
    """Marks are timing events recorded on the current CUDA stream of ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        with torch.cuda.device(device):
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
        self._origin_ms = time.perf_counter() * 1e3

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wait_ready(self, mark: torch.cuda.Event, deadline: float) -> bool:
        """Poll (never synchronize) until ``mark`` completed; False if ``deadline`` passed."""
        with torch.cuda.device(self.device):  # the writer thread may sit on another device
            while not mark.query():
                if time.monotonic() > deadline:
                    return False
                time.sleep(_POLL_SECONDS)
        return True

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end)

    def clock_ms(self, mark: torch.cuda.Event) -> float:
        return self._origin_ms + self._origin.elapsed_time(mark)


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
