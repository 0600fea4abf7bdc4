"""Where a CUDA bucket's schedule runs: a side stream, a worker thread, a group of its own.

Why each piece (checked against PyTorch's own ``ProcessGroupNCCL``, ``torch.cuda.streams``
and ``torch.futures`` semantics; none of this has run on a GPU yet, see ``docs/gpu.md``):

- **A communication stream per communicator and device** (the group's context keeps them:
  :meth:`~ddp_ring_hooks.runtime.group_context.GroupContext.stream`; one stream per
  communicator: two communicators' NCCL streams both wait for the stream they are launched
  from, so sharing one would turn the host order of two threads, which may differ between
  ranks, into a GPU dependency between communicators: a cross-rank deadlock). The hook is
  called on the autograd thread, whose current stream is backward's compute stream. If the
  schedule's ``work.wait()`` calls and additions were enqueued there, every kernel of earlier
  layers would queue behind the whole ring. So the hook records an event on the compute stream
  *at the moment the bucket is handed over* (the hook's hand-over mark, which telemetry's timer
  also reads), and the worker makes the side stream wait for that event
  (:func:`wait_handed_over`: ``cudaStreamWaitEvent``, no host wait) as the first
  thing of the bucket's job, not at hand-over: a wait queued at hand-over would hold back
  everything the worker is still queuing for the *previous* bucket. Everything of the bucket
  after that goes on the side stream: NCCL's own stream waits for the side stream at
  each launch (ProcessGroupNCCL syncs with the *current* stream), ``work.wait()`` makes the
  side stream wait for NCCL's, the additions run on it, scratch is allocated and reused on it.
- **The Future completes on that stream.** The worker's thread keeps the side stream as its
  current stream for its whole life (set once when the thread starts), so
  ``Future(devices=[device]).set_result`` records its completion event on the side stream;
  DDP's end of backward calls ``wait()`` on it, which makes DDP's current stream wait for
  that event: stream-ordered, no host sync.
- **A worker thread per hook group and device** (the lane
  :func:`~ddp_ring_hooks.runtime.lanes.cuda_lane` of the group's context). A ring at p=8 is 14
  ``batch_isend_irecv`` launches, ~15 elementwise kernels and ~28 stream waits per bucket, all
  issued from Python (~1 ms of host time per bucket); on the autograd thread that time is
  taken from launching backward's kernels. The worker takes buckets in DDP's order (FIFO, the
  same on every rank), so every rank issues the same sequence of NCCL calls.
- **A dedicated process group** (the context's, made by its one rule for side groups,
  :func:`~ddp_ring_hooks.runtime.group_context.side_group`) for the worker's point-to-point
  operations. NCCL requires every rank to issue the operations of one communicator in the
  same order; DDP issues its own collectives on the model's group from the autograd thread
  (the unused-parameter all-reduce of ``find_unused_parameters``, ``Join``), so a worker
  sharing that communicator could interleave differently on different ranks and deadlock.
  Cost: **one more NCCL communicator per hook group** (created lazily by NCCL at the first
  point-to-point call: NCCL's buffers per peer and channel, by default a few tens of MB of
  GPU memory per rank, and its own set of proxy threads). Made at registration, where every
  rank is present; only the group's members take part, and c10d never hears of it (so no
  later group's name changes on some ranks only). Not registered, so the executor batches
  on it through the group's own coalescing calls (:func:`~.compat.batched_p2p`).
- **A gloo control group** (the context's
  :meth:`~ddp_ring_hooks.runtime.group_context.GroupContext.control_group`: the group itself when
  it has gloo for the CPU, else a side group) for host-side agreement (the layout check in the
  first iterations, the ranks' nodes). All-gathering those integers on NCCL would need a CUDA tensor
  and a copy back to the host: a sync on the autograd thread, refused by
  ``torch.cuda.set_sync_debug_mode("error")``. On gloo it is a host-side message only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collectives import backend_for
from .worker import CommWorker


@dataclass(frozen=True)
class CudaLane:
    """What a CUDA bucket of one hook group runs on (see the module docstring)."""

    device: torch.device
    stream: torch.cuda.Stream
    group: dist.ProcessGroup  # dedicated to the worker's point-to-point operations
    worker: CommWorker


def carries_cuda(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` moves CUDA tensors (NCCL, alone or in a mixed group)."""
    return backend_for(str(dist.get_backend(group)), "cuda") is not None


def on_lane_thread(device: torch.device, stream: torch.cuda.Stream) -> Callable[[], None]:
    """What a CUDA lane's thread runs first: its current device and stream, for its whole life
    (kernels, NCCL launches, event marks and the Futures it completes all land on the side stream)."""

    def start() -> None:
        torch.cuda.set_device(device)
        torch.cuda.set_stream(stream)

    return start


def stream_after(stream: torch.cuda.Stream, device: torch.device) -> torch.cuda.Stream:
    """``stream``, made to wait (on the GPU, not the host) for the work enqueued so far on the
    calling thread's current stream of ``device``: for a caller that enqueues the whole bucket
    right here (``native`` on the hook thread)."""
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def wait_handed_over(event: torch.cuda.Event) -> None:
    """On the worker: make its current (side) stream wait for ``event``, recorded on the hook
    thread's current (compute) stream as the bucket was handed over; no host wait. The wait
    takes the event as recorded now: recording it again later (the timer recycles its events
    once read) does not change what the stream waits for (CUDA's ``cudaStreamWaitEvent``)."""
    torch.cuda.current_stream().wait_event(event)
