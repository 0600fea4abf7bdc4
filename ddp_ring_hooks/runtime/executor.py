"""Run a schedule on a flat tensor with ``torch.distributed`` point-to-point operations.

For each step of its plan, a rank posts all its sends and receives (on NCCL as one
``batch_isend_irecv`` batch, so their order cannot deadlock), waits for them, then applies
the receives: ``chunk += received`` for a reduce, ``chunk = received`` for a copy. Sends read
the chunk as it was before the step, exactly as the schedule's in-memory replay assumes.

- Chunks are ``flat.tensor_split(num_chunks)`` views: any element count works, uneven tails
  are allowed, and empty chunks send nothing (both ends know the sizes, so they agree).
- A copy lands directly in the chunk; a reduce lands in a scratch buffer first.
- Reductions happen in the buffer's own dtype, as NCCL does.
- ``divisor`` averages instead of summing: each rank's contribution is divided by it *before*
  it is summed (so fp16 sums cannot overflow, as in PyTorch's ``allreduce_hook``), fused into
  the first pass over each chunk: a chunk about to be sent first is divided in place; a chunk
  whose first touch is a reduce becomes ``received + chunk / divisor`` in one kernel
  (``addcdiv``). DDP's own reducer fuses its division the same way, into the copy of the
  gradients into the bucket: a separate pass over the whole bucket costs ~5% of a step.
- On CUDA with NCCL, ``wait()`` only makes the current stream wait for the NCCL stream and the
  additions are enqueued on the current stream: the host is never blocked.
- The schedule's ranks are ranks *of the group*; ``group_peer`` lets torch map them to
  global ranks, so subgroups from ``dist.new_group`` work.

Pipelining on CPU (gloo). Done one step at a time, a rank idles on the network while it adds,
and adds nothing while bytes move. So on CPU every chunk bigger than :data:`SEGMENT_BYTES` is
cut into segments (``chunk.tensor_split(lanes)``), and segment ``j`` of every chunk forms
*lane* ``j``: a full copy of the schedule on a slice of the buffer, independent of the other
lanes. The lanes' steps are posted step by step, lane by lane, keeping
:data:`SEGMENTS_IN_FLIGHT` of them posted (gloo's own ring keeps two segments in flight), so
one lane's addition overlaps the next lane's transfer::

    posted    s0 l0 | s0 l1 | s0 l2 | s1 l0 | s1 l1 | ...      (s = step, l = lane)
    adding          | s0 l0 | s0 l1 | s0 l2 | s1 l0 | ...

Each lane still runs its steps in order (with two or more lanes, ``(step s, lane j)`` is
completed before ``(step s+1, lane j)`` is posted), every rank posts in the same order (so
gloo's first-in first-out matching pairs the right messages), and each element is summed
along the same chain as without lanes: results stay bit-identical. The window drains at
each phase boundary, so observers see a phase's steps before the next phase starts. Scratch
space (one slot per transfer in flight) is kept per thread and reused: a fresh buffer of
tens of MB costs a page fault per 4 KB on every call. CUDA keeps one lane: NCCL pipelines
its transfers itself, and the caching allocator already reuses memory, stream-safely.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..schedules import Op, RankStep, Schedule
from .errors import StepFailedError
from .observer import NULL_OBSERVER, ExecutionObserver

#: On CPU, chunks larger than this are cut into segments that are pipelined (see above).
#: Big enough that the cost per message (a wake-up of two threads) stays small on a busy host.
SEGMENT_BYTES = 4 << 20
#: How many segment transfers a rank keeps posted on CPU while it adds the earlier ones.
SEGMENTS_IN_FLIGHT = 2


@dataclass(frozen=True, slots=True)
class _Posted:
    """One lane's share of one step, posted and not yet applied."""

    index: int  # the step's index in the plan
    ops: list[dist.P2POp]
    works: list[dist.Work]
    landings: list[tuple[torch.Tensor, torch.Tensor, Op]]  # (chunk segment, buffer, op)
    ends_step: bool  # the step's last lane: the step is done once this is applied


