"""Checks that turn bad configuration into a clear error at registration, not a hang later.

A hook that starts sending with a wrong setting fails late and far from the cause: in the
first backward pass, on another rank, or never (a deadlock). So :func:`validate_registration`
(with :func:`validate_algorithm`) checks, before the first bucket, everything that can be known
on one rank (the option names themselves are checked when ``HookState`` is built):

- the process group: torch.distributed is initialized, this rank is a member, the backend
  can do point-to-point ``batch_isend_irecv`` (gloo on CPU, NCCL on CUDA);
- the algorithm and its options: the schedule is built for the group's size and proven an
  all-reduce (e.g. ``hierarchical`` needs a ``local_size`` that divides the world size);
- the gradients: a module that makes sparse gradients (DDP hands those over as sparse buckets)
  has a group that can reduce them (gloo; NCCL has no sparse all-reduce) unless they are
  densified, and the wire dtype is narrower than each gradient dtype (or the default: as they are);
- the reducer: DDP's C++ reducer, the one that hands buckets to hooks (not the Python reducer
  of ``torch._dynamo.config.optimize_ddp="python_reducer"``, nor compiled autograd).

:func:`validate_bucket` is the cheap per-bucket part (dtype and layout of the buffer) for
hooks that were attached without :func:`~ddp_ring_hooks.register`. What one rank cannot know
(whether the other ranks built the same buckets) is checked across ranks in
:mod:`~ddp_ring_hooks.hooks.layout_check`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import names
from ..runtime.collectives import check_device_backend
from ..runtime.sparse import check_sparse_backend, makes_sparse_gradients
from ..runtime.wire import wire_dtype_for
from ..schedules import checked_schedule

#: Backends whose point-to-point operations the executor uses.
SUPPORTED_BACKENDS = ("gloo", "nccl")


def validate_registration(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Before the state is built: the group can carry the hook."""
    validate_group(group)


def validate_reducer(ddp_model: nn.Module) -> None:
    """Refuse the DDP modes that never hand a gradient bucket to a hook.

    With ``torch._dynamo.config.optimize_ddp = "python_reducer"`` (set before the DDP model is
    built; what compiled autograd needs), DDP replaces its C++ reducer by per-parameter hooks
    that call every communication hook once per parameter with a ``(grad, param)`` tuple and
    ignore what it returns, so a bucket hook would fail or reduce nothing. Compiled autograd
    with the C++ reducer is refused by PyTorch itself at the first backward (it would skip the
    collectives); here it is refused at registration, with the fix that keeps the hook. The
    default ``optimize_ddp="ddp_optimizer"`` keeps the C++ reducer under ``torch.compile``.
    """
    from torch._dynamo import compiled_autograd
    from torch._dynamo import config as dynamo_config

    default_mode = (
        'torch._dynamo.config.optimize_ddp = "ddp_optimizer" (the default, under which torch.compile '
        "works with the hook)"
    )
    if getattr(ddp_model, "_use_python_reducer", False):
        raise RuntimeError(
            'this DDP model was built with torch._dynamo.config.optimize_ddp = "python_reducer" (the mode '
            "compiled autograd needs): its Python reducer calls communication hooks once per parameter with "
            "a (grad, param) tuple and ignores what they return, so ring_hook, which reduces DDP's gradient "
            f"buckets, cannot run there. Set {default_mode} before building the DDP model, and keep "
            "compiled autograd off"
        )
    if getattr(dynamo_config, "compiled_autograd", False) or compiled_autograd.compiled_autograd_enabled:
        raise RuntimeError(
            "compiled autograd is on: it cannot run DDP's C++ reducer, the only one that hands gradient buckets "
            "to a hook, and with the python_reducer it needs, DDP calls hooks per parameter instead. To use "
            f"ring_hook, turn it off (torch._dynamo.config.compiled_autograd = False) and keep {default_mode}"
        )


