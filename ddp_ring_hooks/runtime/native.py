"""``native``: a bucket reduced by the process group's own ``all_reduce``, timed like the others.

This is what DDP runs without a hook (NCCL's fused ring/tree kernel on GPUs, gloo's C++
algorithms on CPUs), run through the hook so that every bucket gets the same telemetry as our
schedules (``time_ms``, ``bytes``, ``busbw_GBps``, ``queue_ms``, exposed time): profiling any
DDP run at native speed is ``register(model, algorithm="native", log_dir=...)``.

**Bit-identical to DDP without a hook.** DDP's reducer, when no hook is registered,
*multiplies* each gradient by ``1 / world_size`` as it copies it into the bucket
(``at::mul_out(bucket_view, grad, wrapped_scalar_tensor(1.0 / div_factor))`` in
``reducer.cpp``) and then sums the bucket with ``all_reduce``. With a hook the reducer copies
the gradients unscaled, so :func:`run_native` multiplies the bucket by the same double
``1.0 / world_size`` (a Python float is passed to the kernel as the same wrapped double scalar)
and calls the same ``all_reduce``: the same numbers, bit for bit. PyTorch's ``allreduce_hook``
*divides* instead, which differs in the last bit whenever ``1 / world_size`` is not exact
(3 ranks, say). One exception, DDP's own: with ``gradient_as_bucket_view=True`` the reducer
divides (``bucket_view.div_``) from the second iteration on, where grads already live in the
bucket; ``native`` keeps multiplying there, so it may differ from hook-less DDP in the last bit
at world sizes that are not powers of two (every rank still gets identical gradients).

**Timing.** The observer's ``on_phase("all-reduce")`` mark is taken when the collective is
issued and ``on_finish`` when it completes:

- gloo: ``on_finish`` runs in a callback of the work's Future (on gloo's thread, when the
  all-reduce is done), so ``time_ms`` is issue-to-completion and the hook thread never waits.
- CUDA: the marks are CUDA events on the communication side stream
  (the group's ``"native"`` stream, :meth:`~ddp_ring_hooks.runtime.group_context.GroupContext.stream`), which first waits for the
  compute stream; the scaling kernel, NCCL's launch (NCCL's stream waits for the current one)
  and ``work.wait()`` (the side stream waits for NCCL's, no host wait) all go there, so the
  end mark fires when NCCL's kernel is done. ``queue_ms`` is the time from the handover mark
  (on the compute stream) to the start mark: how long the bucket waited behind earlier
  buckets' communication. The Future completes on the side stream; nothing syncs.

Unlike the schedules, ``native`` runs on the calling thread (the autograd thread in DDP), on the
hook's own group, exactly like DDP's builtin hook: it is one launch, so there is no Python time
to move off that thread, and issuing it there keeps it in order with DDP's other collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .cuda_lane import stream_after
from .group_context import context_of
from .observer import NULL_OBSERVER, ExecutionObserver

#: The phase name native buckets report (one phase: the whole collective).
PHASE = "all-reduce"


def run_native(
    flat: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    observer: ExecutionObserver = NULL_OBSERVER,
    average: bool = False,
) -> torch.futures.Future:
    """Sum (``average=True``: average, as DDP does) ``flat`` over ``group`` in place with the
    group's own ``all_reduce``; return a Future that completes with ``flat``.

    Returns without waiting: on CPU the Future completes when gloo is done; on CUDA it is
    complete at once, its value ready on the communication stream (``wait()`` makes the
    caller's stream wait for it, as with any CUDA Future).
    """
    scale = 1.0 / dist.get_world_size(group) if average else 1.0
    if flat.is_cuda:
        return _run_on_cuda(flat, group, observer, scale)
    if scale != 1.0:
        flat.mul_(scale)  # see the module docstring: DDP's own scaling, bit for bit
    observer.on_phase(PHASE)
    work = dist.all_reduce(flat, group=group, async_op=True)

    def finished(future: torch.futures.Future) -> torch.Tensor:
        future.value()  # raises the backend's error, which DDP then raises at end of backward
        observer.on_finish()
        return flat

    return work.get_future().then(finished)


def _run_on_cuda(flat: torch.Tensor, group, observer: ExecutionObserver, scale: float) -> torch.futures.Future:
    stream = stream_after(context_of(group).stream(flat.device, "native"), flat.device)
    with torch.cuda.stream(stream):
        if scale != 1.0:
            flat.mul_(scale)
        observer.on_phase(PHASE)
        dist.all_reduce(flat, group=group, async_op=True).wait()  # NCCL: a stream wait, no host wait
        observer.on_finish()
        # Completes now; its event is recorded on the side stream (the current one here).
        future = torch.futures.Future(devices=[flat.device])
        future.set_result(flat)
    return future
