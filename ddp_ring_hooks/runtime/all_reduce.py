"""``all_reduce``: the executor behind a ``dist.all_reduce``-like call, usable outside DDP."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..schedules import checked_schedule
from .executor import run_schedule
from .observer import NULL_OBSERVER, ExecutionObserver


def all_reduce(
    tensor: torch.Tensor,
    *,
    algorithm: str = "ring",
    group: dist.ProcessGroup | None = None,
    observer: ExecutionObserver = NULL_OBSERVER,
    **options,
) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group`` in place, using ``algorithm``; return it.

    Every rank ends with bit-identical values. Any shape and element count works (including
    0 and fewer elements than ranks); the sum happens in the tensor's dtype. On CUDA with NCCL
    the call only enqueues work on the current stream, like ``dist.all_reduce``.

    Example::

        >>> grad = torch.full((10,), float(dist.get_rank() + 1))
        >>> ddp_ring_hooks.all_reduce(grad)          # every rank: 1 + 2 + ... + p
    """
    if tensor.dtype == torch.bool:
        raise TypeError("all_reduce cannot sum bool tensors; convert to an integer dtype first")
    if tensor.is_sparse:
        raise TypeError("all_reduce works on dense tensors; call tensor.to_dense() first")
    schedule = checked_schedule(algorithm, dist.get_world_size(group), **options)
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = (torch.view_as_real(work) if work.is_complex() else work).view(-1)
    run_schedule(schedule, flat, group=group, observer=observer)
    if work is not tensor:
        tensor.copy_(work)
    return tensor
