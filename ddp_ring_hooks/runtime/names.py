"""The algorithm names an all-reduce can be asked for: the registry's, and ``"auto"``.

Two kinds of registered algorithm reach the runtime (see :mod:`ddp_ring_hooks.schedules.registry`):

- a schedule (:data:`ddp_ring_hooks.ALGORITHMS`: ring, tree, ...): run by the executor from
  point-to-point operations;
- one without a schedule, ``"native"``: the process group's own ``all_reduce`` (NCCL's fused
  ring/tree kernel, gloo's C++ algorithms), run by
  :func:`~ddp_ring_hooks.runtime.native.run_native`.

``"auto"`` is not an algorithm but a per-size choice among them
(:mod:`~ddp_ring_hooks.runtime.selection`). Which executor runs a name is decided by
:func:`has_schedule`, nowhere else.
"""

from __future__ import annotations

from ..schedules import algorithm_names, get_algorithm

#: The group's own all-reduce (a registry entry without a schedule).
NATIVE = "native"
#: Per bucket size, the fastest candidate under a calibrated cost model.
AUTO = "auto"


def runnable_algorithms() -> tuple[str, ...]:
    """Every registered algorithm: the schedules, then ``native``."""
    return algorithm_names()


def accepted_algorithms() -> tuple[str, ...]:
    """Every name an algorithm argument takes: :func:`runnable_algorithms`, then ``auto``
    (for ``argparse`` ``choices=`` and error messages)."""
    return (*runnable_algorithms(), AUTO)


def has_schedule(algorithm: str) -> bool:
    """Whether ``algorithm`` is run by the executor from a schedule (``native`` is not, and
    ``auto`` is a choice among algorithms, not one)."""
    return algorithm != AUTO and get_algorithm(algorithm).build is not None


def check_algorithm_name(algorithm: object, *, allow_auto: bool = True) -> None:
    """Raise the registry's ``ValueError`` (naming the choices) unless ``algorithm`` is a known name."""
    if not (allow_auto and algorithm == AUTO):
        get_algorithm(algorithm)
