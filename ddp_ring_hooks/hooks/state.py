"""``HookState``: everything the hook needs between calls, and how a bucket gets reduced.

The state holds the process group, the algorithm and its options, the step counter and the
communication worker. Like PyTorch's ``PowerSGDState`` it pickles without its process group
(and without its thread): after unpickling, in a checkpoint or a spawned process, it uses the
default process group until told otherwise.

How a bucket is reduced depends on the device:

- CUDA (NCCL): inline on the autograd thread. Every send, receive and addition is enqueued on
  streams, and the Future is completed right away on the current stream: no host sync.
- CPU (gloo): on a :class:`~ddp_ring_hooks.runtime.CommWorker` thread, so the autograd thread
  goes on computing gradients of earlier layers while this bucket travels. Bucket ``i`` of
  every iteration goes to lane ``i % concurrent_buckets`` (a worker of its own, its messages
  tagged with the lane): each lane takes its buckets in DDP's order, the same on every rank,
  and two buckets can be on the wire at once, as gloo's own two worker threads do for DDP's
  default hook. Measured on 2 cores (8x1024 MLP, 8 buckets, ``benchmarks/ddp_step.py``): with
  one lane the ring hook's step took 1.06x (2 ranks) and 1.14x (4 ranks) the default's; with
  two, see docs/benchmarks.md.

Either way the buffer is first divided by the group size, as PyTorch's ``allreduce_hook``
does (dividing first keeps fp16 sums from overflowing), so the result is the average.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime import ExecutionObserver, combine_observers, run_schedule, worker_for, workers_of
from ..runtime.errors import CommunicationError, HookFailedError
from ..schedules import Schedule, checked_schedule
from ..telemetry import Sink, Telemetry
from .auto import AUTO, AutoSelector
from .layout_check import BucketLayout, check_bucket_layout
from .validation import check_algorithm_name, validate_bucket, validate_group


class HookState:
    """State of :func:`~ddp_ring_hooks.ring_hook` for one DDP model.

    Args:
        process_group: the group to reduce over; ``None`` means the default (WORLD) group.
        algorithm: the all-reduce algorithm, one of :data:`ddp_ring_hooks.ALGORITHMS`, or
            ``"auto"``: per bucket, the fastest under a cost model calibrated by a short
            collective probe right here (so every rank must build its state together); options
            ``calibration=``, ``local_size=``, ``segments=``, ``candidates=``, see
            :class:`~ddp_ring_hooks.hooks.auto.AutoSelector`.
        log_dir, log_every, trace_steps, per_rank, spread_every, sinks: per-bucket
            communication timing (TensorBoard, trace, summary), see
            :class:`~ddp_ring_hooks.telemetry.Telemetry`; or pass a ready ``telemetry=``.
            Nothing is recorded unless one of them asks for it.
        observers: more :class:`~ddp_ring_hooks.runtime.ExecutionObserver` s that watch every
            bucket's all-reduce, e.g. a :class:`~ddp_ring_hooks.runtime.recording.TraceRecorder`
            to replay your own training with ``ddp-ring-hooks animate --trace``.
        check_layout_steps: for this many first iterations, check across ranks that every
            rank reduces the same buckets (see :mod:`~ddp_ring_hooks.hooks.layout_check`);
            ``0`` turns the check off.
        concurrent_buckets: on CPU, how many buckets may be reduced at the same time, each on
            a worker thread of its own (default 2; 1 reduces them strictly one after the other).
            With ``observers``, buckets always run one at a time: an observer sees whole
            all-reduces in order. Every rank must end up with the same number of lanes (the
            layout check says so when they do not).
        **algorithm_options: passed to the algorithm's schedule builder.

    Example::

        >>> state = HookState(algorithm="ring")
        >>> ddp_model.register_comm_hook(state, ring_hook)
    """

    __slots__ = (
        # What to run, and where.
        "process_group",
        "algorithm",
        "algorithm_options",
        # Progress: optimizer steps seen (one DDP reduction each).
        "iteration",
        # Per-bucket timing; pickles its options only.
        "telemetry",
        # CPU: buckets reduced at the same time, one worker lane each.
        "concurrent_buckets",
        # More watchers of every bucket's execution (e.g. a TraceRecorder); not pickled.
        "observers",
        # algorithm="auto": the calibrated per-bucket chooser (None otherwise).
        "_auto",
        # Reliability: iterations with the cross-rank layout check, the index of the next
        # bucket (DDP hands them over in order), the first communication failure (the group
        # is unusable after it, so later buckets fail at once instead of waiting).
        "check_layout_steps",
        "_reductions_here",
        "_bucket_index",
        "_failure",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        algorithm: str = "ring",
        *,
        log_dir: str | None = None,
        log_every: int = 1,
        trace_steps: int | tuple[int, int] | None = None,
        per_rank: bool = False,
        spread_every: int = 0,
        sinks: tuple[Sink, ...] = (),
        telemetry: Telemetry | None = None,
        observers: tuple[ExecutionObserver, ...] = (),
        check_layout_steps: int = 2,
        concurrent_buckets: int = 2,
        **algorithm_options,
    ) -> None:
        if not isinstance(check_layout_steps, int) or check_layout_steps < 0:
            raise ValueError(f"check_layout_steps must be an integer >= 0, got {check_layout_steps!r}")
        if not isinstance(concurrent_buckets, int) or concurrent_buckets < 1:
            raise ValueError(f"concurrent_buckets must be an integer >= 1, got {concurrent_buckets!r}")
        check_algorithm_name(algorithm)
        self.process_group = process_group
        self.algorithm = algorithm
        self.algorithm_options = dict(algorithm_options)
        self.iteration = 0
        self.check_layout_steps = check_layout_steps
        self.concurrent_buckets = concurrent_buckets
        # Reductions run by this process, not restored from a checkpoint: a resumed run
        # rebuilds its buckets and must check their layout again.
        self._reductions_here = 0
        self._bucket_index = 0
        self._failure: CommunicationError | None = None
        self._auto = AutoSelector.probed(self.group, **algorithm_options) if algorithm == AUTO else None
        if telemetry is not None and (log_dir is not None or trace_steps is not None or sinks):
            raise ValueError(
                "pass either telemetry=Telemetry(...) or the telemetry options (log_dir, "
                "trace_steps, sinks, ...), not both: put the options into the Telemetry"
            )
        self.telemetry = telemetry or Telemetry(
            log_dir=log_dir, log_every=log_every, trace_steps=trace_steps, per_rank=per_rank,
            spread_every=spread_every, sinks=sinks,
        )
        self.observers = tuple(observers)

    # -- the group -----------------------------------------------------------------------

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group in use (the default group when none was given)."""
        return self.process_group if self.process_group is not None else dist.group.WORLD

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return dist.get_world_size(self.group)

    # -- reducing a bucket ---------------------------------------------------------------

    def schedule_for(self, buffer: torch.Tensor) -> Schedule:
        """The (checked, cached) schedule used for this buffer."""
        if self._auto is not None:
            algorithm, options = self._auto.choose(buffer.numel() * buffer.element_size())
            return checked_schedule(algorithm, self.world_size, **options)
        return checked_schedule(self.algorithm, self.world_size, **self.algorithm_options)

    def lanes_for(self, buffer: torch.Tensor) -> int:
        """Worker lanes the buckets go to, round robin: ``concurrent_buckets`` on CPU; one with
        ``observers`` (they see whole all-reduces in order); none (1) on CUDA, where the hook
        only enqueues work on the stream."""
        return 1 if buffer.is_cuda or self.observers else self.concurrent_buckets

    def reduce_bucket(self, buffer: torch.Tensor, *, is_last: bool) -> torch.futures.Future:
        """Average ``buffer`` over the group in place; the Future holds ``buffer``."""
        validate_bucket(buffer)
        bucket, self._bucket_index = self._bucket_index, 0 if is_last else self._bucket_index + 1
        checking_layout = self._reductions_here < self.check_layout_steps
        if checking_layout:
            validate_group(self.process_group)
        schedule = self.schedule_for(buffer)
        lanes = self.lanes_for(buffer)
        if checking_layout:
            check_bucket_layout(
                BucketLayout(bucket, buffer.numel(), buffer.dtype, is_last, schedule, lanes),
                group=self.group, iteration=self.iteration,
            )
        iteration = self.iteration  # reductions done before this one
        step = iteration + 1  # the optimizer step this reduction belongs to
        if is_last:
            self.iteration += 1
            self._reductions_here += 1
        # Taken now, on the hook thread: "handed over" starts queue_ms and exposed_ms.
        observer = combine_observers(
            self.telemetry.observe_bucket(
                buffer, step=step, index=bucket, is_last=is_last, algorithm=schedule.algorithm, group=self.group
            ),
            *self.observers,
        )
        if buffer.is_cuda:
            self._average_or_explain(schedule, buffer, observer, bucket=bucket, iteration=iteration)
            future = torch.futures.Future(devices=[buffer.device])
            future.set_result(buffer)
            return future
        lane = bucket % lanes
        job = lambda: self._average_or_explain(schedule, buffer, observer, bucket=bucket, iteration=iteration, tag=lane)  # noqa: E731
        # DDP reads a failed Python Future as a value ("Unable to cast ... to Tensor"); a
        # callback that re-raises turns it into a real error that keeps our message.
        return worker_for(self.group, lane).submit(job).then(_value_or_raise)

    def _average(
        self, schedule: Schedule, buffer: torch.Tensor, observer: ExecutionObserver, tag: int
    ) -> torch.Tensor:
        return run_schedule(schedule, buffer, group=self.group, observer=observer, divisor=schedule.world_size, tag=tag)

    def _average_or_explain(
        self, schedule: Schedule, buffer: torch.Tensor, observer: ExecutionObserver, *,
        bucket: int, iteration: int, tag: int = 0,
    ) -> torch.Tensor:
        """:meth:`_average`, with failures that name the hook and bucket; once communication
        failed, every later bucket fails at once instead of waiting for the timeout again."""
        if self._failure is not None:
            raise CommunicationError(
                f"ring_hook: bucket {bucket} of iteration {iteration} was not reduced because an "
                f"earlier one failed: {self._failure}"
            )
        try:
            return self._average(schedule, buffer, observer, tag)
        except RuntimeError as error:  # backend errors (DistBackendError) and StepFailedError
            self._failure = HookFailedError(
                hook="ring_hook", bucket=bucket, iteration=iteration, numel=buffer.numel(),
                dtype=str(buffer.dtype).removeprefix("torch."), cause=error,
            )
            raise self._failure from error

    def close(self) -> None:
        """Stop the worker threads after the queued buckets (they restart on the next bucket),
        then write the queued telemetry and close its sinks. Safe to call twice."""
        for worker in workers_of(self.group):
            worker.close()
        self.telemetry.close()

    def summary(self) -> str:
        """The per-bucket communication summary table (count, p50/p90/max ms, bytes, busbw)."""
        return self.telemetry.summary()

    # -- pickling ------------------------------------------------------------------------

    def __getstate__(self) -> dict:
        # Process groups and threads cannot be pickled; they are rebuilt on load.
        skipped = {"process_group", "_failure", "observers", "_reductions_here", "_bucket_index"}
        return {name: getattr(self, name) for name in self.__slots__ if name not in skipped}

    def __setstate__(self, state: dict) -> None:
        self.concurrent_buckets = 2  # states pickled before the option existed
        for name, value in state.items():
            setattr(self, name, value)
        self.process_group = None
        self._failure = None
        self.observers = ()
        self._reductions_here = self._bucket_index = 0


def _value_or_raise(future: torch.futures.Future) -> torch.Tensor:
    return future.value()
