"""How a bucket is reduced: its kind, chosen in one place, and the executor of each kind.

:func:`choose` is the one seam where the way a bucket travels is decided; nothing else in the
hook asks whether a bucket is the user's, sparse, native, on CUDA or on the CPU::

    choose(schedule, buffer, lanes=..., foreign=..., densify=...) -> Executor
      hook= (the user's own) ...... ForeignExecutor   their hook, unchanged, on the hook thread in DDP's
                                                      order, as DDP alone runs it (hooks/foreign.py)
      a sparse buffer ............. SparseExecutor    the group's sparse all-reduce, as PyTorch's
                                                      allreduce_hook, on the hook thread (runtime/sparse.py)
        with sparse="dense" ....... Densified         as a dense tensor through the executor below, then
                                                      back to sparse
      no schedule (native) ........ NativeExecutor    the group's own all_reduce, on the hook thread,
                                                      like DDP's builtin hook (runtime/native.py)
      a schedule, a CUDA buffer ... CudaLaneExecutor  the group's CUDA lane: the worker of its device,
                                                      its side stream, its dedicated group (runtime/cuda_lane.py)
      a schedule, a CPU buffer .... CpuLanes          worker lane ``bucket % lanes``, its messages tagged
                                                      with the lane, two buckets on the wire at once (gloo)

1. The hook state checks the bucket, picks its schedule (the plan: none for the user's hook or a
   gathered sparse bucket) and calls :func:`choose`.
2. It hands the bucket to its observation (the hand-over mark) with the executor's ``kind`` and
   the bucket's bytes as that kind counts them (``runtime/wire.py``), and gets the watch back.
3. ``executor.launch(Launch(...), run)`` starts the reduction and returns the Future DDP waits
   on; a failure is named by the state's :class:`~.errors.Failures` and goes into that Future.

A new kind is one more :class:`Executor` (its ``kind``, its ``label`` for telemetry, its
``launch``) and one more case in :func:`choose`; the state, the layout check (which compares
each rank's ``executor.lanes``, kind and label) and the watchers do not change.

Every executor runs the bucket on the wire its :class:`Launch` names (``wire``: the dtype its
transfers carry, from the ``wire_dtype`` option; the executors cast around the transfers,
:mod:`~ddp_ring_hooks.runtime.executor` and :mod:`~ddp_ring_hooks.runtime.native`) and, with
error feedback, adds last step's ``residual`` into the bucket first, on the thread that
reduces it, then has the run write this step's losses into it
(:mod:`~.error_feedback`).

The result is the average. The schedules divide each piece by the group size at its first use
(before it is sent, or fused into the first addition), as PyTorch's ``allreduce_hook`` divides
before summing (no fp16 overflow); ``native`` multiplies by ``1 / world_size`` first, as DDP's
reducer does, so it matches DDP without a hook bit for bit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..runtime import run_schedule
from ..runtime.cuda_lane import wait_handed_over
from ..runtime.daemons import backend_callback
from ..runtime.errors import CommunicationError
from ..runtime.group_context import GroupContext
from ..runtime.lanes import bucket_lane
from ..runtime.names import NATIVE
from ..runtime.native import run_native
from ..runtime.sparse import DENSIFY, SPARSIFY, run_sparse, sparsify
from ..runtime.wire import DENSE, DENSIFIED, FOREIGN, SPARSE, bucket_bytes
from ..schedules import Schedule
from ..telemetry.watcher import BucketWatch
from . import foreign
from .error_feedback import ErrorFeedback
from .errors import Failures


@dataclass(frozen=True)
class Launch:
    """One bucket on its way out: what every executor is given."""

    buffer: torch.Tensor
    schedule: Schedule | None  # None: native
    watch: BucketWatch  # the executor's observer (marks, watchers), from the hand-over
    bucket: int
    iteration: int  # reductions done before this one
    wire: torch.dtype | None = None  # what its transfers carry (None: its own dtype)
    residual: torch.Tensor | None = None  # error feedback: last step's losses in, this step's out
    grad_bucket: dist.GradBucket | None = None  # DDP's own bucket (what a foreign hook is given)

    @property
    def algorithm(self) -> str:
        return algorithm_of(self.schedule)


def algorithm_of(schedule: Schedule | None) -> str:
    """The algorithm that reduces a bucket with ``schedule`` (``None``: native)."""
    return schedule.algorithm if schedule is not None else NATIVE


@dataclass(frozen=True)
class Run:
    """What the hook state lends every executor: its group, the group's prepared context, and
    how it names failures."""

    group: dist.ProcessGroup
    context: GroupContext
    failures: Failures


class Executor:
    """One kind of bucket. ``lanes``: how many worker lanes its buckets are spread over (every
    rank must spread them alike; the layout check compares it); ``kind``: how its bytes are
    counted (``runtime/wire.py``)."""

    lanes = 1
    kind = DENSE

    def label(self, schedule: Schedule | None) -> str:
        """What reduced the bucket, as telemetry and errors name it: the algorithm."""
        return algorithm_of(schedule)

    def launch(self, launch: Launch, run: Run) -> torch.futures.Future:
        raise NotImplementedError


def choose(
    schedule: Schedule | None, buffer: torch.Tensor, *, lanes: int, foreign: foreign.ForeignHook | None = None,
    densify: bool = False,
) -> Executor:
    """The executor of a bucket (see the module docstring); ``lanes``: the CPU lanes it may use
    (``concurrent_buckets``, or 1 when observers must see whole all-reduces in order);
    ``foreign``: the user's own hook (``hook=``); ``densify``: a sparse bucket goes through the
    schedule as a dense tensor (``sparse="dense"``)."""
    if foreign is not None:
        return ForeignExecutor(foreign)
    if buffer.is_sparse:
        return Densified(_dense(schedule, buffer, lanes)) if densify else SPARSE_EXECUTOR
    return _dense(schedule, buffer, lanes)


def _dense(schedule: Schedule | None, buffer: torch.Tensor, lanes: int) -> Executor:
    if schedule is None:
        return NATIVE_EXECUTOR
    if buffer.is_cuda:
        return CUDA_EXECUTOR
    return CpuLanes(lanes)


class NativeExecutor(Executor):
    """The group's own all-reduce on the hook thread, failing like the schedules: named, through
    the Future (so DDP's end of backward raises it), and at once after a failure (under ``auto``
    native and schedule buckets share one record of it). On CUDA the Future completes at once
    and NCCL reports errors through its own watchdog, so only gloo's Future is watched."""

    def launch(self, launch: Launch, run: Run) -> torch.futures.Future:
        buffer, failures = launch.buffer, run.failures
        try:
            failures.refuse_after_first(NATIVE, launch.bucket, launch.iteration)
            if launch.residual is not None:
                ErrorFeedback.add_into(buffer, launch.residual, dist.get_world_size(run.group))
            future = run_native(buffer, group=run.group, observer=launch.watch, average=True, wire=launch.wire,
                                residual=launch.residual)
        except RuntimeError as error:  # refused, or the backend failed to start the collective
            return _failed(NATIVE, launch, run, error)
        if buffer.is_cuda:
            return future
        return future.then(_explained(NATIVE, launch, run))


