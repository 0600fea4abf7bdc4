"""``all_reduce``: the executors behind a ``dist.all_reduce``-like call, usable outside DDP."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..schedules import checked_schedule, resolve_options
from .collectives import check_device_backend
from .executor import run_schedule
from .names import AUTO, check_algorithm_name, has_schedule
from .native import run_native
from .observer import NULL_OBSERVER, ExecutionObserver
from .ring_orders import settle_ring_order
from .selection import selector_for
from .wire import tensor_bytes, wire_dtype_for


def all_reduce(
    tensor: torch.Tensor,
    *,
    algorithm: str = "ring",
    group: dist.ProcessGroup | None = None,
    observer: ExecutionObserver = NULL_OBSERVER,
    **options,
) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group`` in place, using ``algorithm``; return it.

    ``algorithm``: a schedule (:data:`ddp_ring_hooks.ALGORITHMS`), ``"native"`` (the group's
    own ``all_reduce``) or ``"auto"`` (per size, the candidate a calibrated cost model predicts
    fastest; the first call with given options probes every candidate, collectively, and is
    remembered per group; its own options ``candidates=`` and ``calibration=``, and every
    algorithm's, for the candidates that take them, as for the hook). Other options are the
    algorithm's own (``segments=``, ``local_size=``, ``ring_order=``, ...: its registry record
    lists them).

    Every rank ends with bit-identical values. Any shape and element count works (including
    0 and fewer elements than ranks); the sum happens in the tensor's dtype. With
    ``wire_dtype="bf16"`` (or ``"fp16"``) the transfers carry half the bytes: every partial
    sum is added in the tensor's dtype and rounded once to the wire dtype when sent, and the
    result is rounded to it too, the same bits on every rank (``native``: PyTorch's
    ``bf16_compress_hook`` way, see ``runtime/native.py``). On CUDA with NCCL the call only
    enqueues work (the current stream then waits for it), like ``dist.all_reduce``.

    Example::

        >>> grad = torch.full((10,), float(dist.get_rank() + 1))
        >>> ddp_ring_hooks.all_reduce(grad)          # every rank: 1 + 2 + ... + p
        >>> ddp_ring_hooks.all_reduce(grad, algorithm="auto")
        >>> ddp_ring_hooks.all_reduce(grad, ring_order=[0, 2, 1, 3])   # the ring in another order
        >>> ddp_ring_hooks.all_reduce(grad, wire_dtype="bf16")         # half the bytes on the wire
    """
    check_algorithm_name(algorithm)
    if tensor.dtype == torch.bool:
        raise TypeError("all_reduce cannot sum bool tensors; convert to an integer dtype first")
    if tensor.is_sparse:
        raise TypeError("all_reduce works on dense tensors; call tensor.to_dense() first")
    check_device_backend(tensor.device.type, str(dist.get_backend(group)))
    nbytes = tensor_bytes(tensor)
    if algorithm == AUTO:
        algorithm, options = selector_for(group, device=tensor.device, **options).choose(nbytes)
    else:
        options = settle_ring_order(options, group)  # "hosts", "measured": collective on the first call
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = (torch.view_as_real(work) if work.is_complex() else work).view(-1)
    if has_schedule(algorithm):
        schedule = checked_schedule(algorithm, dist.get_world_size(group), nbytes=nbytes, **options)
        run_schedule(schedule, flat, group=group, observer=observer)
    else:  # native: the group's own all-reduce (its one option, the wire dtype: the registry says so)
        wire = wire_dtype_for(flat.dtype, resolve_options(algorithm, options))
        run_native(flat, group=group, observer=observer, wire=wire).wait()
    if work is not tensor:
        tensor.copy_(work)
    return tensor
