"""ddp_ring_hooks: ring all-reduce (and friends) as PyTorch DDP communication hooks.

Public API::

    register(ddp_model, *, algorithm="ring", process_group=None, **options)   # one call -> HookState
    HookState(process_group=None, algorithm="ring", ...)     # state for ...
    ring_hook(state, bucket)                                 # ... ddp.register_comm_hook
    all_reduce(tensor, *, algorithm="ring", group=None)      # sum in place, outside DDP
    accepted_algorithms()    # every name algorithm= takes: ALGORITHMS (schedules), "native", "auto"

Errors a caller may catch: :class:`CommunicationError` (base of :class:`StepFailedError`, a
schedule step that failed waiting for a peer, and :class:`HookFailedError`, the bucket and
iteration it happened in) and :class:`BucketLayoutMismatchError` (the ranks' buckets differ).
"""

from .hooks import HookState, register, ring_hook
from .hooks.errors import HookFailedError
from .hooks.layout_check import BucketLayoutMismatchError
from .runtime import all_reduce
from .runtime.errors import CommunicationError, StepFailedError
from .runtime.names import accepted_algorithms
from .schedules import ALGORITHMS

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "BucketLayoutMismatchError",
    "CommunicationError",
    "HookFailedError",
    "HookState",
    "StepFailedError",
    "__version__",
    "accepted_algorithms",
    "all_reduce",
    "register",
    "ring_hook",
]
