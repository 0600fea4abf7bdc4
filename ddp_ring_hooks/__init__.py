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

Each public name is imported the first time it is used (a module ``__getattr__``, PEP 562):
``import ddp_ring_hooks`` alone does not import torch, so the command line answers ``--help``,
``lab``, ``explain`` and ``model`` without paying for it (about 2.4 s), and the pure layers
(schedules, the cost model, the advisor, the lab) import on a machine without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: Each public name and the module that defines it.
_PUBLIC = {
    "ALGORITHMS": ".schedules",
    "BucketLayoutMismatchError": ".hooks.layout_check",
    "CommunicationError": ".runtime.errors",
    "HookFailedError": ".hooks.errors",
    "HookState": ".hooks",
    "StepFailedError": ".runtime.errors",
    "accepted_algorithms": ".runtime.names",
    "all_reduce": ".runtime",
    "register": ".hooks",
    "ring_hook": ".hooks",
}

__all__ = sorted([*_PUBLIC, "__version__"])

if TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ imports them
    from .hooks import HookState, register, ring_hook
    from .hooks.errors import HookFailedError
    from .hooks.layout_check import BucketLayoutMismatchError
    from .runtime import all_reduce
    from .runtime.errors import CommunicationError, StepFailedError
    from .runtime.names import accepted_algorithms
    from .schedules import ALGORITHMS


def __getattr__(name: str):
    """Import a public name on first use, then keep it as a plain attribute."""
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
