"""The DDP communication hook: hand each gradient bucket to the state's all-reduce."""

# No `from __future__ import annotations`: DDP checks these annotations as real objects.

import torch
import torch.distributed as dist

from .state import HookState


def ring_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket over ``state``'s group with ``state.algorithm`` (ring by default).

    Returns at once with a Future that completes when the bucket is reduced (on CUDA: when the
    work is enqueued); an error in communication fails the Future, and DDP raises it at the end
    of backward. The result is the average over ranks, bit-identical on every rank.

    Example::

        >>> state = ddp_ring_hooks.HookState(algorithm="ring")
        >>> ddp_model.register_comm_hook(state, ddp_ring_hooks.ring_hook)
    """
    return state.reduce_bucket(bucket.buffer(), is_last=bucket.is_last(), parameters=bucket.parameters, grad_bucket=bucket)
