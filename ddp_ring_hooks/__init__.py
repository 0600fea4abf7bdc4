"""ddp_ring_hooks: ring all-reduce (and friends) as PyTorch DDP communication hooks.

Public API::

    all_reduce(tensor, *, algorithm="ring", group=None)      # sum in place, outside DDP
    # algorithm: one of ALGORITHMS (schedules), "native" (the group's own all_reduce), "auto"
    HookState(process_group=None, algorithm="ring", ...)     # state for ...
    ring_hook(state, bucket)                                 # ... ddp.register_comm_hook
    register(ddp_model, *, algorithm="ring", process_group=None, **options)
"""

from .hooks import HookState, register, ring_hook
from .runtime import all_reduce
from .schedules import ALGORITHMS

__version__ = "0.1.0"

__all__ = ["ALGORITHMS", "HookState", "__version__", "all_reduce", "register", "ring_hook"]