@dataclass(frozen=True)
class CpuLanes(Executor):
    """A schedule on CPU (gloo), on a worker thread, so the autograd thread goes on computing
    gradients of earlier layers while this bucket travels. Bucket ``i`` of every iteration goes
    to lane ``i % lanes`` (a worker of its own, its messages tagged with the lane): each lane
    takes its buckets in DDP's order, the same on every rank, and two buckets can be on the
    wire at once, as gloo's own two worker threads do for DDP's default hook."""

    lanes: int = 2

    def launch(self, launch: Launch, run: Run) -> torch.futures.Future:
        lane = bucket_lane(launch.bucket % self.lanes)
        job = lambda: _average(launch, run, tag=lane.tag)  # noqa: E731
        return run.context.worker(lane).submit(launch.watch.running(job)).then(_value_or_raise)


class CudaLaneExecutor(Executor):
    """A schedule on CUDA (NCCL), on the device's communication stream, launched by a worker
    thread of its own on a process group of its own (``runtime/cuda_lane.py`` says why each):
    the autograd thread only queues the bucket; the worker first makes its side stream wait for
    the hand-over mark (an event after the kernels that produced the bucket); the Future
    completes on the side stream. No host sync anywhere."""

    def launch(self, launch: Launch, run: Run) -> torch.futures.Future:
        side = run.context.cuda_lane(launch.buffer.device)

        def job():
            wait_handed_over(launch.watch.handed)
            return _average(launch, run, carrier=side.group)

        return side.worker.submit(launch.watch.running(job), devices=[launch.buffer.device]).then(_value_or_raise)