def validate_group(group: dist.ProcessGroup | None) -> None:
    """Raise a clear error unless ``group`` (``None``: the default group) can carry the hook."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call dist.init_process_group('gloo') (CPU) or "
            "dist.init_process_group('nccl') (CUDA) before the first backward pass, as DDP needs"
        )
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the hook's process "
            "group: dist.new_group returns a placeholder on ranks outside it. Pass a group that "
            "contains every rank running this DDP model, or process_group=None for the default group"
        )
    backend = str(dist.get_backend(group))
    # Mixed groups read like "cpu:gloo,cuda:nccl": every device's backend must do P2P.
    names = [part.rpartition(":")[2] for part in backend.split(",")]
    if not all(name in SUPPORTED_BACKENDS for name in names):
        raise ValueError(
            f"the hook's process group uses the {backend!r} backend, which ddp_ring_hooks cannot "
            f"use: it needs point-to-point batch_isend_irecv, supported here on "
            f"{' and '.join(SUPPORTED_BACKENDS)}. Create the group with backend='gloo' (CPU "
            "tensors) or backend='nccl' (CUDA tensors)"
        )


def validate_bucket_on(buffer: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """The first buckets' part: ``group`` can carry the hook (:func:`validate_group`), and its
    backend carries tensors of ``buffer``'s device."""
    validate_group(group)
    check_device_backend(buffer.device.type, str(dist.get_backend(group)))


def validate_algorithm(algorithm: str, world_size: int, options: dict) -> None:
    """Build and prove the schedule of a known algorithm for ``world_size`` ranks (its options
    were checked when the state was built), turning a builder's complaint about the group size
    into a message with context. ``auto`` checks its candidates itself; ``native`` has no schedule."""
    if not names.has_schedule(algorithm):
        return
    try:
        checked_schedule(algorithm, world_size, **options)
    except ValueError as error:
        shown = ", ".join(f"{k}={v!r}" for k, v in sorted(options.items())) or "no options"
        raise ValueError(
            f"the {algorithm} algorithm cannot run on this process group of {world_size} ranks "
            f"with {shown}: {error}"
        ) from error


def validate_wire(module: nn.Module, options: dict) -> None:
    """Refuse, at registration, a wire dtype that is not narrower than the gradients DDP will
    hand over (their dtype is the parameters'); the first bucket would be refused the same way."""
    for dtype in sorted({p.dtype for p in module.parameters() if p.requires_grad}, key=str):
        wire_dtype_for(dtype, options)


def sparse_modules(module: nn.Module) -> dict[str, nn.Module]:
    """``module``'s parts that make sparse gradients (``nn.Embedding`` or ``nn.EmbeddingBag``
    with ``sparse=True``), by name: DDP hands each to the hook as a sparse bucket."""
    return {
        name or type(module).__name__: child
        for name, child in module.named_modules()
        if makes_sparse_gradients(child)
    }


def validate_sparse(module: nn.Module, group: dist.ProcessGroup | None, *, densify: bool, feedback: bool) -> None:
    """Refuse, at registration, sparse gradients the hook could not reduce: on NCCL without
    ``sparse="dense"`` (no sparse all-reduce there), or densified with error feedback (a residual
    as large as the whole table). The first such bucket would be refused the same way."""
    sparse = sparse_modules(module)
    if not densify:
        for child in sparse.values():
            check_sparse_backend(child.weight, group)
    elif feedback and sparse:
        raise TypeError(
            f"{', '.join(sparse)} make{'s' if len(sparse) == 1 else ''} sparse gradients, which sparse='dense' "
            "densifies, and error_feedback=True would keep a residual as large as each whole table: keep "
            "sparse='gather' (the default: sent as they are, nothing rounded) or error_feedback=False"
        )


def validate_bucket(buffer: torch.Tensor) -> None:
    """The per-bucket check: a dense (or sparse COO) floating-point or complex buffer (cheap: no data read)."""
    if buffer.layout not in (torch.strided, torch.sparse_coo):
        raise TypeError(
            f"ring_hook got a {buffer.layout} gradient bucket; it reduces dense buckets and the sparse COO ones "
            "DDP makes for nn.Embedding(sparse=True) / nn.EmbeddingBag(sparse=True)"
        )
    if not (buffer.is_floating_point() or buffer.is_complex()):
        raise TypeError(
            f"ring_hook averages gradients, but got a {buffer.dtype} bucket: an average of integers "
            "is not an integer. Use floating-point (or complex) tensors, or sum integer tensors "
            "with ddp_ring_hooks.all_reduce(tensor)"
        )