def run_schedule(
    schedule: Schedule,
    flat: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    observer: ExecutionObserver = NULL_OBSERVER,
    segment_bytes: int | None = None,
    divisor: int = 1,
) -> torch.Tensor:
    """All-reduce (sum) the 1-D contiguous tensor ``flat`` in place following ``schedule``.

    With ``divisor`` > 1 every contribution is divided by it first: the result is the sum of
    ``x_r / divisor`` (the average when ``divisor`` is the group size).
    ``segment_bytes`` overrides :data:`SEGMENT_BYTES` on CPU (tests use it to get many
    lanes from small tensors); CUDA tensors always run in one lane.
    """
    group_size = dist.get_world_size(group)
    if schedule.world_size != group_size:
        raise ValueError(
            f"the {schedule.algorithm} schedule is for {schedule.world_size} ranks but the "
            f"process group has {group_size}; build the schedule for the group's size"
        )
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("run_schedule needs a 1-D contiguous tensor; pass tensor.view(-1)")
    if segment_bytes is not None and segment_bytes < 1:
        raise ValueError(f"segment_bytes must be positive, got {segment_bytes}")
    if group_size == 1 or flat.numel() == 0:
        if divisor != 1:
            flat.div_(divisor)
        observer.on_finish()
        return flat
    plan = schedule.plan_for(dist.get_rank(group))
    chunks = flat.tensor_split(schedule.num_chunks)
    chunk_bytes = [c.numel() * c.element_size() for c in chunks]
    on_cpu = flat.device.type == "cpu"
    lanes = _split_into_lanes(chunks, _lane_count(chunk_bytes, segment_bytes) if on_cpu else 1)
    window = min(SEGMENTS_IN_FLIGHT, len(lanes))  # <= lanes: a lane's steps never overlap
    slots = _scratch_slots(flat, plan, lanes[0], window, reuse=on_cpu)  # lane 0 is the largest
    scaling = _LazyDivision(divisor, lanes)
    in_flight: deque[_Posted] = deque()
    # Completed batches stay referenced until the next batch is posted: dropping a gloo
    # work object can block on the transport, and the peers should not wait for that
    # (measured: 4 ranks x 64 KB took 30 ms per call instead of 10 ms).
    retired: list[_Posted] = []
    posted = 0
    phase = None
    for index, step in enumerate(plan):
        if step.phase != phase:
            _drain(in_flight, retired, schedule, plan, observer, chunk_bytes, scaling)
            phase = step.phase
            observer.on_phase(phase)
        for lane_index, lane in enumerate(lanes):
            if len(in_flight) == window:
                retired.append(_complete(in_flight.popleft(), schedule, plan, observer, chunk_bytes, scaling))
            in_flight.append(
                _post(index, step, lane, slots[posted % window], group, scaling, ends_step=lane_index == len(lanes) - 1)
            )
            retired.clear()
            posted += 1
    _drain(in_flight, retired, schedule, plan, observer, chunk_bytes, scaling)
    scaling.finish()
    observer.on_finish()
    return flat


class _LazyDivision:
    """Divides each chunk segment by ``divisor`` exactly once, at its first use (see above)."""

    def __init__(self, divisor: int, lanes: Sequence[Sequence[torch.Tensor]]) -> None:
        segments = [segment for lane in lanes for segment in lane if segment.numel()]
        self._pending = {s.data_ptr(): s for s in segments} if divisor != 1 else {}
        # On CPU, dividing by a 0-dim tensor takes the vectorized kernel (2.6x faster than by a
        # Python number, measured) and lets addcdiv fuse divide-and-add. On CUDA a tensor
        # divisor would be copied from the host, so there it stays a number.
        on_cpu = bool(segments) and segments[0].device.type == "cpu"
        self._by = torch.tensor(divisor, dtype=segments[0].dtype) if self._pending and on_cpu else divisor

    def before_send(self, segment: torch.Tensor) -> None:
        if self._pending.pop(segment.data_ptr(), None) is not None:
            segment.div_(self._by)

    def reduce(self, segment: torch.Tensor, received: torch.Tensor) -> None:
        if self._pending.pop(segment.data_ptr(), None) is None:
            segment.add_(received)
        elif isinstance(self._by, torch.Tensor):
            torch.addcdiv(received, segment, self._by, out=segment)
        else:
            segment.div_(self._by).add_(received)

    def overwritten(self, segment: torch.Tensor) -> None:
        """A copy replaced the segment: what it holds now is already scaled."""
        self._pending.pop(segment.data_ptr(), None)

    def finish(self) -> None:
        """Divide what no step touched (a schedule where a rank never uses some chunk)."""
        for segment in self._pending.values():
            segment.div_(self._by)
        self._pending.clear()


def _lane_count(chunk_bytes: Sequence[int], segment_bytes: int | None) -> int:
    return max(1, math.ceil(max(chunk_bytes) / (segment_bytes or SEGMENT_BYTES)))


def _split_into_lanes(chunks: Sequence[torch.Tensor], lanes: int) -> list[tuple[torch.Tensor, ...]]:
    """``lanes[j][c]`` is segment ``j`` of chunk ``c``; every rank cuts the same way."""
    if lanes == 1:
        return [tuple(chunks)]
    segments = [chunk.tensor_split(lanes) for chunk in chunks]
    return [tuple(pieces[j] for pieces in segments) for j in range(lanes)]