class ForeignExecutor(Executor):
    """The user's own DDP hook (``hook=``, :mod:`.foreign`), called unchanged with DDP's own
    ``GradBucket``, on the hook thread, in DDP's order: what DDP alone would do. Its phase
    ``hook`` runs from the call to its Future's completion; the Future's value goes to DDP as
    it is. A failure (in the call or in its Future) is named like the others'."""

    kind = FOREIGN

    def __init__(self, hook: foreign.ForeignHook) -> None:
        self.hook = hook

    def label(self, schedule: Schedule | None) -> str:
        return self.hook.name

    def launch(self, launch: Launch, run: Run) -> torch.futures.Future:
        hook, watch = self.hook, launch.watch
        if launch.grad_bucket is None:
            raise TypeError(
                f"hook={hook.name} is called with DDP's GradBucket, and this bucket came without one: attach the "
                "state with ddp_ring_hooks.register(model, hook=...) or model.register_comm_hook(state, ring_hook)"
            )
        try:
            run.failures.refuse_after_first(hook.name, launch.bucket, launch.iteration)
            watch.on_phase(foreign.PHASE)
            future = hook.hook(hook.state, launch.grad_bucket)
            if hook.wire_bytes is not None:  # the hook's own count, now that it has set this bucket up
                watch.resize(bucket_bytes(launch.buffer, None, kind=FOREIGN,
                                          wire_bytes=hook.wire_bytes(hook.state, launch.grad_bucket)))
        except RuntimeError as error:
            return _failed(hook.name, launch, run, error)
        explained = _explained(hook.name, launch, run)

        def finished(done: torch.futures.Future):
            value = explained(done)
            watch.on_finish()
            return value

        return future.then(finished)


class SparseExecutor(Executor):
    """A sparse bucket (``nn.Embedding(sparse=True)``): the group's sparse all-reduce on the hook
    thread, divided by the world size first, as PyTorch's ``allreduce_hook`` (``runtime/sparse.py``):
    its result, bit for bit. Whatever the algorithm (a schedule's chunks are rows other ranks do
    not have). Its bytes are its indices and values as the gather coalesces them, counted at
    hand-over (``runtime/wire.py``)."""

    kind = SPARSE

    def label(self, schedule: Schedule | None) -> str:
        return SPARSE

    def launch(self, launch: Launch, run: Run) -> torch.futures.Future:
        try:
            run.failures.refuse_after_first(SPARSE, launch.bucket, launch.iteration)
            future = run_sparse(launch.buffer, group=run.group, observer=launch.watch)
        except RuntimeError as error:
            return _failed(SPARSE, launch, run, error)
        return future.then(_explained(SPARSE, launch, run))


