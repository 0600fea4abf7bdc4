"""All-reduce algorithms as pure data (no torch import), with a registry by name.

``build_schedule("ring", world_size=4)`` returns a :class:`Schedule`; :func:`check_all_reduce`
proves it is an all-reduce. New algorithms add a builder to :data:`BUILDERS`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from .check import ScheduleError, check_all_reduce
from .halving_doubling import build_halving_doubling_schedule
from .hierarchical import build_hierarchical_schedule
from .ir import Op, RankStep, Receive, Schedule, Send, Step, Transfer
from .naive import build_naive_schedule
from .replay import final_state, replay
from .ring import build_ring_schedule
from .tree import build_tree_schedule

#: Algorithm name -> builder ``(world_size, **options) -> Schedule``.
BUILDERS: dict[str, Callable[..., Schedule]] = {
    "ring": build_ring_schedule,
    "naive": build_naive_schedule,
    "tree": build_tree_schedule,
    "halving_doubling": build_halving_doubling_schedule,
    "hierarchical": build_hierarchical_schedule,
}

ALGORITHMS: tuple[str, ...] = tuple(BUILDERS)


def build_schedule(algorithm: str, world_size: int, **options) -> Schedule:
    """Build the schedule of ``algorithm`` for ``world_size`` ranks.

    Raises ``ValueError`` naming the known algorithms when ``algorithm`` is unknown.
    """
    if algorithm not in BUILDERS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(BUILDERS)}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    return BUILDERS[algorithm](world_size, **options)


@functools.lru_cache(maxsize=128)
def checked_schedule(algorithm: str, world_size: int, **options) -> Schedule:
    """:func:`build_schedule`, proven correct by :func:`check_all_reduce` once, then cached."""
    schedule = build_schedule(algorithm, world_size, **options)
    check_all_reduce(schedule)
    return schedule


__all__ = [
    "ALGORITHMS", "BUILDERS", "Op", "RankStep", "Receive", "Schedule", "ScheduleError", "Send",
    "Step", "Transfer", "build_halving_doubling_schedule", "build_hierarchical_schedule",
    "build_naive_schedule", "build_ring_schedule", "build_tree_schedule", "build_schedule", "check_all_reduce",
    "checked_schedule", "final_state", "replay",
]