def _post(
    index: int,
    step: RankStep,
    lane: Sequence[torch.Tensor],
    scratch: torch.Tensor,
    group: dist.ProcessGroup | None,
    scaling: _LazyDivision,
    *,
    ends_step: bool,
) -> _Posted:
    """Post one lane's sends and receives of a step as one batch."""
    sent = {s.chunk for s in step.sends}
    ops: list[dist.P2POp] = []
    landings: list[tuple[torch.Tensor, torch.Tensor, Op]] = []
    offset = 0
    for send in step.sends:
        if lane[send.chunk].numel():
            scaling.before_send(lane[send.chunk])
            ops.append(dist.P2POp(dist.isend, lane[send.chunk], group=group, group_peer=send.peer))
    for receive in step.receives:
        segment = lane[receive.chunk]
        if not segment.numel():
            continue
        if receive.op is Op.COPY and receive.chunk not in sent:
            buffer = segment
        else:  # a sum, or a copy over a chunk this step still sends: stage it
            buffer = scratch[offset : offset + segment.numel()]
            offset += segment.numel()
        ops.append(dist.P2POp(dist.irecv, buffer, group=group, group_peer=receive.peer))
        landings.append((segment, buffer, receive.op))
    works = _start(ops)
    return _Posted(index, ops, works, landings, ends_step)


def _start(ops: list[dist.P2POp]) -> list[dist.Work]:
    """Start a step's sends and receives.

    NCCL needs them as one ``batch_isend_irecv`` group, or a send posted before its peer's
    receive could deadlock. gloo starts each operation asynchronously on its own, and the
    batching machinery around them costs as much as the messages themselves (measured with 2
    ranks: 216 µs instead of 121 µs per exchange of one element, 1.67 ms instead of 1.13 ms
    for 1 MiB), so on CPU they are started one by one, in the same order on every rank.
    """
    if not ops:
        return []
    if ops[0].tensor.is_cuda:
        return dist.batch_isend_irecv(ops)
    return [
        dist.isend(op.tensor, group=op.group, group_dst=op.group_peer)
        if op.op is dist.isend
        else dist.irecv(op.tensor, group=op.group, group_src=op.group_peer)
        for op in ops
    ]


def _complete(
    posted: _Posted,
    schedule: Schedule,
    plan: Sequence[RankStep],
    observer: ExecutionObserver,
    chunk_bytes: Sequence[int],
    scaling: _LazyDivision,
) -> _Posted:
    """Wait for a posted batch, then apply what it received; return the batch."""
    try:
        for work in posted.works:
            work.wait()
    except RuntimeError as error:  # name the step and the peer, not just a socket
        raise StepFailedError.from_wait(
            error, schedule=schedule, step_index=posted.index, step=plan[posted.index],
            ops=posted.ops, works=posted.works, failed=work,
        ) from error
    for segment, buffer, op in posted.landings:
        if op is Op.REDUCE:
            scaling.reduce(segment, buffer)
        else:
            scaling.overwritten(segment)
            if buffer.data_ptr() != segment.data_ptr():
                segment.copy_(buffer)
    if posted.ends_step:
        observer.on_step(posted.index, plan[posted.index], chunk_bytes)
    return posted


def _drain(in_flight: deque[_Posted], retired: list[_Posted], schedule, plan, observer, chunk_bytes, scaling) -> None:
    while in_flight:
        retired.append(_complete(in_flight.popleft(), schedule, plan, observer, chunk_bytes, scaling))


def _scratch_slots(
    flat: torch.Tensor, plan: Sequence[RankStep], lane: Sequence[torch.Tensor], window: int, *, reuse: bool
) -> list[torch.Tensor]:
    """One slot per batch in flight, each big enough for the largest staged receives."""
    largest = 0
    for step in plan:
        sent = {s.chunk for s in step.sends}
        staged = sum(lane[r.chunk].numel() for r in step.receives if r.op is Op.REDUCE or r.chunk in sent)
        largest = max(largest, staged)
    scratch = _reused_buffer(flat, largest * window) if reuse else flat.new_empty(largest * window)
    return [scratch[k * largest : (k + 1) * largest] for k in range(window)]


_reusable = threading.local()


def _reused_buffer(flat: torch.Tensor, numel: int) -> torch.Tensor:
    """A CPU buffer of ``numel`` elements, kept per thread and dtype, grown when too small.

    Per thread, because the comm worker and the main thread may run schedules at the same
    time. Its size is bounded by ``SEGMENTS_IN_FLIGHT`` segments of staged receives.
    """
    buffers = getattr(_reusable, "buffers", None)
    if buffers is None:
        buffers = _reusable.buffers = {}
    buffer = buffers.get(flat.dtype)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[flat.dtype] = torch.empty(numel, dtype=flat.dtype)
    return buffer[:numel]
