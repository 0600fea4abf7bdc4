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

**On a narrower wire** (``wire_dtype="bf16"`` or ``"fp16"``) ``native`` is PyTorch's own
``bf16_compress_hook`` / ``fp16_compress_hook`` (``default_hooks.py``), step for step, so its
numbers are theirs bit for bit: cast the bucket to the wire dtype (a new tensor, as theirs),
divide it there by the world size, the group's ``all_reduce`` in that dtype (gloo and NCCL add
in it, rounding at every hop), copy back into the bucket. Note the order: PyTorch casts first
and divides in the narrow dtype, so an fp16 value above 65504 overflows before the division
that was to guard it; the schedules divide in fp32 first (``runtime/program.py``).

Unlike the schedules, ``native`` runs on the calling thread (the autograd thread in DDP), on the
hook's own group, exactly like DDP's builtin hook: it is one launch, so there is no Python time
to move off that thread, and issuing it there keeps it in order with DDP's other collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .cuda_lane import stream_after
from .daemons import backend_callback
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
    wire: torch.dtype | None = None,
    residual: torch.Tensor | None = None,
) -> torch.futures.Future:
    """Sum (``average=True``: average, as DDP does) ``flat`` over ``group`` in place with the
    group's own ``all_reduce``; return a Future that completes with ``flat``.

    ``wire``: a narrower dtype to all-reduce in, as PyTorch's compress hooks do (see the module
    docstring; ``None``: ``flat``'s own). ``residual``: a tensor like ``flat`` that receives
    what the cast lost of this rank's contribution (error feedback; zero without a ``wire``).

    Returns without waiting: on CPU the Future completes when gloo is done; on CUDA it is
    complete at once, its value ready on the communication stream (``wait()`` makes the
    caller's stream wait for it, as with any CUDA Future).
    """
    world_size = dist.get_world_size(group)
    scale = 1.0 / world_size if average else 1.0
    if flat.is_cuda:
        return _run_on_cuda(flat, group, observer, scale, wire, residual, world_size if average else 1)
    sent = _before(flat, scale, wire, residual, world_size if average else 1)
    observer.on_phase(PHASE)
    work = dist.all_reduce(sent, group=group, async_op=True)

    @backend_callback  # runs on gloo's thread
    def finished(future: torch.futures.Future) -> torch.Tensor:
        future.value()  # raises the backend's error, which DDP then raises at end of backward
        if sent is not flat:
            flat.copy_(sent)  # decompress in place, as PyTorch's hooks do
        observer.on_finish()
        return flat

    return work.get_future().then(finished)


def _before(flat: torch.Tensor, scale: float, wire: torch.dtype | None, residual: torch.Tensor | None,
            divisor: int) -> torch.Tensor:
    """What the collective reduces: ``flat`` scaled as DDP scales it, or PyTorch's compressed copy
    (cast, then divided in the wire dtype: ``_compress_hook`` in ``default_hooks.py``), with the
    residual of the cast and the division (``flat / divisor`` minus what is sent)."""
    if wire is None:
        if residual is not None:
            residual.zero_()
        if scale != 1.0:
            flat.mul_(scale)  # see the module docstring: DDP's own scaling, bit for bit
        return flat
    compressed = flat.to(wire)
    if divisor != 1:
        compressed.div_(divisor)
    if residual is not None:
        torch.div(flat, divisor, out=residual)
        residual.sub_(compressed.to(flat.dtype))  # widened first: a mixed-dtype subtraction is slow
    return compressed


def _run_on_cuda(flat: torch.Tensor, group, observer: ExecutionObserver, scale: float, wire, residual,
                 divisor: int) -> torch.futures.Future:
    stream = stream_after(context_of(group).stream(flat.device, "native"), flat.device)
    with torch.cuda.stream(stream):
        sent = _before(flat, scale, wire, residual, divisor)
        observer.on_phase(PHASE)
        dist.all_reduce(sent, group=group, async_op=True).wait()  # NCCL: a stream wait, no host wait
        if sent is not flat:
            flat.copy_(sent)
        observer.on_finish()
        # Completes now; its event is recorded on the side stream (the current one here).
        future = torch.futures.Future(devices=[flat.device])
        future.set_result(flat)
    return future
