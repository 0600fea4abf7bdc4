"""The algorithm names an all-reduce can be asked for, checked in one place.

Three kinds of name reach the runtime:

- a schedule (:data:`ddp_ring_hooks.ALGORITHMS`: ring, tree, ...): run by the executor from
  point-to-point operations;
- ``"native"``: the process group's own ``all_reduce`` (NCCL's fused ring/tree kernel, gloo's
  C++ algorithms), run by :func:`~ddp_ring_hooks.runtime.native.run_native`. It has no
  schedule, so it cannot be explained, animated or priced by a formula of its own;
- ``"auto"``: a per-size choice among the others (:mod:`~ddp_ring_hooks.runtime.selection`).

Every caller that takes a name (``all_reduce``, ``HookState``, ``register``, the Lightning
strategy, ``bench``) validates it with :func:`check_algorithm_name`, so a new kind of
algorithm is accepted everywhere by changing this module only.
"""

from __future__ import annotations

from .. import schedules

#: The group's own all-reduce (no schedule).
NATIVE = "native"
#: Per bucket size, the fastest candidate under a calibrated cost model.
AUTO = "auto"


def runnable_algorithms() -> tuple[str, ...]:
    """Every algorithm that reduces a tensor by itself: the schedules, then ``native``
    (also once ``native`` gets a registry record without a builder)."""
    return (*(a for a in schedules.ALGORITHMS if a != NATIVE), NATIVE)


def accepted_algorithms() -> tuple[str, ...]:
    """Every name an algorithm argument takes: :func:`runnable_algorithms`, then ``auto``
    (for ``argparse`` ``choices=`` and error messages)."""
    return (*runnable_algorithms(), AUTO)


def has_schedule(algorithm: str) -> bool:
    """Whether ``algorithm`` is run by the executor from a schedule (``native`` is not)."""
    return algorithm in schedules.ALGORITHMS


def check_algorithm_name(algorithm: object, *, allow_auto: bool = True) -> None:
    """Raise ``ValueError`` unless ``algorithm`` is a known name. An unknown one is refused by
    the registry (:func:`ddp_ring_hooks.schedules.get_algorithm`), so every entry point gives
    the same message; ``native`` (not registered: no schedule) and ``auto`` are known here."""
    if algorithm == NATIVE or (allow_auto and algorithm == AUTO):
        return
    schedules.get_algorithm(algorithm)
