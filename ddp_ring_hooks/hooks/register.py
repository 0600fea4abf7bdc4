"""``register``: one call that builds the hook state and attaches the hook to a DDP model."""

from __future__ import annotations

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .ring_hook import ring_hook
from .state import HookState


def register(
    ddp_model: DistributedDataParallel,
    *,
    algorithm: str = "ring",
    process_group: dist.ProcessGroup | None = None,
    **options,
) -> HookState:
    """Attach :func:`ring_hook` to ``ddp_model`` and return its :class:`HookState`.

    ``process_group`` defaults to the model's own group. ``options`` go to :class:`HookState`.

    Example::

        >>> model = DistributedDataParallel(net)
        >>> state = ddp_ring_hooks.register(model, algorithm="ring")
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"register needs a DistributedDataParallel model, got {type(ddp_model).__name__}; "
            "wrap it first: DistributedDataParallel(model)"
        )
    attached = ddp_model._get_ddp_logging_data().get("comm_hook")
    if attached:
        raise RuntimeError(
            f"this DDP model already has the communication hook {attached!r}; DDP allows one "
            "hook per model, so build a new DistributedDataParallel to register another"
        )
    state = HookState(process_group or ddp_model.process_group, algorithm, **options)
    ddp_model.register_comm_hook(state, ring_hook)
    return state
