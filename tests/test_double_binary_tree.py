"""The double binary tree: NCCL's trees, the promises of its docstring, and real gloo ranks 1..9.

Pure tests check the trees against NCCL's own picture (``src/graph/trees.cc``), that no rank
works hard in both trees, that its per-link formula counts the schedule's steps, and, counted
per NIC (every rank's links sharing its NIC), that its bandwidth comes within ``p/(p-1)`` of
the ring's where the binomial tree's does not. The spawned test runs it on 9 gloo ranks, on
subgroups of 1..9, with uneven and empty chunks, against ``dist.all_reduce``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import ddp_ring_hooks
from ddp_ring_hooks.cost_model import bytes_sent_per_rank, predict, simulate
from ddp_ring_hooks.schedules import build_schedule, check_all_reduce
from ddp_ring_hooks.schedules.double_binary_tree import binary_tree, double_binary_trees
from tests._dist import run_ranks
from tests.conftest import digest, rank_input, within_summation_bound

N = 2.0**24  # bytes per rank


def inner(parents) -> set[int]:
    return {parent for parent in parents if parent is not None}


@pytest.mark.fast
def test_the_first_tree_is_nccls_fourteen_rank_picture():
    # trees.cc:  0---8;  8: 4 12;  4: 2 6;  12: 10 13;  2: 1 3;  6: 5 7;  10: 9 11
    expected = {8: 0, 4: 8, 12: 8, 2: 4, 6: 4, 10: 12, 13: 12, 1: 2, 3: 2, 5: 6, 7: 6, 9: 10, 11: 10}
    assert binary_tree(14) == tuple(expected.get(rank) for rank in range(14))


@pytest.mark.fast
def test_the_second_tree_is_the_mirror_for_even_and_the_shift_for_odd_world_sizes():
    first, second = double_binary_trees(14)
    assert second == tuple(None if first[13 - r] is None else 13 - first[13 - r] for r in range(14))
    # trees.cc's 13-rank picture of the shifted tree:  1---9;  9: 5 0;  5: 3 7;  0: 11;  3: 2 4; ...
    _, shifted = double_binary_trees(13)
    assert shifted[9] == 1 and shifted[5] == shifted[0] == 9 and shifted[3] == shifted[7] == 5
    assert shifted[11] == 0 and shifted[2] == shifted[4] == 3 and shifted[12] == 11


@pytest.mark.fast
@pytest.mark.parametrize("world_size", range(2, 65))
def test_each_rank_is_inner_in_one_tree_at_most_and_moves_at_most_half_a_buffer_per_tree(world_size):
    trees = double_binary_trees(world_size)
    both = inner(trees[0]) & inner(trees[1])
    # Odd p: rank 0, the first tree's root with one child; p = 3: two chains (mirrored, see the docstring).
    assert both <= ({0, 2} if world_size == 3 else {0} if world_size % 2 else set())
    for parents in trees:
        assert sorted(r for r, parent in enumerate(parents) if parent is None) == [parents.index(None)]  # one root
        children = [sum(parent == r for parent in parents) for r in range(world_size)]
        assert max(children) <= 2
    # Per phase, every rank sends and receives at most n (a half-buffer per tree and direction).
    schedule = build_schedule("double_binary_tree", world_size, segments=4)
    for phase, start, stop in schedule.phases:
        for rank in range(world_size):
            chunks = [t for step in schedule.steps[start:stop] for t in step.transfers]
            sent = sum(t.src == rank for t in chunks) / schedule.num_chunks
            received = sum(t.dst == rank for t in chunks) / schedule.num_chunks
            assert sent <= 1 and received <= 1, (phase, rank, sent, received)


@pytest.mark.fast
@pytest.mark.parametrize("segments", [1, 2, 5, 16])
def test_it_is_an_all_reduce_with_one_segment_per_link_and_step(segments):
    for world_size in range(1, 34):
        schedule = build_schedule("double_binary_tree", world_size, segments=segments)
        check_all_reduce(schedule)
        for step in schedule.steps:
            links = [(t.src, t.dst) for t in step.transfers]
            assert step.transfers and len(links) == len(set(links)), (world_size, step)


@pytest.mark.fast
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 7, 8, 9, 16, 17, 100, 128, 1000, 1024])
@pytest.mark.parametrize("segments", [1, 3])
def test_latency_grows_like_lg_p(world_size, segments):
    schedule = build_schedule("double_binary_tree", world_size, segments=segments)
    levels = math.ceil(math.log2(world_size))
    up = 2 * levels - 2 + (world_size & (world_size - 1) == 0)
    assert [(name, stop - start) for name, start, stop in schedule.phases] == [
        ("reduce", up + segments - 1), ("broadcast", levels + segments - 1),
    ]
    assert predict("double_binary_tree", 0, world_size, alpha=1.0, beta=0.0, segments=segments) == len(schedule.steps)
    assert len(schedule.steps) <= 3 * levels + 2 * (segments - 1)


@pytest.mark.fast
@pytest.mark.parametrize("world_size", [4, 6, 8, 13, 16, 32])
def test_per_nic_its_bandwidth_is_within_p_over_p_minus_1_of_the_ring_and_the_binomial_trees_is_not(world_size):
    p = world_size
    per_nic = {"alpha": 0.0, "beta": 1e-9, "placement": tuple(range(p)), "shared_uplinks": True}
    ring = simulate(build_schedule("ring", p), N, **per_nic)
    assert ring == pytest.approx(2 * (p - 1) / p * N * 1e-9)  # the lower bound
    deep = simulate(build_schedule("double_binary_tree", p, segments=512), N, **per_nic)
    assert p / (p - 1) <= deep / ring <= p / (p - 1) * 1.05
    assert max(bytes_sent_per_rank(build_schedule("double_binary_tree", p, segments=512), N)) <= 2 * N
    binomial = simulate(build_schedule("tree", p, segments=512), N, **per_nic)
    assert binomial / ring > 1.3 * p / (p - 1)  # its root's links share one NIC


@pytest.mark.fast
def test_segments_are_checked():
    with pytest.raises(ValueError, match="segments=0 must be an integer >= 1"):
        build_schedule("double_binary_tree", 4, segments=0)


WORLD = 9


def every_size_on_nine_ranks(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    report = {}
    for p in range(1, WORLD + 1):
        group = dist.new_group(list(range(p)))  # collective: every rank calls it
        if rank >= p:
            continue
        for segments in (1, 3):
            for numel in sorted({0, 1, p - 1, 2 * p + 1, 1009}):
                inputs = [rank_input(r, numel, torch.float32) for r in range(p)]
                ours, native = inputs[rank].clone(), inputs[rank].clone()
                ddp_ring_hooks.all_reduce(ours, algorithm="double_binary_tree", group=group, segments=segments)
                dist.all_reduce(native, group=group)
                report[(p, segments, numel)] = (within_summation_bound(ours, inputs, torch.float32, p), digest(ours))
    return report


def test_on_real_gloo_ranks_it_sums_and_every_rank_ends_bit_identical():
    reports = run_ranks(every_size_on_nine_ranks, WORLD, timeout=300)
    for case, (error, _) in reports[0].items():
        p = case[0]
        assert error <= 1.0, f"{case}: off by {error:.2f} x the bound"
        assert len({report[case][1] for report in reports[:p]}) == 1, f"{case}: ranks differ bit-wise"
    assert {case[0] for case in reports[0]} == set(range(1, WORLD + 1))
