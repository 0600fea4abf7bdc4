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
the group's ``all_reduce`` of that gradient as it is; so its result is ``allreduce_hook``'s bit
for bit, and so is its time. gloo coalesces it (step 1) on its own thread: coalescing it here
first made the gather 0.5-0.6 ms slower at 2 ranks (a 512-row gradient of a 100000 x 64
table), what kept this hook above ``allreduce_hook``'s time. Its bytes are counted as gloo
coalesces them (``runtime/wire.py``'s ``coalesced_nnz``, at hand-over). NCCL has no sparse
all-reduce (only in its experimental branch): :func:`check_sparse_backend` refuses it with the fix.

Like ``native``, it runs on the calling thread (DDP's hook thread), in DDP's order: one
collective per bucket, no Python work to move off that thread.

``sparse="dense"`` (``hooks/executors.py``'s ``Densified``) instead makes the dense table
(``to_dense``: duplicate rows added), reduces it with the chosen schedule and makes it sparse
again with :func:`sparsify`: the rows whose average is not zero. Those two passes over the
table are part of the bucket's time (its phases :data:`DENSIFY` and :data:`SPARSIFY`): for a
100000 x 64 table ``Tensor.to_sparse(1)`` alone took 85-130 ms at 2 ranks, four times the
ring's 25 ms, which :func:`sparsify` does in 4-5 ms.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import backend_for
from .daemons import backend_callback
from .observer import NULL_OBSERVER, ExecutionObserver

#: The phase sparse buckets report (one phase: the whole gather, its sums included).
PHASE = "sparse-all-reduce"
#: The phases a densified bucket adds around its schedule's: the dense table made, and made
#: sparse again (``sparse="dense"``).
DENSIFY, SPARSIFY = "densify", "sparsify"


def makes_sparse_gradients(module: torch.nn.Module) -> bool:
    """Whether DDP expects sparse gradients of ``module``'s own parameters: its rule
    (``DistributedDataParallel._build_params_for_reducer``), an ``nn.Embedding`` or
    ``nn.EmbeddingBag`` built with ``sparse=True``. Each such parameter gets a bucket of its own."""
    return isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse


def sparse_parameters(module: torch.nn.Module) -> set[int]:
    """The ``id`` of every parameter of ``module`` whose gradient DDP expects sparse."""
    return {id(param) for child in module.modules() if makes_sparse_gradients(child)
            for param in child.parameters(recurse=False)}


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
) -> torch.futures.Future:
    """Sum (``average=True``: average) the sparse COO ``tensor`` over ``group`` with the group's
    sparse all-reduce; return a Future that completes with the result: ``tensor`` itself, into
    which gloo copies the coalesced sum (it is divided in place first; see the module docstring).
    """
    check_sparse_backend(tensor, group)
    observer.on_phase(PHASE)
    if average:
        tensor.div_(dist.get_world_size(group))  # first, on the gradient as DDP made it: allreduce_hook's order
    work = dist.all_reduce(tensor, group=group, async_op=True)

    @backend_callback  # runs on gloo's thread
    def finished(future: torch.futures.Future) -> torch.Tensor:
        future.value()  # raises the backend's error, which DDP then raises at the end of backward
        observer.on_finish()
        return tensor  # gloo copied the coalesced sum into it

    return work.get_future().then(finished)


def sparsify(table: torch.Tensor, sparse_dim: int) -> torch.Tensor:
    """``table.to_sparse(sparse_dim)``, coalesced: the rows of a densified bucket's averaged
    table that are not all zero. For an embedding's table (``sparse_dim=1``) it finds them with
    one reduction over each row (``abs().amax``: a NaN row is kept, as ``to_sparse`` keeps it)
    and copies them out: 4-5 ms for a 100000 x 64 table, where ``to_sparse(1)`` took 85-130 ms;
    the same indices and values."""
    if sparse_dim != 1 or table.dim() < 2 or table.numel() == 0:
        return table.to_sparse(sparse_dim)
    rows = table.abs().amax(dim=tuple(range(1, table.dim()))).nonzero().squeeze(1)
    return torch.sparse_coo_tensor(rows.unsqueeze(0), table.index_select(0, rows), table.shape,
                                   is_coalesced=True, check_invariants=False)
