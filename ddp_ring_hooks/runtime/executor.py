"""Run a schedule on a flat tensor with ``torch.distributed`` point-to-point operations.

For each step of its plan, a rank posts all its sends and receives as one
``batch_isend_irecv`` batch (so their order cannot deadlock), waits for them, then applies
the receives: ``chunk += received`` for a reduce, ``chunk = received`` for a copy. Sends read
the chunk as it was before the step, exactly as the schedule's in-memory replay assumes.

- Chunks are ``flat.tensor_split(num_chunks)`` views: any element count works, uneven tails
  are allowed, and empty chunks send nothing (both ends know the sizes, so they agree).
- A copy lands directly in the chunk; a reduce lands in a scratch buffer first.
- Reductions happen in the buffer's own dtype, as NCCL does.
- On CUDA with NCCL, ``wait()`` only makes the current stream wait for the NCCL stream and the
  additions are enqueued on the current stream: the host is never blocked.
- The schedule's ranks are ranks *of the group*; ``group_peer`` lets torch map them to
  global ranks, so subgroups from ``dist.new_group`` work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..schedules import Op, Schedule
from .observer import NULL_OBSERVER, ExecutionObserver


def run_schedule(
    schedule: Schedule,
    flat: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    observer: ExecutionObserver = NULL_OBSERVER,
) -> torch.Tensor:
    """All-reduce (sum) the 1-D contiguous tensor ``flat`` in place following ``schedule``."""
    group_size = dist.get_world_size(group)
    if schedule.world_size != group_size:
        raise ValueError(
            f"the {schedule.algorithm} schedule is for {schedule.world_size} ranks but the "
            f"process group has {group_size}; build the schedule for the group's size"
        )
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("run_schedule needs a 1-D contiguous tensor; pass tensor.view(-1)")
    if group_size == 1 or flat.numel() == 0:
        observer.on_finish()
        return flat
    plan = schedule.plan_for(dist.get_rank(group))
    chunks = flat.tensor_split(schedule.num_chunks)
    chunk_bytes = [c.numel() * c.element_size() for c in chunks]
    scratch = _allocate_scratch(flat, plan, chunks)
    phase = None
    for index, step in enumerate(plan):
        if step.phase != phase:
            phase = step.phase
            observer.on_phase(phase)
        sent = {s.chunk for s in step.sends}
        ops: list[dist.P2POp] = []
        landing: list[tuple[torch.Tensor, torch.Tensor, Op]] = []  # (chunk, buffer, op)
        offset = 0
        for send in step.sends:
            if chunks[send.chunk].numel():
                ops.append(dist.P2POp(dist.isend, chunks[send.chunk], group=group, group_peer=send.peer))
        for receive in step.receives:
            chunk = chunks[receive.chunk]
            if not chunk.numel():
                continue
            if receive.op is Op.COPY and receive.chunk not in sent:
                buffer = chunk
            else:
                buffer = scratch[offset : offset + chunk.numel()]
                offset += chunk.numel()
            ops.append(dist.P2POp(dist.irecv, buffer, group=group, group_peer=receive.peer))
            landing.append((chunk, buffer, receive.op))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for chunk, buffer, op in landing:
            if op is Op.REDUCE:
                chunk.add_(buffer)
            elif buffer.data_ptr() != chunk.data_ptr():
                chunk.copy_(buffer)
        observer.on_step(index, step, chunk_bytes)
    observer.on_finish()
    return flat


def _allocate_scratch(flat: torch.Tensor, plan, chunks) -> torch.Tensor:
    """One buffer big enough for the largest set of staged receives of any step."""
    largest = 0
    for step in plan:
        sent = {s.chunk for s in step.sends}
        staged = sum(
            chunks[r.chunk].numel() for r in step.receives if r.op is Op.REDUCE or r.chunk in sent
        )
        largest = max(largest, staged)
    return flat.new_empty(largest)
