"""Hooks into the executor for whoever wants to watch it run: telemetry and trace recording.

The executor calls an observer at phase boundaries, before it blocks on a transfer, and after
each step completes. The base
class does nothing, so an observer overrides only what it needs. Observers must be cheap:
they run on the communication path (on CUDA they may record events, never synchronize).

A new callback is added in this file alone: a no-op method on :class:`ExecutionObserver`, its
forwarding in :class:`FanOut` (which the hook's per-bucket watch,
``telemetry.watcher.BucketWatch``, inherits), and the executor's call.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..schedules import RankStep


class ExecutionObserver:
    """Receives the executor's progress through one all-reduce. Every method is a no-op."""

    def on_phase(self, phase: str) -> None:
        """A new phase of the schedule (e.g. ``"all-gather"``) is about to start."""

    def on_wait(self, index: int, num_steps: int, peer: int) -> None:
        """This thread is about to block on a transfer of step ``index`` (of ``num_steps``) with
        ``peer`` (a rank of the group): what a stall watchdog names when the wait lasts."""

    def on_step(self, index: int, step: RankStep, chunk_bytes: Sequence[int]) -> None:
        """Step ``index`` completed: its transfers were waited for and its receives landed (on
        CUDA: enqueued). ``chunk_bytes[c]`` is the size of chunk ``c``."""

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

    def on_wait(self, index: int, num_steps: int, peer: int) -> None:
        for observer in self._observers:
            observer.on_wait(index, num_steps, peer)

    def on_step(self, index: int, step: RankStep, chunk_bytes: Sequence[int]) -> None:
        for observer in self._observers:
            observer.on_step(index, step, chunk_bytes)

    def on_finish(self) -> None:
        for observer in self._observers:
            observer.on_finish()


def combine_observers(*observers: ExecutionObserver) -> ExecutionObserver:
    """One observer that feeds all of ``observers`` (the null one when none is left)."""
    active = [observer for observer in observers if observer is not NULL_OBSERVER]
    if not active:
        return NULL_OBSERVER
    return active[0] if len(active) == 1 else FanOut(active)
