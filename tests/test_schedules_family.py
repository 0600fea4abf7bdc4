"""Naive, tree, halving-doubling and hierarchical schedules: proven all-reduces, named phases.

Pure tests (no processes): the symbolic checker proves every schedule is an all-reduce with
bit-identical results for every world size 1..64 (hierarchical: every node shape that
divides it), and the structure matches what each module's docstring promises.
"""

from __future__ import annotations

import math

import pytest

from ddp_ring_hooks.schedules import (
    ALGORITHMS,
    Op,
    build_halving_doubling_schedule,
    build_hierarchical_schedule,
    build_naive_schedule,
    build_schedule,
    build_tree_schedule,
    check_all_reduce,
    final_state,
)

pytestmark = pytest.mark.fast  # no test here starts a process

WORLD_SIZES = range(1, 65)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def test_registry_names_every_algorithm():
    assert set(ALGORITHMS) >= {"ring", "naive", "tree", "halving_doubling", "hierarchical"}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_checker_accepts_every_flat_algorithm(world_size):
    check_all_reduce(build_naive_schedule(world_size))
    check_all_reduce(build_halving_doubling_schedule(world_size))
    for segments in (1, 3):
        check_all_reduce(build_tree_schedule(world_size, segments=segments))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_checker_accepts_hierarchical_for_every_node_shape(world_size):
    # One node, or nodes of one rank, are plain rings: the slowest to check, so only a few.
    trivial = (1, world_size) if world_size in (1, 2, 6, 17, 64) else ()
    for local_size in [g for g in divisors(world_size) if 1 < g < world_size] + list(trivial):
        schedule = build_hierarchical_schedule(world_size, local_size=local_size)
        check_all_reduce(schedule)
        nodes = world_size // local_size
        assert len(schedule.steps) == 2 * (local_size - 1) + 2 * (nodes - 1)


@pytest.mark.parametrize("world_size", [1, 2, 5, 8])
def test_naive_serializes_at_the_root(world_size):
    schedule = build_naive_schedule(world_size)
    assert len(schedule.steps) == 2 * (world_size - 1)
    assert all(len(step.transfers) == 1 for step in schedule.steps)
    assert all(0 in (t.src, t.dst) for step in schedule.steps for t in step.transfers)


@pytest.mark.parametrize("world_size", [2, 3, 5, 8, 13, 64])
@pytest.mark.parametrize("segments", [1, 4])
def test_tree_takes_lg_p_plus_pipeline_steps_per_phase(world_size, segments):
    schedule = build_tree_schedule(world_size, segments=segments)
    span = math.ceil(math.log2(world_size)) + segments - 1
    assert [(name, stop - start) for name, start, stop in schedule.phases] == [("reduce", span), ("broadcast", span)]
    assert schedule.num_chunks == segments


@pytest.mark.parametrize("world_size", [2, 4, 8, 32])
def test_halving_doubling_on_powers_of_two_has_no_fold(world_size):
    schedule = build_halving_doubling_schedule(world_size)
    lg = int(math.log2(world_size))
    assert [(name, stop - start) for name, start, stop in schedule.phases] == [("reduce-scatter", lg), ("all-gather", lg)]


@pytest.mark.parametrize("world_size", [3, 6, 7, 12])
def test_halving_doubling_folds_the_extra_ranks(world_size):
    schedule = build_halving_doubling_schedule(world_size)
    pof2 = 1 << (world_size.bit_length() - 1)
    lg = int(math.log2(pof2))
    names = [(name, stop - start) for name, start, stop in schedule.phases]
    expected = [("fold", 1), ("reduce-scatter", lg), ("all-gather", lg), ("unfold", 1)]
    assert names == [(n, c) for n, c in expected if c]
    folded = {t.src for t in schedule.steps[0].transfers}
    assert folded == set(range(0, 2 * (world_size - pof2), 2))
    # Ranks that sat out neither send nor receive between the fold and the unfold.
    middle = schedule.steps[1:-1]
    assert not folded & {r for step in middle for t in step.transfers for r in (t.src, t.dst)}


def test_hierarchical_phases_and_which_links_they_use():
    schedule = build_hierarchical_schedule(6, local_size=2)  # 3 nodes x 2 ranks
    assert [name for name, _, _ in schedule.phases] == [
        "intra-node reduce-scatter", "inter-node all-reduce", "intra-node all-gather",
    ]
    for step in schedule.steps:
        same_node = {t.src // 2 == t.dst // 2 for t in step.transfers}
        assert same_node == ({False} if step.phase == "inter-node all-reduce" else {True})


def test_hierarchical_reads_local_world_size_and_rejects_shapes_that_do_not_divide(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert build_hierarchical_schedule(6) == build_hierarchical_schedule(6, local_size=3)
    with pytest.raises(ValueError, match="does not divide the world size 8"):
        build_hierarchical_schedule(8)
    with pytest.raises(ValueError, match="does not divide"):
        build_schedule("hierarchical", 6, local_size=4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        build_hierarchical_schedule(6)


def test_tree_rejects_bad_segments():
    with pytest.raises(ValueError, match="segments >= 1"):
        build_tree_schedule(4, segments=0)


@pytest.mark.parametrize("algorithm, options", [
    ("naive", {}), ("tree", {"segments": 3}), ("halving_doubling", {}), ("hierarchical", {"local_size": 3}),
])
def test_replay_on_numbers_gives_the_sum_everywhere(algorithm, options):
    schedule = build_schedule(algorithm, 9, **options)
    initial = [[2**rank] * schedule.num_chunks for rank in range(9)]
    assert final_state(schedule, initial, lambda a, b: a + b) == ((2**9 - 1,) * schedule.num_chunks,) * 9


@pytest.mark.parametrize("algorithm", ["naive", "tree", "halving_doubling"])
def test_every_step_names_a_phase_and_reduces_before_copying(algorithm):
    schedule = build_schedule(algorithm, 7)
    ops = [t.op for step in schedule.steps for t in step.transfers]
    first_copy = ops.index(Op.COPY)
    assert all(op is Op.REDUCE for op in ops[:first_copy]) and all(op is Op.COPY for op in ops[first_copy:])
    assert all(step.phase for step in schedule.steps)
