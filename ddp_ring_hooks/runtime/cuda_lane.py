"""Where a CUDA bucket's schedule runs: a side stream, a worker thread, a group of its own.

Why each piece (checked against PyTorch's own ``ProcessGroupNCCL``, ``torch.cuda.streams``
and ``torch.futures`` semantics; none of this has run on a GPU yet, see ``docs/gpu.md``):

- **A communication stream per communicator and device** (:func:`comm_stream`). The hook is
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
- **A worker thread per hook group and device** (:func:`cuda_lane`). A ring at p=8 is 14
  ``batch_isend_irecv`` launches, ~15 elementwise kernels and ~28 stream waits per bucket, all
  issued from Python (~1 ms of host time per bucket); on the autograd thread that time is
  taken from launching backward's kernels. The worker takes buckets in DDP's order (FIFO, the
  same on every rank), so every rank issues the same sequence of NCCL calls.
- **A dedicated process group** (:func:`dedicated_group`) for the worker's point-to-point
  operations. NCCL requires every rank to issue the operations of one communicator in the
  same order; DDP issues its own collectives on the model's group from the autograd thread
  (the unused-parameter all-reduce of ``find_unused_parameters``, ``Join``), so a worker
  sharing that communicator could interleave differently on different ranks and deadlock.
  Cost: **one more NCCL communicator per hook group** (created lazily by NCCL at the first
  point-to-point call: NCCL's buffers per peer and channel, by default a few tens of MB of
  GPU memory per rank, and its own set of proxy threads). Made at registration, where every
  rank is present; only the group's members take part (``use_local_synchronization``).
- **A gloo control group** (:func:`control_group`) for host-side agreement (the layout check
  in the first iterations). All-gathering those integers on NCCL would need a CUDA tensor
  and a copy back to the host: a sync on the autograd thread, refused by
  ``torch.cuda.set_sync_debug_mode("error")``. On gloo it is a host-side message only.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collectives import backend_for
from .worker import CommWorker, worker_for

_LOCK = threading.Lock()
# (owner, device) -> stream. One stream per communicator: two communicators' NCCL streams both
# wait for the stream they are launched from, so sharing one would turn the host order of two
# threads (which may differ between ranks) into a GPU dependency between communicators: a
# cross-rank deadlock.
_STREAMS: dict[tuple[object, torch.device], torch.cuda.Stream] = {}
# Weak keys: holding a process group would keep it alive past destroy_process_group.
_DEDICATED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CONTROL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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


def comm_stream(device: torch.device, owner: object = "native") -> torch.cuda.Stream:
    """The communication stream of ``owner`` (a communicator: ``"native"`` for the groups' own
    all-reduce issued from the hook thread, or a hook group's id for its worker) on
    ``device``, made once per process."""
    device = torch.device(device)
    with _LOCK:
        stream = _STREAMS.get((owner, device))
        if stream is None:
            stream = _STREAMS[(owner, device)] = torch.cuda.Stream(device=device)
        return stream


def stream_after_current(device: torch.device, owner: object = "native") -> torch.cuda.Stream:
    """:func:`comm_stream`, made to wait (on the GPU, not the host) for the work enqueued so
    far on the calling thread's current stream of ``device``: for a caller that enqueues the
    whole bucket right here (``native`` on the hook thread)."""
    stream = comm_stream(device, owner)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def wait_handed_over(event: torch.cuda.Event) -> None:
    """On the worker: make its current (side) stream wait for ``event``, recorded on the hook
    thread's current (compute) stream as the bucket was handed over; no host wait. The wait
    takes the event as recorded now: recording it again later (the timer recycles its events
    once read) does not change what the stream waits for (CUDA's ``cudaStreamWaitEvent``)."""
    torch.cuda.current_stream().wait_event(event)


def dedicated_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A group with the same ranks and backend as ``group``, for the worker's NCCL calls.

    Collective over the members of ``group`` the first time (registration); cached after."""
    group = group if group is not None else dist.group.WORLD
    with _LOCK:
        made = _DEDICATED.get(group)
    if made is None:
        made = dist.new_group(
            dist.get_process_group_ranks(group), backend=str(dist.get_backend(group)),
            use_local_synchronization=True,
        )
        with _LOCK:
            _DEDICATED[group] = made
    return made


def control_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A group that moves CPU tensors with the ranks of ``group``: ``group`` itself when it
    has gloo for the CPU, else a gloo group made once (collective over its members)."""
    group = group if group is not None else dist.group.WORLD
    if backend_for(str(dist.get_backend(group)), "cpu") is not None:
        return group
    with _LOCK:
        made = _CONTROL.get(group)
    if made is None:
        made = dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)
        with _LOCK:
            _CONTROL[group] = made
    return made


def prepare(group: dist.ProcessGroup | None) -> None:
    """At registration, on every rank: make the side groups a CUDA hook on ``group`` will use,
    while every rank is known to be here (a later first bucket would also work, but would
    put a store round trip into the first backward pass)."""
    # A state built before init_process_group makes them on its first CUDA bucket instead.
    if dist.is_available() and dist.is_initialized() and carries_cuda(group):
        dedicated_group(group)
        control_group(group)


def cuda_lane(group: dist.ProcessGroup | None, device: torch.device) -> CudaLane:
    """The lane CUDA buckets of ``group`` on ``device`` run on; its worker is found by
    :func:`~ddp_ring_hooks.runtime.workers_of` (``group``), so ``HookState.close`` stops it."""
    group = group if group is not None else dist.group.WORLD
    device = torch.device(device)
    stream = comm_stream(device, owner=id(group))

    def on_thread_start() -> None:
        # The thread's current device and stream, for its whole life: kernels, NCCL launches,
        # event marks and the Futures it completes all land on the side stream.
        torch.cuda.set_device(device)
        torch.cuda.set_stream(stream)

    worker = worker_for(group, ("cuda", device.index), on_start=on_thread_start)
    return CudaLane(device=device, stream=stream, group=dedicated_group(group), worker=worker)