@dataclass(frozen=True)
class Densified(Executor):
    """A sparse bucket with ``sparse="dense"``: made dense (on the hook thread: a dense copy of
    the whole table), reduced by ``dense`` (the chosen schedule's executor, or native) as any
    dense bucket, then sparse again (the rows whose average is not zero, ``runtime/sparse.py``'s
    :func:`~ddp_ring_hooks.runtime.sparse.sparsify`) for DDP to copy back. The bucket is timed
    from the first to the last: its phases ``densify``, the schedule's, then ``sparsify``, and
    it finishes once the table is sparse again (the two passes over the table can cost more
    than the schedule)."""

    dense: Executor
    kind = DENSIFIED

    @property
    def lanes(self) -> int:
        return self.dense.lanes

    def label(self, schedule: Schedule | None) -> str:
        return self.dense.label(schedule)

    def launch(self, launch: Launch, run: Run) -> torch.futures.Future:
        watch, sparse = launch.watch, launch.buffer  # counted at hand-over (runtime/wire.py)
        watch.on_phase(DENSIFY)
        table = sparse.to_dense()  # duplicate rows added up
        future = self.dense.launch(dataclasses.replace(launch, buffer=table.view(-1), watch=_FinishedLater(watch)), run)

        def sparse_again(done: torch.futures.Future) -> torch.Tensor:
            averaged = done.value().view(table.shape)
            watch.on_phase(SPARSIFY)
            result = sparsify(averaged, sparse.sparse_dim())
            watch.on_finish()
            return result

        return future.then(sparse_again)


class _FinishedLater:
    """A bucket's watch lent to the executor inside :class:`Densified`: every call passes
    through but ``on_finish``, which :class:`Densified` makes once the table is sparse again."""

    def __init__(self, watch: BucketWatch) -> None:
        self._watch = watch

    def on_finish(self) -> None:
        pass

    def __getattr__(self, name: str):
        return getattr(self._watch, name)


NATIVE_EXECUTOR = NativeExecutor()
CUDA_EXECUTOR = CudaLaneExecutor()
SPARSE_EXECUTOR = SparseExecutor()


def _average(launch: Launch, run: Run, *, tag: int = 0, carrier: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The bucket's schedule, averaging, with failures that name the hook and bucket."""
    schedule, failures = launch.schedule, run.failures
    failures.refuse_after_first(schedule.algorithm, launch.bucket, launch.iteration)
    if launch.residual is not None:  # error feedback: last step's losses go in first
        ErrorFeedback.add_into(launch.buffer, launch.residual, schedule.world_size)
    try:
        return run_schedule(
            schedule, launch.buffer, group=run.group, observer=launch.watch, divisor=schedule.world_size, tag=tag,
            residual=launch.residual, context=run.context, carrier=carrier,
        )
    except RuntimeError as error:  # backend errors (DistBackendError) and StepFailedError
        raise failures.named(schedule.algorithm, launch.buffer, launch.bucket, launch.iteration, error) from error


def _failed(algorithm: str, launch: Launch, run: Run, error: RuntimeError) -> torch.futures.Future:
    """A Future that fails with ``error`` named (raised before anything ran: refused after an
    earlier failure, or the backend or the hook failed to start)."""
    buffer, failure = launch.buffer, error
    if not isinstance(error, CommunicationError):
        failure = run.failures.named(algorithm, buffer, launch.bucket, launch.iteration, error)
        failure.__cause__ = error
    failed = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
    failed.set_exception(failure)
    return failed.then(_value_or_raise)


def _explained(algorithm: str, launch: Launch, run: Run):
    """A Future callback: the value, or the error named as the hook's failure of this bucket."""

    @backend_callback  # on gloo's thread after a native or sparse collective
    def value_or_explain(done: torch.futures.Future):
        try:
            return done.value()
        except RuntimeError as error:
            raise run.failures.named(algorithm, launch.buffer, launch.bucket, launch.iteration, error) from error

    return value_or_explain


def _value_or_raise(future: torch.futures.Future) -> torch.Tensor:
    # DDP reads a failed Python Future as a value ("Unable to cast ... to Tensor"); a callback
    # that re-raises turns it into a real error that keeps our message.
    return future.value()
