"""Who arrived last: every rank's bucket hand-over times, gathered after the step.

On the steps telemetry asks for (``spread_every``, the trace window), the hook state notes
when DDP handed each bucket over (first and last: the rank's *arrival*), and after the last
bucket hands a job to a worker of its own::

    hook thread       mark(first) ... mark(last) -> submit gather job
    arrivals worker   wait for the step's buckets -> [clock offsets, first run and every
                      RESYNC_EVERY gathers] -> gather (first, last, total_ms) of every rank
                      -> telemetry.record_ranks(RankArrivals) [-> trace events to rank 0]

The times come from the hook's hand-over, not from the executor, so this works the same for
every algorithm, whatever runs the bucket. The gather is point-to-point with its own tag
(:data:`ARRIVALS_TAG`), never a collective: DDP starts collectives of its own on the training
thread while this worker runs (``find_unused_parameters``' map of used parameters right after
the last bucket, ``broadcast_buffers`` in every forward), and gloo pairs collectives in the
order each process calls them, so a collective from here could pair with one of DDP's.
Point-to-point messages pair by peer and tag, in order, and every rank runs these gathers in
step order on one thread. The worker runs beside training: a gather never lengthens a step.

The messages are CPU tensors, so the group needs a CPU backend (gloo, or NCCL plus gloo as
``init_process_group()`` sets up by default); on NCCL alone the gather is skipped with a warning.
"""

from __future__ import annotations

import json
import math
import time
import warnings

import torch
import torch.distributed as dist

from ..runtime import worker_for
from ..runtime.clocks import ClockOffsets, all_gather_rows, estimate_clock_offsets, gather_bytes_to_rank0
from ..telemetry import RankArrivals, Telemetry
from ..telemetry.timer import DeviceTimers

#: The gather's message tag; bucket lanes use 0 .. concurrent_buckets - 1.
ARRIVALS_TAG = 1 << 16
#: The worker lane (a key of its own in the worker registry).
ARRIVALS_LANE = "arrivals"
#: Clock offsets across hosts are estimated again every this many gathers (clocks drift).
RESYNC_EVERY = 100
_DEADLINE_S = 60.0


class ArrivalGather:
    """The hook state's part in gathering every rank's arrival (see the module docstring)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self._timers = DeviceTimers()
        self._step = 0
        self._first = None
        self._futures: list[torch.futures.Future] = []
        self._offsets: ClockOffsets | None = None
        self._gathers = 0
        self._warned = False
        # After a failed gather the ranks' message streams may be out of step: gather no more.
        self._broken = False

    def mark(self, step: int, buffer: torch.Tensor):
        """On the hook thread, as a bucket is handed over: a clock mark if ``step`` is gathered."""
        if not self.telemetry.gathers_ranks(step):
            return None
        timer = self._timers.for_buffer(buffer)
        return timer, timer.mark()

    def track(self, mark, future: torch.futures.Future, *, step: int, is_last: bool, group) -> torch.futures.Future:
        """Note the bucket's Future; after the step's last bucket, queue the gather. Returns
        ``future`` unchanged."""
        if mark is None:
            return future
        if step != self._step:
            self._step, self._first, self._futures = step, mark, []
        self._futures.append(future)
        if is_last:
            first, futures = self._first, self._futures
            self._first, self._futures = None, []
            worker_for(group, ARRIVALS_LANE).submit(lambda: self._gather(step, first, mark, futures, group))
        return future


    # -- on the arrivals worker -------------------------------------------------------------

    def _gather(self, step: int, first, last, futures, group) -> None:
        try:
            torch.futures.wait_all(futures)
        except Exception:  # noqa: BLE001 - DDP raises the bucket's failure; the group is unusable
            # Gather no more: the peers' message streams would be out of step with ours.
            self._give_up("a bucket of this step failed")
            return
        total_ms = self.telemetry.take_step_total_ms(step)  # every bucket finished: it is there
        if self._broken:
            return
        if "gloo" not in str(dist.get_backend(group)):
            self._give_up("it sends CPU tensors and needs gloo on the group (init_process_group() without "
                          "a backend gives NCCL plus gloo)")
            return
        try:
            self._exchange(step, first, last, total_ms, group)
        except RuntimeError as error:  # a peer gone or timed out
            self._give_up(f"a gather failed: {error}")

    def _give_up(self, why: str) -> None:
        self._broken = True
        if not self._warned:
            self._warned = True
            warnings.warn(f"spread_every: no more arrival gathers on this rank: {why}", stacklevel=1)

    def _exchange(self, step: int, first, last, total_ms: float, group) -> None:
        if self._offsets is None or self._gathers % RESYNC_EVERY == 0:
            self._offsets = estimate_clock_offsets(group, tag=ARRIVALS_TAG)
        self._gathers += 1
        row = [_clock_ms(*first), _clock_ms(*last), total_ms]
        rows = all_gather_rows(row, group, tag=ARRIVALS_TAG)
        offsets = self._offsets.offsets_ms
        self.telemetry.record_ranks(RankArrivals(
            step=step,
            first_ms=tuple(r[0] - offsets[i] for i, r in enumerate(rows)),
            last_ms=tuple(r[1] - offsets[i] for i, r in enumerate(rows)),
            total_ms=tuple(r[2] for r in rows),
            offsets_ms=offsets,
            clock_error_ms=self._offsets.max_error_ms,
            rank=dist.get_rank(group),
        ))
        if self.telemetry.merges_trace_at(step):
            self._gather_trace(group)

    def _gather_trace(self, group) -> None:
        """Rank 0 receives every rank's trace events of the window, for one merged file."""
        payloads = gather_bytes_to_rank0(json.dumps(self.telemetry.local_trace_events()).encode(), group, tag=ARRIVALS_TAG)
        if payloads is not None:
            offsets = self._offsets.offsets_ms
            self.telemetry.add_peer_traces(
                [(rank, json.loads(payload), offsets[rank]) for rank, payload in enumerate(payloads) if rank != 0]
            )


def _clock_ms(timer, mark) -> float:
    """A mark on the host's monotonic clock (CUDA: once its event completed; polls, off the
    training thread)."""
    if not timer.wait_ready(mark, time.monotonic() + _DEADLINE_S):
        return math.nan
    return timer.clock_ms(mark)
