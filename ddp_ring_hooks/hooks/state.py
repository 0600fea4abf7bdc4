"""``HookState``: everything the hook needs between calls, and how a bucket gets reduced.

The state holds the process group, the algorithm and its options, the step counter and the
communication worker. Like PyTorch's ``PowerSGDState`` it pickles without its process group
(and without its thread): after unpickling, in a checkpoint or a spawned process, it uses the
default process group until told otherwise.

How a bucket is reduced depends on the device:

- CUDA (NCCL): inline on the autograd thread. Every send, receive and addition is enqueued on
  streams, and the Future is completed right away on the current stream: no host sync.
- CPU (gloo): on the state's :class:`~ddp_ring_hooks.runtime.CommWorker`, so the autograd
  thread goes on computing gradients of earlier layers while this bucket travels.

Either way the buffer is first divided by the group size, as PyTorch's ``allreduce_hook``
does (dividing first keeps fp16 sums from overflowing), so the result is the average.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime import NULL_OBSERVER, CommWorker, ExecutionObserver, run_schedule
from ..schedules import ALGORITHMS, Schedule, checked_schedule


class HookState:
    """State of :func:`~ddp_ring_hooks.ring_hook` for one DDP model.

    Args:
        process_group: the group to reduce over; ``None`` means the default (WORLD) group.
        algorithm: the all-reduce algorithm, one of :data:`ddp_ring_hooks.ALGORITHMS`.
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
        # Runtime objects, rebuilt after unpickling.
        "_worker",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        algorithm: str = "ring",
        **algorithm_options,
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}"
            )
        self.process_group = process_group
        self.algorithm = algorithm
        self.algorithm_options = dict(algorithm_options)
        self.iteration = 0
        self._worker = CommWorker()

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
        return checked_schedule(self.algorithm, self.world_size, **self.algorithm_options)

    def reduce_bucket(self, buffer: torch.Tensor, *, is_last: bool) -> torch.futures.Future:
        """Average ``buffer`` over the group in place; the Future holds ``buffer``."""
        if is_last:
            self.iteration += 1
        schedule = self.schedule_for(buffer)
        if buffer.is_cuda:
            self._average(schedule, buffer, NULL_OBSERVER)
            future = torch.futures.Future(devices=[buffer.device])
            future.set_result(buffer)
            return future
        return self._worker.submit(lambda: self._average(schedule, buffer, NULL_OBSERVER))

    def _average(
        self, schedule: Schedule, buffer: torch.Tensor, observer: ExecutionObserver
    ) -> torch.Tensor:
        buffer.div_(schedule.world_size)
        return run_schedule(schedule, buffer, group=self.group, observer=observer)

    def close(self) -> None:
        """Stop the worker thread after the queued buckets (it restarts on the next bucket)."""
        self._worker.close()

    # -- pickling ------------------------------------------------------------------------

    def __getstate__(self) -> dict:
        # Process groups and threads cannot be pickled; they are rebuilt on load.
        skipped = {"process_group", "_worker"}
        return {name: getattr(self, name) for name in self.__slots__ if name not in skipped}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self.process_group = None
        self._worker = CommWorker()
