"""Hooks into the executor for whoever wants to watch it run: telemetry and trace recording.

The executor calls an observer at phase boundaries and after each step completes, and, only
for an observer with a ``transfer_clock``, with each unit's transfers and their marks. The base
class does nothing, so an observer overrides only what it needs. Observers must be cheap:
they run on the communication path (on CUDA they may record events, never synchronize).

A new callback is added in this file alone: a no-op method on :class:`ExecutionObserver`, its
forwarding in :class:`FanOut` (which the hook's per-bucket watch,
``telemetry.watcher.BucketWatch``, inherits), and the executor's call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..schedules import RankStep


class ExecutionObserver:
    """Receives the executor's progress through one all-reduce. Every method is a no-op."""

    #: Per-transfer timing (telemetry's per-link timing): a clock the executor marks each
    #: transfer with (host seconds, or a CUDA event recorded on the current stream), or
    #: ``None``, the default: the executor times no transfer and never calls :meth:`on_transfers`.
    transfer_clock: Callable[[], object] | None = None

    def on_phase(self, phase: str) -> None:
        """A new phase of the schedule (e.g. ``"all-gather"``) is about to start."""

    def on_step(self, index: int, step: RankStep, chunk_bytes: Sequence[int]) -> None:
        """Step ``index`` completed: its transfers were waited for and its receives landed (on
        CUDA: enqueued). ``chunk_bytes[c]`` is the size of chunk ``c``."""

    def on_transfers(
        self, index: int, posted, sends: Sequence[tuple[int, int]], receives: Sequence[tuple[int, int]],
        received: Sequence,
    ) -> None:
        """With a :attr:`transfer_clock` only: a unit of step ``index`` (one slice's share of it
        on CPU) completed. ``posted``: its mark right before its messages were posted;
        ``sends`` and ``receives``: ``(peer, nbytes)`` of each message; ``received[i]``: the
        mark as receive ``i`` had landed (on NCCL, whose batch completes as one, the batch's)."""

    def on_finish(self) -> None:
        """The last step completed (on CUDA: enqueued) and the result is in the buffer."""


NULL_OBSERVER = ExecutionObserver()


class FanOut(ExecutionObserver):
    """Forwards every call to several observers, in order."""

    def __init__(self, observers: Sequence[ExecutionObserver]) -> None:
        self._observers = tuple(observers)

    def on_phase(self, phase: str) -> None:
        for observer in self._observers:
            observer.on_phase(phase)

    def on_step(self, index: int, step: RankStep, chunk_bytes: Sequence[int]) -> None:
        for observer in self._observers:
            observer.on_step(index, step, chunk_bytes)

    @property
    def transfer_clock(self) -> Callable[[], object] | None:
        """The first observer's clock that times transfers (every watcher of a bucket shares its timer)."""
        return next((o.transfer_clock for o in self._observers if o.transfer_clock is not None), None)

    def on_transfers(self, index, posted, sends, receives, received) -> None:
        for observer in self._observers:
            if observer.transfer_clock is not None:
                observer.on_transfers(index, posted, sends, receives, received)

    def on_finish(self) -> None:
        for observer in self._observers:
            observer.on_finish()


def combine_observers(*observers: ExecutionObserver) -> ExecutionObserver:
    """One observer that feeds all of ``observers`` (the null one when none is left)."""
    active = [observer for observer in observers if observer is not NULL_OBSERVER]
    if not active:
        return NULL_OBSERVER
    return active[0] if len(active) == 1 else FanOut(active)
