"""A sparse gradient averaged as PyTorch averages it: the group's own sparse all-reduce (gloo).

``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)`` make sparse COO gradients:
only the rows a batch touched are stored (``nnz`` of them, each with its index). DDP gives each
such parameter a bucket of its own, and the bucket's buffer *is* that gradient. A schedule of
point-to-point chunks cannot reduce it (its chunks would be rows that other ranks do not have);
densifying it first would move the whole table, gigabytes for a large embedding. gloo reduces
it by gathering (``AsyncSparseAllreduceWork`` in ``ProcessGroupGloo.cpp``)::

    rank 0: rows {1, 4}    rank 1: rows {4, 7}
    1. every rank coalesces its gradient (duplicate rows added, rows sorted)
    2. all-gather the counts, then every rank's indices and values
    3. each rank adds them up locally, in rank order, and coalesces: rows {1, 4, 7}, the same
       bits on every rank (the same additions in the same order)

Cost: each rank's indices and values reach every other rank, ``O(p * nnz)`` bytes, against
``2(p-1)/p * n`` for a ring over the dense table of ``n`` bytes: the gather wins while the
ranks together touch a small share of the rows (``docs/hook.md``).

:func:`run_sparse` is PyTorch's ``allreduce_hook`` on such a bucket, step for step: divide by
the world size first (in place, on the uncoalesced gradient, as ``allreduce_hook`` does), then
the group's ``all_reduce``; so its result is ``allreduce_hook``'s bit for bit. It coalesces the
tensor itself before the all-reduce (gloo would, and skips a tensor already coalesced), so the
indices and values it hands gloo are the ones counted as its bytes. NCCL has no sparse
all-reduce (only in its experimental branch): :func:`check_sparse_backend` refuses it with the fix.

Like ``native``, it runs on the calling thread (DDP's hook thread), in DDP's order: one
collective per bucket, no Python work to move off that thread.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .collectives import backend_for
from .observer import NULL_OBSERVER, ExecutionObserver

#: The phase sparse buckets report (one phase: the whole gather, its sums included).
PHASE = "sparse-all-reduce"


def check_sparse_backend(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Refuse a sparse tensor (or the parameter of one) whose device's backend in ``group`` has
    no sparse all-reduce (NCCL)."""
    backend = str(dist.get_backend(group))
    if backend_for(backend, tensor.device.type) == "nccl":
        raise TypeError(
            f"a sparse gradient bucket ({tuple(tensor.shape)}, from nn.Embedding/nn.EmbeddingBag(sparse=True)) "
            f"reached a process group whose backend for {tensor.device.type} tensors is NCCL, which has no sparse "
            "all-reduce (\"allreduce_sparse is only available in the NCCL experimental branch\"). Use gloo for this "
            "model (backend='gloo', or 'cpu:gloo,cuda:nccl' with the embedding on the CPU), register with "
            "sparse='dense' (the bucket goes through the schedule as a dense tensor: its whole table on the wire), "
            "or build the embedding with sparse=False"
        )


def run_sparse(
    tensor: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    observer: ExecutionObserver = NULL_OBSERVER,
    average: bool = True,
    coalesced: Callable[[torch.Tensor], None] | None = None,
) -> torch.futures.Future:
    """Sum (``average=True``: average) the sparse COO ``tensor`` over ``group`` with the group's
    sparse all-reduce; return a Future that completes with the result: a coalesced sparse tensor
    of ``tensor``'s size (``tensor`` itself is divided in place; see the module docstring).

    ``coalesced``: called with the coalesced tensor before it is sent (its indices and values
    are what this rank's share of the gather is: the telemetry counts them).
    """
    check_sparse_backend(tensor, group)
    observer.on_phase(PHASE)
    if average:
        tensor.div_(dist.get_world_size(group))  # first, on the gradient as DDP made it: allreduce_hook's order
    sent = tensor.coalesce()
    if coalesced is not None:
        coalesced(sent)
    work = dist.all_reduce(sent, group=group, async_op=True)

    def finished(future: torch.futures.Future) -> torch.Tensor:
        future.value()  # raises the backend's error, which DDP then raises at the end of backward
        observer.on_finish()
        return sent  # gloo copied the sum into it

    return work.get_future().then(finished)
