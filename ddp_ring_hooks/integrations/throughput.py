"""Samples per second of every optimizer step, measured without syncing the GPU (framework-free).

What a framework's callback feeds it (``integrations/lightning.py``'s ``ThroughputLogger``)::

    meter.start(step=global_step, device=...)              training starts
    meter.micro_batch(batch, step=global_step, world_size=p)  after every micro-batch:
        -> the steps measured by now (StepThroughput), oldest first
    meter.finish()                                          training ends: the rest
    meter.summarize(skip_steps=k)                           several steps together

1. A step's time runs from the end of the previous optimizer step to the end of this one (data
   loading, all its micro-batches, communication and the optimizer included); a step ends at
   the first micro-batch after which the step counter moved (accumulation: several per step).
2. On CUDA the step ends when the GPU gets there: a timing event is recorded on the current
   stream at each step's end and read once it has completed (``query()``, never a synchronize,
   which would stall the host every step and hide the very overlap being measured), so records
   arrive a step or two late, and :meth:`ThroughputMeter.finish` resolves the rest (one
   synchronize per run).
3. Samples are counted on this rank (``batch_size_fn``, default the leading dimension) and
   multiplied by the world size (every rank gets equal micro-batches from a distributed sampler).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True)
class StepThroughput:
    """What one optimizer step processed, over all ranks, and how long it took (wall clock)."""

    step: int
    micro_batches: int
    samples: int
    seconds: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    def metrics(self, *, tokens_per_sample: int | None = None) -> dict[str, float]:
        """``throughput/*``: samples/s, the step's ms, its micro-batches (and tokens/s)."""
        metrics = {
            "throughput/samples_per_s": self.samples_per_s,
            "throughput/step_ms": 1e3 * self.seconds,
            "throughput/micro_batches": float(self.micro_batches),
        }
        if tokens_per_sample:
            metrics["throughput/tokens_per_s"] = self.samples_per_s * tokens_per_sample
        return metrics


@dataclass(frozen=True)
class ThroughputSummary:
    """Several optimizer steps together: total samples over total wall-clock time.

    ``median_step_seconds`` is the typical step: on a shared machine a few steps that another
    process slowed down move the mean but not the median.
    """

    steps: int
    samples: int
    seconds: float
    median_step_seconds: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def median_samples_per_s(self) -> float:
        """Samples/s of the median step."""
        return self.samples / self.steps / self.median_step_seconds

    @property
    def step_ms(self) -> float:
        return 1e3 * self.seconds / self.steps


def count_leading_dimension(batch: Any) -> int:
    """Samples in a batch: the first dimension of the batch, or of its first element."""
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    return len(first)


class ThroughputMeter:
    """Every optimizer step of one run, measured (see the module docstring); :attr:`history`."""

    def __init__(self, *, batch_size_fn: Callable[[Any], int] = count_leading_dimension) -> None:
        self.batch_size_fn = batch_size_fn
        self.history: list[StepThroughput] = []
        self._device = torch.device("cpu")
        self._last_step = 0
        # CUDA: (start event, end event, record without seconds) of steps whose end the GPU has not reached.
        self._in_flight: list[tuple[Any, Any, StepThroughput]] = []
        self._start_window()

    def start(self, *, step: int, device: torch.device) -> None:
        """Training starts at optimizer ``step`` on ``device`` (a new run: the history is cleared)."""
        self.history, self._in_flight = [], []
        self._last_step, self._device = step, torch.device(device)
        self._start_window(_cuda_mark(self._device) if self._device.type == "cuda" else None)

    def micro_batch(self, batch: Any, *, step: int, world_size: int) -> list[StepThroughput]:
        """A micro-batch ended, the optimizer's counter now at ``step``: the steps measured by now."""
        self._window_samples += self.batch_size_fn(batch)
        self._window_micro_batches += 1
        if step == self._last_step:  # still accumulating
            return self._completed(wait=False)
        record = StepThroughput(step=step, micro_batches=self._window_micro_batches,
                                samples=self._window_samples * world_size, seconds=time.perf_counter() - self._window_start)
        self._last_step = step
        if self._device.type == "cuda":
            start, end = self._window_event, _cuda_mark(self._device)
            self._in_flight.append((start, end, record))
            self._start_window(end)
            return self._completed(wait=False)
        self._start_window()
        self.history.append(record)
        return [record]

    def finish(self) -> list[StepThroughput]:
        """Training ended: the steps whose CUDA end events were still pending (waits for them)."""
        return self._completed(wait=True)

    def summarize(self, *, skip_steps: int = 0) -> ThroughputSummary:
        """The steps after the first ``skip_steps`` of this run (warm-up: DDP's first step differs)."""
        measured = self.history[skip_steps:]
        if not measured:
            raise ValueError(
                f"no optimizer step left to measure after skipping {skip_steps} of {len(self.history)}; "
                "train more steps or skip fewer"
            )
        return ThroughputSummary(
            steps=len(measured),
            samples=sum(record.samples for record in measured),
            seconds=sum(record.seconds for record in measured),
            median_step_seconds=statistics.median(record.seconds for record in measured),
        )

    def _completed(self, *, wait: bool) -> list[StepThroughput]:
        """CUDA: the steps whose end event completed, as records, oldest first."""
        done = []
        while self._in_flight:
            start, end, record = self._in_flight[0]
            if not wait and not end.query():
                break
            if wait:
                end.synchronize()
            self._in_flight.pop(0)
            done.append(replace(record, seconds=start.elapsed_time(end) / 1e3))
        self.history += done
        return done

    def _start_window(self, event: Any = None) -> None:
        # On CUDA the window also starts at an event (the previous step's end, or a fresh one).
        self._window_event = event
        self._window_start = time.perf_counter()
        self._window_samples = 0
        self._window_micro_batches = 0


def _cuda_mark(device: torch.device) -> torch.cuda.Event:
    """A timing event recorded now on ``device``'s current stream (no wait)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event
