"""Run a schedule on any kind of value, in memory, one step at a time.

The checker runs it on symbolic sums, the explainer on numbers and on sets of contributing
ranks, the animation on whatever it draws. All of them see exactly the steps the runtime
executes, because they read the same :class:`~ddp_ring_hooks.schedules.ir.Schedule`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from .ir import Op, Schedule, Step

Value = TypeVar("Value")
State = tuple[tuple[Value, ...], ...]


def replay(
    schedule: Schedule,
    initial: Sequence[Sequence[Value]],
    combine: Callable[[Value, Value], Value],
) -> Iterator[tuple[int, Step, State]]:
    """Yield ``(step_index, step, state)`` after each step; ``state[rank][chunk]`` is a value.

    ``combine(mine, received)`` is the reduction. Sends read the state from the start of the
    step, as the runtime does: it posts all sends of a step before applying any receive.
    """
    state = [list(chunks) for chunks in initial]
    if len(state) != schedule.world_size or any(len(c) != schedule.num_chunks for c in state):
        raise ValueError(
            f"initial state must be {schedule.world_size} ranks x {schedule.num_chunks} chunks"
        )
    for index, step in enumerate(schedule.steps):
        sent = [state[t.src][t.chunk] for t in step.transfers]
        for transfer, value in zip(step.transfers, sent):
            mine = state[transfer.dst][transfer.chunk]
            state[transfer.dst][transfer.chunk] = combine(mine, value) if transfer.op is Op.REDUCE else value
        yield index, step, tuple(tuple(chunks) for chunks in state)


def final_state(
    schedule: Schedule,
    initial: Sequence[Sequence[Value]],
    combine: Callable[[Value, Value], Value],
) -> State:
    """The state after the last step (the initial state for a schedule with no steps)."""
    state: State = tuple(tuple(chunks) for chunks in initial)
    for _, _, state in replay(schedule, initial, combine):
        pass
    return state
