"""The ring schedule is an all-reduce for every world size, and the checker catches broken ones."""

from __future__ import annotations

import dataclasses

import pytest

from ddp_ring_hooks.schedules import (
    Op,
    ScheduleError,
    Step,
    Transfer,
    build_ring_schedule,
    check_all_reduce,
    final_state,
    replay,
)
from tests.conftest import imports_torch


@pytest.mark.fast
@pytest.mark.parametrize("world_size", range(1, 65))
def test_checker_accepts_ring(world_size):
    schedule = build_ring_schedule(world_size)
    check_all_reduce(schedule)
    assert len(schedule.steps) == 2 * (world_size - 1)
    assert schedule.num_chunks == world_size


@pytest.mark.fast
@pytest.mark.parametrize("world_size", [2, 3, 4, 7])
def test_every_rank_sends_two_p_minus_one_chunks(world_size):
    schedule = build_ring_schedule(world_size)
    for rank in range(world_size):
        plan = schedule.plan_for(rank)
        assert sum(len(step.sends) for step in plan) == 2 * (world_size - 1)
        assert all({s.peer for s in step.sends} == {(rank + 1) % world_size} for step in plan)


@pytest.mark.fast
def test_after_reduce_scatter_each_rank_owns_its_chunk_and_partials_elsewhere():
    """The article said one device holds the total and the others 0; that is wrong."""
    schedule = build_ring_schedule(4)
    initial = [[rank + 1] * 4 for rank in range(4)]
    states = [state for _, _, state in replay(schedule, initial, lambda a, b: a + b)]
    after_reduce_scatter = states[2]
    for rank in range(4):
        assert after_reduce_scatter[rank][rank] == 10
        assert all(0 < value < 10 for chunk, value in enumerate(after_reduce_scatter[rank]) if chunk != rank)
    assert final_state(schedule, initial, lambda a, b: a + b) == ((10,) * 4,) * 4


def _replace_step(schedule, index, step):
    steps = list(schedule.steps)
    steps[index] = step
    return dataclasses.replace(schedule, steps=tuple(steps))


@pytest.mark.fast
def test_checker_rejects_a_missing_step():
    schedule = build_ring_schedule(4)
    broken = dataclasses.replace(schedule, steps=schedule.steps[:-1])
    with pytest.raises(ScheduleError, match="missing the contribution"):
        check_all_reduce(broken)


@pytest.mark.fast
def test_checker_rejects_a_double_count():
    schedule = build_ring_schedule(3)
    first = schedule.steps[0]
    broken = dataclasses.replace(schedule, steps=(first, first) + schedule.steps[1:])
    with pytest.raises(ScheduleError, match="already holds it"):
        check_all_reduce(broken)


@pytest.mark.fast
def test_checker_rejects_copy_turned_into_reduce():
    schedule = build_ring_schedule(3)
    gather = schedule.steps[2]
    reducing = Step(gather.phase, tuple(dataclasses.replace(t, op=Op.REDUCE) for t in gather.transfers))
    with pytest.raises(ScheduleError):
        check_all_reduce(_replace_step(schedule, 2, reducing))


@pytest.mark.fast
def test_checker_rejects_different_summation_orders():
    """Two ranks each reduce the other's value: both hold x0+x1, but then sum chunk 0 of
    three ranks in different orders, so they would not be bit-identical."""
    steps = (
        Step("a", (Transfer(0, 1, 0, Op.REDUCE), Transfer(1, 0, 0, Op.REDUCE))),
        Step("b", (Transfer(1, 2, 0, Op.REDUCE),)),
        Step("c", (Transfer(2, 0, 0, Op.COPY),)),
        Step("d", (Transfer(2, 1, 0, Op.COPY),)),
    )
    ok = dataclasses.replace(build_ring_schedule(3), num_chunks=1, steps=steps)
    check_all_reduce(ok)  # all copies of x0+x1+x2 come from rank 2: identical
    skewed = steps[:2] + (Step("c", (Transfer(2, 0, 0, Op.COPY),)),)  # rank 1 keeps x0+x1 (missing x2)
    with pytest.raises(ScheduleError):
        check_all_reduce(dataclasses.replace(ok, steps=skewed))


@pytest.mark.fast
@pytest.mark.parametrize(
    "transfer, message",
    [
        (Transfer(0, 0, 0, Op.REDUCE), "sends to itself"),
        (Transfer(0, 5, 0, Op.REDUCE), "outside"),
        (Transfer(0, 1, 9, Op.REDUCE), "chunk outside"),
    ],
)
def test_checker_rejects_malformed_transfers(transfer, message):
    schedule = build_ring_schedule(3)
    broken = _replace_step(schedule, 0, Step("x", (transfer,)))
    with pytest.raises(ScheduleError, match=message):
        check_all_reduce(broken)


@pytest.mark.fast
def test_checker_rejects_two_receives_into_one_chunk():
    schedule = build_ring_schedule(3)
    racy = Step("x", (Transfer(0, 2, 1, Op.REDUCE), Transfer(1, 2, 1, Op.REDUCE)))
    with pytest.raises(ScheduleError, match="twice"):
        check_all_reduce(_replace_step(schedule, 0, racy))


def test_schedules_import_no_torch():
    assert not imports_torch("ddp_ring_hooks.schedules")
    assert imports_torch("ddp_ring_hooks.runtime")  # the check itself can say yes
